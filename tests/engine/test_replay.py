"""Note [Replay] (adaptive_eager/engine/replay.py): steady-state ops queued from the trace of the same
step last time. Replay changes host time only: values, launches, flushes and device time are
those of the slow path, which `replay=False` forces and `check_replay=True` runs beside it."""
import contextlib

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.tools.models import train

N = "neuron"


def chain(x, n=40):
    for _ in range(n):
        x = x * 1.0001 + 0.001
    return x


def steps(fn, n, **settings):
    """Run `fn` n times (each followed by a sync), adaptive graph, default policy; return the
    last result on the host and the metrics of the last step."""
    with ae.override(**settings), ae.adaptive(strategy="graph"):
        for _ in range(n - 1):
            fn()
            torch.neuron.synchronize()
        ae.reset_metrics()
        out = fn()
        torch.neuron.synchronize()
        m = ae.metrics()
    return out.cpu(), m


def same_work(a, b) -> bool:
    return (a.ops, a.launches, a.flushes, a.group_sizes, a.device_time_us) == \
        (b.ops, b.launches, b.flushes, b.group_sizes, b.device_time_us)


@pytest.mark.parametrize("low", [0, 2], ids=["lazy", "default-policy"])
def test_steady_state_chain_is_replayed_with_the_slow_paths_results(low):
    x = torch.randn(16).to(N)
    kw = dict(queue_low_threshold=low, max_group_ops=16)  # several segments per step
    out, m = steps(lambda: chain(x), 3, **kw)
    slow, ms = steps(lambda: chain(x), 3, replay=False, **kw)
    assert m.replayed_ops == m.ops == 80 and ms.replayed_ops == 0
    assert torch.equal(out, slow) and torch.equal(out, chain(x.cpu()))
    assert same_work(m, ms) and m.launches >= 5


def test_every_replayed_op_agrees_with_the_slow_path():
    """check_replay: each replayed op's cache key, buffers, runtime values and cut are the
    slow path's (an AssertionError otherwise) on a training step of each model."""
    for kind in ("mlp", "gpt"):  # (steps 1 and 2 differ: the optimizer's state is made)
        with ae.adaptive():
            ref, _ = train(kind, N, steps=4)
            ae.reset_metrics()
            with ae.override(check_replay=True):
                checked, _ = train(kind, N, steps=4)
            m = ae.metrics()
        assert checked == ref and m.replayed_ops > m.ops // 4, (kind, m.replayed_ops, m.ops)


def test_a_step_that_changes_midway_leaves_the_replay_with_the_same_work():
    """The trace matches the first ops, then the step differs (another scalar type, another
    shape, a new op): the slow path takes over mid-segment and the online group is rebuilt
    from the replayed nodes, so grouping and flushes are those of a run with no replay."""
    x, y = torch.randn(16).to(N), torch.randn(8).to(N)
    variants = [lambda: chain(x, 10) * 2, lambda: chain(x, 10) * 2.0,
                lambda: chain(x, 10).sum() + chain(y, 5).sum(), lambda: chain(x, 10).exp()]

    def run(replay):
        outs, ms = [], []
        with ae.override(queue_low_threshold=2, max_group_ops=8, replay=replay), \
                ae.adaptive(strategy="graph"):
            for v in variants + variants[::-1] + variants:
                ae.reset_metrics()
                outs.append(v().cpu())
                ms.append(ae.metrics())
        return outs, ms
    slow, mss = run(False)  # (first: its compiles are not compared)
    outs, ms = run(True)
    assert all(torch.equal(a, b) for a, b in zip(outs, slow))
    assert all(same_work(a, b) for a, b in zip(ms, mss))
    assert sum(m.replayed_ops for m in ms) > 0


def test_a_replayed_ops_deferred_error_names_the_users_line():
    x = torch.arange(5.).to(N)

    def step(i):
        y = x * 2
        return y.index_select(0, i)  # the line named

    with ae.override(queue_low_threshold=0), ae.adaptive():
        for _ in range(3):
            step(torch.tensor([1]).to(N))
            torch.neuron.synchronize()
        ae.reset_metrics()
        bad = step(torch.tensor([9]).to(N))  # out of range: fails at run time
        assert ae.metrics().replayed_ops == 2
        with pytest.raises(ae.NeuronRuntimeError, match="index_select") as e:
            torch.neuron.synchronize()
    line = step.__code__.co_firstlineno + 2
    assert f'test_replay.py", line {line}' in str(e.value)
    with pytest.raises(ae.NeuronRuntimeError):
        bad.cpu()


def test_replay_follows_settings_and_modes():
    """A trace is made under one policy (lazy or eager, a strategy): after a switch, ops
    take the slow path until a trace of the new policy exists; results never change."""
    x = torch.randn(16).to(N)
    want = chain(x.cpu(), 12)
    for strategy in ("graph", "matmul", "graph"):
        for adaptive in (True, False, True):
            with ae.adaptive(adaptive, strategy=strategy):
                for _ in range(3):
                    assert torch.equal(chain(x, 12).cpu(), want)
    with ae.adaptive():
        for _ in range(3):
            ae.reset_metrics()
            chain(x, 12).cpu()
    assert ae.metrics().replayed_ops == 24


def test_replay_follows_flush_to_zero():
    """Note [CPU settings]: a queue runs under one flush-to-zero mode; an op issued under
    another flushes it first. Replayed ops keep that rule (and replay goes on after the
    setting was ever used)."""
    x = torch.full((4,), 3e-38).to(N)
    try:
        with ae.adaptive():
            for ftz in (True, False, True, False):
                torch.set_flush_denormal(ftz)
                want = x.cpu() * 0.01 * 0.5
                for _ in range(3):
                    ae.reset_metrics()
                    assert torch.equal((x * 0.01 * 0.5).cpu(), want)
                assert ae.metrics().replayed_ops == 2
    finally:
        torch.set_flush_denormal(False)


def test_ops_of_our_handlers_are_not_replayed_past_the_handler():
    """An in-place foreach op is queued by a handler of ours that also bumps its tensors'
    versions (as CPU does): a replayed step still goes through it, so autograd still sees
    the write (`_version`) and the step's values are CPU's."""
    def step(ts, g):
        torch._foreach_add_(ts, [g, g])
        return ts[0] * 2 + ts[1]

    cpu = [torch.ones(4), torch.ones(4)]
    dev = [t.to(N) for t in cpu]
    g = torch.arange(4.0)
    with ae.adaptive(strategy="graph"):
        for _ in range(4):
            out = step(dev, g.to(N))
            torch.neuron.synchronize()
        m = ae.metrics()
    for _ in range(4):
        ref = step(cpu, g)
    assert m.replayed_ops > 0
    assert [t._version for t in dev] == [t._version for t in cpu]
    assert torch.equal(out.cpu(), ref)
    # an op such a handler queued is followed only where its guard says the handler would
    # queue it (Note [Guarded replay]: `copy_`'s, here; tests/engine/test_replayed_copies.py)
    # or by the handler itself (Note [Handled replay]: the foreach op's)
    a, b = torch.zeros(4).to(N), torch.ones(4).to(N)
    with ae.adaptive(strategy="graph"):
        for _ in range(3):
            ae.reset_metrics()
            (a.copy_(b * 2) + 1).sum()
            torch.neuron.synchronize()
        m = ae.metrics()
    assert m.ops == 4 and m.replayed_ops == 4, (m.ops, m.replayed_ops)


def test_a_step_picks_among_the_traces_that_begin_with_its_first_op():
    """Two steps whose first op is the same op overload with other arguments (a scalar, a
    tensor): each finds its own trace among those filed under that op, newest first."""
    x, y = torch.randn(8).to(N), torch.randn(8).to(N)
    steps_ = [lambda: (x * 2.0 + 1).sum(), lambda: (x * y + 1).sum()]
    with ae.adaptive(strategy="graph"):
        for i in range(6):
            ae.reset_metrics()
            out = steps_[i % 2]()
            torch.neuron.synchronize()
            m = ae.metrics()
    assert m.ops == 3 and m.replayed_ops == 3, (m.ops, m.replayed_ops)
    assert torch.equal(out.cpu(), (x.cpu() * y.cpu() + 1).sum())


def eager_steps(fn, n, **settings):
    """`steps` in eager mode: the last result on the host, the last step's metrics and its
    timeline entries (name, kind, duration, bytes, FLOPs)."""
    from adaptive_eager.engine.engine import ENGINE
    dev = ENGINE.device
    with ae.override(**settings):
        for _ in range(n - 1):
            fn()
            torch.neuron.synchronize()
        ae.reset_metrics()
        dev.trace.clear()  # (in a long run the timeline is full: its length no longer grows)
        out = fn()
        torch.neuron.synchronize()
        m = ae.metrics()
        timeline = [t[:2] + t[3:6] for t in dev.trace]
    return out.cpu(), m, timeline


def test_eager_ops_are_launched_from_their_traces_with_the_slow_paths_work(monkeypatch):
    """Note [Eager launches]: a steady-state eager op is launched at once from its one-op
    trace, never queued, with the slow path's values, launches, flushes, plan hits and
    timeline entries."""
    from adaptive_eager.engine import queue
    x, a = torch.randn(16).to(N), torch.randn(16).to(N)

    def fn():
        return torch.add(chain(x * a, 12), a, alpha=2)

    queued = []
    enqueue = queue.Segment.enqueue
    monkeypatch.setattr(queue.Segment, "enqueue",
                        lambda self, node, *rest: queued.append(node) or enqueue(self, node, *rest))
    out, m, timeline = eager_steps(fn, 3)
    assert m.replayed_ops == m.ops == 26
    assert len(queued) < 26 * 3 - 26  # the last step queued nothing (earlier ones may)
    fast = len(queued)
    slow, ms, timeline_s = eager_steps(fn, 3, replay=False)
    assert len(queued) == fast + 26 * 3 and ms.replayed_ops == 0
    assert torch.equal(out, slow) and torch.equal(out, torch.add(
        chain(x.cpu() * a.cpu(), 12), a.cpu(), alpha=2))
    assert same_work(m, ms) and m.launches == 26 and m.flushes == {"eager": 26}
    assert (m.plan_hits, m.plan_misses) == (ms.plan_hits, ms.plan_misses) == (26, 0)
    assert timeline == timeline_s and len(timeline) == 26 + 1  # and the sync
    from adaptive_eager.engine.engine import ENGINE
    assert ENGINE.last_report.n_ops == 1 and ENGINE.last_report.plan_hit


def test_eager_ops_replayed_from_traces_skip_the_plain_dispatch(monkeypatch):
    """Note [Eager launches]: Engine.dispatch tries the traces beginning with an op before
    routing it, so a steady-state eager op never enters Engine.dispatch_plain (its route,
    count and trace lookup were a frame each), and is counted once, with the slow path's
    clock: the same start time of every launch."""
    from adaptive_eager.engine import engine as E
    x, a = torch.randn(16).to(N), torch.randn(16).to(N)

    def fn():
        return torch.add(chain(x * a, 6), a, alpha=2)

    def steps(**kw):
        with ae.override(**kw):
            for _ in range(2):
                fn()
                torch.neuron.synchronize()
            dev = E.ENGINE.device
            dev.trace.clear()
            ae.reset_metrics()
            t0 = dev.host_us
            calls.clear()
            out = fn()
            torch.neuron.synchronize()
            m = ae.metrics()
            return out.cpu(), m, [t[:2] + (round(t[2] - t0, 6),) + t[3:6] for t in dev.trace]

    calls = []
    plain = E.Engine.dispatch_plain
    monkeypatch.setattr(E.Engine, "dispatch_plain",
                        lambda self, *a, **k: calls.append(a[0]) or plain(self, *a, **k))
    out, m, timeline = steps()
    assert calls == [] and m.replayed_ops == m.ops == 14
    slow, ms, timeline_s = steps(replay=False)
    assert len(calls) == 14 and ms.replayed_ops == 0
    assert torch.equal(out, slow) and same_work(m, ms) and timeline == timeline_s


def _python_calls(op) -> list[str]:
    """The qualified names of the Python functions `op()` runs."""
    import sys
    calls = []

    def profile(frame, event, arg):
        if event == "call":
            calls.append(frame.f_code.co_qualname)
    sys.setprofile(profile)
    try:
        op()
    finally:
        sys.setprofile(None)
    return calls


def test_a_steady_eager_launch_runs_none_of_the_bookkeepings_helpers(monkeypatch):
    """Note [Eager launches]: a steady eager op makes no FlushReport (the engine keeps its
    fields; `last_report` makes it when read), hashes its plan key with no Python frame
    (the strategy's key holds the spec's fingerprint), and its output buffer is made in one
    frame (no `Device.alloc`); `ae.explain()` reads the same report as without replay."""
    from adaptive_eager.engine import engine as E
    from fusion import flush
    made = []

    class Report(flush.FlushReport):
        def __init__(self, *a, **k):
            made.append(a)
            super().__init__(*a, **k)
    monkeypatch.setattr(flush, "FlushReport", Report)
    monkeypatch.setattr(E, "FlushReport", Report, raising=False)
    x, a = torch.randn(16).to(N), torch.randn(16).to(N)

    def fn():
        y = x
        for _ in range(4):
            y = y * a
        return y

    def explained(**kw):
        with ae.override(**kw):
            for _ in range(3):
                fn()
                torch.neuron.synchronize()
            y = [x * a]
            made.clear()
            calls = _python_calls(lambda: y.append(y.pop() * a))  # (the old buffer freed)
            reports = len(made)
            text = str(ae.explain())
            assert len(made) == 1 and str(ae.explain()) == text and len(made) == 1
            torch.neuron.synchronize()
            return calls, reports, text, y[0].cpu()

    calls, reports, text, out = explained()
    helpers = {"Device.alloc", "_Key.__hash__", "call_key"}
    assert "Traces.again" in calls and "Buffer.__del__" in calls, calls
    assert reports == 0 and not helpers & set(calls), (reports, helpers & set(calls))
    slow_calls, slow_reports, slow_text, slow = explained(replay=False)
    assert "Traces.again" not in slow_calls and slow_reports == 0
    assert text == slow_text and "1 launch" in text and torch.equal(out, slow)


def test_a_steady_eager_launch_takes_the_one_op_path_and_looks_at_one_frame(monkeypatch):
    """Note [Eager launches]: a steady eager op's plan knows its one group (`Plan.one`), so
    its launch runs none of the general launch's steps (`Runner._execute`, `_written`), and
    its source walk looks at the user's frame only, as a process-wide adaptive op's does
    (`follow` skips `step`'s frames, known to be ours); the line is the user's."""
    from adaptive_eager.engine import source

    looked = []

    class Kinds(dict):
        def get(self, k, default=None):
            looked.append(k)
            return dict.get(self, k, default)
    monkeypatch.setattr(source, "_KINDS", Kinds(source._KINDS))
    x, a = torch.randn(16).to(N), torch.randn(16).to(N)

    def op(y):
        return y * a  # the line named

    def steady(**kw):
        with ae.override(**kw):
            y = x
            for _ in range(4):
                y = op(y)
                torch.neuron.synchronize()
            looked.clear()
            calls = _python_calls(lambda: op(y))
            n = len(looked)
            lines = list(ae.explain().groups[-1]["lines"]) if not kw else None
            torch.neuron.synchronize()
            return calls, n, lines

    calls, eager_looks, lines = steady()
    assert "Traces.again" in calls and "Runner.run_sig" in calls, calls
    assert not {"Runner._execute", "Runner._written", "Device.submit"} & set(calls), calls
    _, adaptive_looks, _ = steady(adaptive=True)
    assert eager_looks == adaptive_looks == 1, (eager_looks, adaptive_looks)
    assert lines == [f"{__file__}:{op.__code__.co_firstlineno + 1}"], lines


def test_an_eager_launch_from_a_trace_raises_at_the_call_under_launch_blocking():
    x = torch.arange(5.).to(N)

    def step(i):
        y = x * 2
        return y.index_select(0, i)  # the line named

    with ae.override(launch_blocking=True):
        for _ in range(3):
            step(torch.tensor([1]).to(N))
        ae.reset_metrics()
        with pytest.raises(ae.NeuronRuntimeError, match="index_select") as e:
            step(torch.tensor([9]).to(N))  # out of range: fails at run time, raised here
        assert ae.metrics().replayed_ops == 2
    line = step.__code__.co_firstlineno + 2
    assert f'test_replay.py", line {line}' in str(e.value)
    assert torch.equal((x * 2).index_select(0, torch.tensor([3]).to(N)).cpu(),
                       torch.tensor([6.]))  # the engine stays usable


def test_host_views_are_reused_and_keep_tensor_identity():
    """Note [Host views]: launches hand kernels the CPU tensors earlier launches made over
    their buffers; in-place writes through them, one object passed twice and two objects
    over one buffer (told apart by CPU's overlap rules) keep CPU's results."""
    xc = torch.randn(16)
    x = xc.to(N)
    for _ in range(3):  # eager: one launch per op
        y = x * 2
        x.add_(y)
        xc.add_(xc * 2)
        x.mul_(x)
        xc.mul_(xc)
        z = torch.add(x, x.detach(), alpha=0.5)
        assert torch.equal(x.cpu(), xc) and torch.equal(z.cpu(), torch.add(xc, xc, alpha=0.5))
        w = x.view(4, 4).t() * 3  # another layout of the same buffer
        assert torch.equal(w.cpu(), xc.view(4, 4).t() * 3)
    assert x._handle.buffer.host is not None  # kept on the buffer for the next launch


def test_a_launch_finds_the_host_view_its_writer_kept_by_identity():
    """Note [Host views]: a layout key is one object per layout, so the key a launch's
    output keeps on its buffer is the very key its readers' executables look for."""
    from adaptive_eager.engine.engine import ENGINE
    x, a = torch.randn(16).to(N), torch.randn(16).to(N)
    for _ in range(3):
        y = x * a
        z = y * a
    key = y._handle.buffer.host[0]
    keys = [k for plan in ENGINE.runner.plans.values() for g in plan.groups
            for _, _, k in g.exe.host_views if k == key]
    assert keys and all(k is key for k in keys)
    assert torch.equal(z.cpu(), x.cpu() * a.cpu() * a.cpu())


def test_eager_ops_of_many_layouts_and_bfloat16_launch_from_their_traces(monkeypatch):
    """Note [Eager launches] with traces filed by their first argument's layout: a matmul
    of six layouts per step (more than an op's four places) and bfloat16 ops (their launch
    cost at the faster peak) are launched from their traces in the steady state, with the
    slow path's values, metrics and timeline."""
    from adaptive_eager.engine import queue
    ws = [torch.randn(8, k).to(N) for k in (3, 4, 5, 6, 7, 9)]
    xs = [torch.randn(k, 2).to(N) for k in (3, 4, 5, 6, 7, 9)]
    h = torch.randn(8, 8, dtype=torch.bfloat16).to(N)

    def fn():
        out = sum(w.mm(x) for w, x in zip(ws, xs))
        return out + (h * h + h).sum()

    queued = []
    enqueue = queue.Segment.enqueue
    monkeypatch.setattr(queue.Segment, "enqueue",
                        lambda self, node, *rest: queued.append(node) or enqueue(self, node, *rest))
    out, m, timeline = eager_steps(fn, 3)
    fast = len(queued)
    assert m.replayed_ops == m.ops
    slow, ms, timeline_s = eager_steps(fn, 3, replay=False)
    assert len(queued) - fast == 3 * m.ops  # every op queued without replay...
    _, m2, _ = eager_steps(fn, 3)
    assert len(queued) - fast - 3 * m.ops < 2 * m.ops  # ...the last step with it none
    cpu = sum(w.cpu().mm(x.cpu()) for w, x in zip(ws, xs))
    hc = h.cpu()
    assert torch.equal(out, slow) and torch.equal(out, cpu + (hc * hc + hc).sum())
    assert same_work(m, ms) and same_work(m2, ms) and timeline == timeline_s


def test_eager_launch_of_the_last_step_queues_nothing_for_many_layouts(monkeypatch):
    """The steady state's step queues nothing though one op has six signatures (it did
    queue each matmul when traces were filed by op alone: four places, evicted each step)."""
    from adaptive_eager.engine import queue
    ws = [torch.randn(4, k).to(N) for k in (3, 4, 5, 6, 7, 9)]
    xs = [torch.randn(k, 2).to(N) for k in (3, 4, 5, 6, 7, 9)]

    def fn():
        return [w.mm(x) for w, x in zip(ws, xs)][-1]

    for _ in range(3):
        fn()
    queued = []
    enqueue = queue.Segment.enqueue
    monkeypatch.setattr(queue.Segment, "enqueue",
                        lambda self, node, *rest: queued.append(node) or enqueue(self, node, *rest))
    fn()
    torch.neuron.synchronize()
    assert queued == []


def test_views_found_by_their_keys_are_the_template_paths(monkeypatch):
    """Note [View keys]: a view given one tensor and ints skips the templates in the steady
    state, with CPU's values, layouts and aliasing; another global state, int lists against
    tuples and another layout find their own meta results; a freed storage and another
    core's tensor still raise."""
    from adaptive_eager.engine import engine as E
    xc = torch.randn(4, 6)
    x = xc.to(N)

    def views(t):
        return [t.view(6, 4), t.view((3, 8)), t.t(), t.transpose(0, 1), t[1:3], t.detach(),
                t.expand(2, 4, 6), t.unsqueeze(0), t.view(-1)]

    for _ in range(2):
        views(x)
    calls = []
    template = E.template
    monkeypatch.setattr(E, "template", lambda *a, **k: calls.append(a[1]) or template(*a, **k))
    got = views(x)
    assert calls == []
    for g, c in zip(got, views(xc)):
        assert g.shape == c.shape and g.stride() == c.stride() and g.storage_offset() == \
            c.storage_offset() and torch.equal(g.cpu(), c)
    got[0][0, 0] = 5.0  # aliasing: the view writes its base
    xc.view(6, 4)[0, 0] = 5.0
    assert torch.equal(x.cpu(), xc)
    y = x.t()  # another layout: its own entry
    assert torch.equal(y.view(-1).cpu(), xc.t().reshape(-1)) if y.is_contiguous() else True
    assert torch.equal(x.t().contiguous().view(24).cpu(), xc.t().contiguous().view(24))
    with torch.inference_mode():  # another global state: inference tensors, as CPU's
        assert x.view(6, 4).is_inference() == xc.view(6, 4).is_inference()
    assert x.view(6, 4).is_inference() == xc.view(6, 4).is_inference() is False
    with pytest.raises(RuntimeError) as e:
        x.view(5, 5)
    with pytest.raises(RuntimeError) as ec:
        xc.view(5, 5)
    assert str(e.value) == str(ec.value)


def test_a_view_key_keeps_an_entry_per_global_state(monkeypatch):
    """Note [View keys]: a layout viewed under two global states (a weight's `t()` in the
    forward, grad mode on, and in the backward or under no_grad, grad mode off) finds its
    view key's meta result under each, every time: no state pushes the other's entry out
    (the template way, every step, for 44 of a GPT step's views). Values, layouts, aliasing
    and autograd as on CPU."""
    from adaptive_eager.engine import engine as E
    wc = torch.randn(4, 6, requires_grad=True)
    w = wc.detach().to(N).requires_grad_()

    def views(t):
        a = t.t()
        with torch.no_grad():
            b = t.t()
            c = t.view(6, 4)
        d = t.view(6, 4)
        with torch.inference_mode():
            e = t.t()
        return a, b, c, d, e

    for _ in range(2):
        views(w)
    calls = []
    template = E.template
    monkeypatch.setattr(E, "template", lambda *a, **k: calls.append(a[1]) or template(*a, **k))
    for _ in range(3):
        got = views(w)
    assert calls == []
    for g, c in zip(got, views(wc)):
        assert g.shape == c.shape and g.stride() == c.stride() and g._base is w \
            and g.requires_grad == c.requires_grad and (g.grad_fn is None) == (c.grad_fn is None) \
            and g.is_inference() == c.is_inference() and torch.equal(g.detach().cpu(), c.detach())
    (got[0].sum() * 2 + got[3].sum()).backward()
    (got_c := views(wc))[0].sum().mul(2).add(got_c[3].sum()).backward()
    assert torch.equal(w.grad.cpu(), wc.grad)


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_views_skip_the_replay_which_stays_on_across_them(monkeypatch, mode):
    """Note [Replayed views] in engine/handlers.py: a view never reaches the replay (`follow`, `step`:
    no trace holds it), and the replay goes on across it: every other op of a steady step is
    replayed. Views alias as on CPU: `_base`, versions, in-place writes through a view,
    gradients, values bit for bit."""
    from adaptive_eager.engine import engine as E, replay as R
    from fusion.ops import VIEW, op_class

    def step(x, w):
        y = (x * 2.0).view(24).view(6, 4)
        z = (y.unsqueeze(0) @ w.t()).squeeze(0).transpose(0, 1)  # (_unsafe_view: a view)
        z = (y * z.t()).transpose(0, 1)
        v = z[1:3]
        v.mul_(3.0)  # through the view: z's buffer, z's version
        (z.exp() + v.sum()).sum().backward()
        return y, z, v

    xc, wc = torch.randn(4, 6), torch.randn(4, 4, requires_grad=True)
    x, w = xc.to(N), wc.detach().to(N).requires_grad_()
    seen, ops = [], []
    dispatch = E.Engine.dispatch
    monkeypatch.setattr(E.Engine, "dispatch", lambda self, func, *a: ops.append(func)
                        or dispatch(self, func, *a))
    for name in ("follow", "step"):
        real = getattr(R, name)
        monkeypatch.setattr(R, name, lambda eng, func, *a, real=real: seen.append(func)
                            or real(eng, func, *a))
    with ae.override(adaptive=mode == "adaptive"):
        for _ in range(3):
            w.grad = None
            seen.clear()
            ops.clear()
            ae.reset_metrics()
            got = step(x, w)
            torch.neuron.synchronize()
            m = ae.metrics()
    wc.grad = None
    want = step(xc, wc)
    unsafe = torch.ops.aten._unsafe_view.default  # (its handler dispatches a view: counted once)
    views = [f for f in ops if op_class(f) == VIEW and f is not unsafe]
    assert unsafe in ops
    assert len(views) >= 6 and seen and not [f for f in seen if op_class(f) == VIEW], seen
    # every other op, but in eager mode the backward's 2 copy_ done at the call (Note [Direct
    # copies] in transfer.py)
    assert m.ops - len(views) - m.replayed_ops == (2 if mode == "eager" else 0), m
    for g, c in zip(got, want):
        assert g.shape == c.shape and g.stride() == c.stride() and g._version == c._version
        assert torch.equal(g.detach().cpu(), c.detach())
    assert got[2]._base is got[1]._base is not None and want[2]._base is want[1]._base
    assert torch.equal(w.grad.cpu(), wc.grad)


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_like_factories_are_replayed_where_their_handler_would_queue_them(mode):
    """Note [Guarded replay]: `ones_like` (a backward's grad seed), `new_zeros`, `full_like`
    on this core are replayed (transfer.queues_like); with a CPU device= the handler makes
    them there, and the next call is replayed again. Values and work as the slow path's."""
    xc = torch.randn(4, 6, requires_grad=True)
    x = xc.detach().to(N).requires_grad_()

    def step(x, device=None):
        (x * 2.0).sum().backward()
        y = torch.ones_like(x) + x.new_zeros(4, 6) + torch.full_like(x, 3.0, device=device)
        return y * x.grad

    def run(**kw):
        with ae.override(adaptive=mode == "adaptive", **kw):
            for _ in range(3):
                x.grad = None
                ae.reset_metrics()
                out = step(x)
                torch.neuron.synchronize()
                m = ae.metrics()
            x.grad = None
            on_cpu = torch.full_like(x, 3.0, device="cpu")
            again = torch.ones_like(x)
            m2 = ae.metrics() - m
            assert on_cpu.device.type == "cpu" and torch.equal(on_cpu, torch.full((4, 6), 3.0))
            assert torch.equal(again.cpu(), torch.ones(4, 6))
        return out.cpu(), m, m2
    out, m, m2 = run()
    slow, ms, _ = run(replay=False)
    xc.grad = None
    assert torch.equal(out, step(xc)) and torch.equal(out, slow) and same_work(m, ms)
    assert m.ops == 12 and m.replayed_ops == m.ops - 2, m  # all but 2 views (sum's expand,
    # AccumulateGrad's detach); main: 6 of 12 (eager), 6 (adaptive)
    assert m2.ops == 1 and m2.replayed_ops == (mode == "eager"), m2  # (CPU's is not ours; in
    # adaptive mode no trace begins there)


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_zero_dim_host_tensors_are_replayed_as_values_read_at_the_call(mode):
    """Note [Replay]: a 0-d host tensor argument (`y * torch.tensor(1.5)`) is replayed as a
    runtime value, copied at the call as the template copies it: changing it afterwards (in
    place, before the flush) does not change the queued op; another dtype or a 1-d host
    tensor takes the slow path; check_replay agrees, NaN values included."""
    x = torch.randn(16)
    xd = x.to(N)

    def fn(x, s, t):
        y = x
        for v in (1.5, float("nan"), -2.0):
            s.fill_(v)
            y = y * s + t
        return y * torch.tensor(2.0)

    def run(x, n, **settings):
        s, t = torch.tensor(0.0), torch.tensor(0.25)
        ctx = ae.adaptive() if mode == "adaptive" else contextlib.nullcontext()
        with ae.override(**settings), ctx:
            for _ in range(n - 1):
                fn(x, s, t)
                torch.neuron.synchronize()
            ae.reset_metrics()
            out = fn(x, s, t)
            torch.neuron.synchronize()
            m = ae.metrics()
        return out.cpu(), m

    out, m = run(xd, 3)
    ref = fn(x, torch.tensor(0.0), torch.tensor(0.25))
    same = dict(rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(out, ref, **same)
    assert m.replayed_ops == m.ops == 7
    checked, mc = run(xd, 3, check_replay=True)
    torch.testing.assert_close(checked, ref, **same)
    assert mc.replayed_ops == 7
    slow, ms = run(xd, 3, replay=False)
    torch.testing.assert_close(slow, ref, **same)
    assert same_work(m, ms) and ms.replayed_ops == 0


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_tensor_lists_are_replayed(mode):
    """Note [Replay]: an op given a list of tensors on distinct buffers (`stack`, `cat`) is
    replayed, each tensor checked as a tensor argument; a list holding one tensor twice,
    or a later argument naming a listed tensor again, takes the slow path; the values,
    work and check_replay's answers are the slow path's."""
    x = torch.randn(4, 4)
    xd = x.to(N)

    def fn(x):
        y = x
        for _ in range(3):
            y = torch.stack([y, y * 1.5]).sum(0)
            y = torch.cat([y, x.t()], 1)[:, :4]
            y = torch.cat([y, y]).view(2, 4, 4).mean(0)  # one tensor twice: the slow path
        return torch.addcmul(y, y, y)

    def run(n, **settings):
        ctx = ae.adaptive() if mode == "adaptive" else contextlib.nullcontext()
        with ae.override(**settings), ctx:
            for _ in range(n - 1):
                fn(xd)
                torch.neuron.synchronize()
            ae.reset_metrics()
            out = fn(xd)
            torch.neuron.synchronize()
            m = ae.metrics()
        return out.cpu(), m

    out, m = run(3)
    torch.testing.assert_close(out, fn(x), rtol=1e-6, atol=1e-6)
    slow, ms = run(3, replay=False)
    assert torch.equal(out, slow) and same_work(m, ms) and ms.replayed_ops == 0
    checked, mc = run(3, check_replay=True)
    assert torch.equal(out, checked) and mc.replayed_ops == m.replayed_ops
    # 28 ops; not replayed: 9 views (never are) and the 3 doubled cats (main: the stacks and
    # the other cats too, 10 replayed)
    assert (m.replayed_ops, m.ops) == (16, 28)


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_a_list_naming_a_buffer_twice_is_not_replayed_as_two(mode):
    """Note [Replay]: a tensor list's buffers must be distinct to follow a trace that had
    them distinct (checked once per call: `follow`). A steady `stack([a, b])` (and
    `_foreach_add_`, `_foreach_mul`) at the start of a segment, called with `[a, a]`, takes
    the slow path; values, versions and aliasing are CPU's, bit for bit."""
    a, b = torch.randn(3, 4), torch.randn(3, 4)

    def fn(u, v, w):
        s = torch.stack([u, v])
        torch._foreach_add_([w, v], 1.5)
        m = torch._foreach_mul([u, v], 2.0)
        return s, m[0], m[1]

    ctx = ae.adaptive() if mode == "adaptive" else contextlib.nullcontext()
    ac, bc, wc = a.clone(), b.clone(), b.clone()
    ad, bd, wd = a.to(N), b.to(N), b.to(N)
    with ctx:
        for _ in range(3):
            want = fn(ac, bc, wc)
            got = fn(ad, bd, wd)
            torch.neuron.synchronize()
        ae.reset_metrics()
        got = fn(ad, ad, ad)  # each list names one buffer twice
        torch.neuron.synchronize()
        m = ae.metrics()
    want = fn(ac, ac, ac)
    assert m.ops == 3 and m.replayed_ops == 0
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w)
    assert torch.equal(ad.cpu(), ac) and torch.equal(bd.cpu(), bc) and ad._version == ac._version


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_adamw_foreach_steps_are_replayed_through_the_version_bumping_handler(mode):
    """Note [Handled replay]: torch.optim.AdamW(foreach=True)'s in-place foreach ops are
    replayed, their handler still refusing inference tensors and bumping versions: the
    values are CPU's bit for bit, the work and timeline the slow path's, and a tensor saved
    for backward then written by a replayed foreach op fails backward as on CPU."""
    from adaptive_eager.engine.engine import ENGINE

    def train(dev, n=4, **settings):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 4)).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        x = torch.randn(5, 8).to(dev)
        ctx = ae.adaptive() if mode == "adaptive" and dev == N else contextlib.nullcontext()
        with ae.override(**settings), ctx:
            for _ in range(n):
                opt.zero_grad()
                model(x).square().sum().backward()
                if dev == N:  # the step alone
                    torch.neuron.synchronize()
                    ae.reset_metrics()
                    ENGINE.device.trace.clear()
                opt.step()
        if dev != N:
            return list(model.parameters()), None, None
        torch.neuron.synchronize()
        m = ae.metrics()  # (the sync's wait: the clock's sums, rounded as they fall)
        timeline = [t[:2] + (round(t[3], 6),) + t[4:6] for t in ENGINE.device.trace]
        return [p.detach().cpu() for p in model.parameters()], m, timeline

    ref, _, _ = train("cpu")
    train(N, replay=False)  # (executables warm: neither run below compiles, whatever ran first)
    out, m, timeline = train(N)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    # 8 ops: _foreach_mul_ (weight decay), _foreach_lerp_, _foreach_mul_, _foreach_addcmul_
    # (grads twice), _foreach_sqrt, _foreach_div_ and _foreach_addcdiv_ (each step's bias
    # corrections: runtime Scalar[] values), _foreach_add_; s14 replayed 5 (not the
    # addcmul_, div_, addcdiv_)
    assert (m.ops, m.replayed_ops) == (8, 8), (m.ops, m.replayed_ops)
    slow, ms, timeline_s = train(N, replay=False)
    assert all(torch.equal(a, b) for a, b in zip(slow, ref))
    assert same_work(m, ms) and ms.replayed_ops == 0 and timeline == timeline_s
    checked, mc, _ = train(N, check_replay=True)
    assert all(torch.equal(a, b) for a, b in zip(checked, ref)) and mc.replayed_ops == 8

    def versions(dev):
        """Parameters saved for backward, then written by a foreach op (as `step()` before
        `backward()` writes them): each backward raises, on the replayed path too."""
        ps = [torch.ones(4).to(dev).requires_grad_() for _ in range(2)]
        ctx = ae.adaptive() if mode == "adaptive" and dev == N else contextlib.nullcontext()
        replayed = []
        with ctx:
            for _ in range(4):
                if dev == N:
                    ae.reset_metrics()
                y = (ps[0] * ps[1]).sum()
                with torch.no_grad():
                    torch._foreach_mul_(ps, 0.5)
                if dev == N:
                    torch.neuron.synchronize()
                    replayed.append(ae.metrics().replayed_ops)
                with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                    y.backward()
        return [p._version for p in ps], [p.detach().cpu() for p in ps], replayed

    vc, pc, _ = versions("cpu")
    vn, pn, replayed = versions(N)
    assert vn == vc and all(torch.equal(a, b) for a, b in zip(pn, pc))
    assert replayed[-1] == 3, replayed  # mul, sum and _foreach_mul_ (main: 2)
    # the handler still refuses an inference tensor before anything is counted or queued
    with torch.inference_mode():
        inf = [torch.ones(4).to(N) for _ in range(2)]
    ctx = ae.adaptive() if mode == "adaptive" else contextlib.nullcontext()
    with ctx:
        ts = [torch.ones(4).to(N) for _ in range(2)]
        for _ in range(3):
            torch._foreach_mul_(ts, 0.5)
            torch.neuron.synchronize()
        ae.reset_metrics()
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
            torch._foreach_mul_(inf, 0.5)
        assert ae.metrics().ops == 0
        torch._foreach_mul_(ts, 0.5)
        torch.neuron.synchronize()
        assert (ae.metrics().ops, ae.metrics().replayed_ops) == (1, 1)
    assert torch.equal(ts[0].cpu(), torch.full((4,), 0.5 ** 4))


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_a_list_passed_again_is_replayed(mode):
    """Note [Replay]: a tensor list argument holding the very tensors of an earlier list
    argument, in order (`_foreach_addcmul_(exp_avg_sqs, grads, grads)`, AdamW's), is
    replayed, even as another list object; the same tensors in another order take the slow
    path. Values and versions are CPU's, the work the slow path's, check_replay agrees."""
    def fn(a, b, c):
        torch._foreach_addcmul_(a, b, b, value=0.5)
        torch._foreach_addcmul_(a, c, list(c), value=0.25)  # another list object
        torch._foreach_addcmul_(a, b, b[::-1], value=2.0)  # another order: the slow path
        return a

    def run(dev, n=3, **settings):
        torch.manual_seed(0)
        a, b, c = ([torch.randn(3, 5).to(dev) for _ in range(4)] for _ in range(3))
        ctx = ae.adaptive() if mode == "adaptive" and dev == N else contextlib.nullcontext()
        with ae.override(**settings), ctx:
            for _ in range(n):
                if dev == N:
                    torch.neuron.synchronize()
                    ae.reset_metrics()
                fn(a, b, c)
            if dev == N:
                torch.neuron.synchronize()
                m = ae.metrics()
                return [t.cpu() for t in a], [t._version for t in a], m
        return a, [t._version for t in a], None

    ref, vref, _ = run("cpu")
    out, v, m = run(N)
    assert all(torch.equal(x, y) for x, y in zip(out, ref)) and v == vref
    assert (m.ops, m.replayed_ops) == (3, 2), m  # main: (3, 0)
    slow, _, ms = run(N, replay=False)
    assert all(torch.equal(x, y) for x, y in zip(slow, ref)) and same_work(m, ms)
    checked, _, mc = run(N, check_replay=True)
    assert all(torch.equal(x, y) for x, y in zip(checked, ref)) and mc.replayed_ops == 2


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_scalar_lists_are_replayed_as_runtime_values(mode):
    """Note [Replay]: a Scalar[] argument (`_foreach_div_(xs, [c1, c2])`, AdamW's bias
    corrections, new values every step) is replayed as runtime values of the same types,
    read at the call: each step's values are used, bit for bit CPU's; other element types
    (an int among floats) take the slow path. Work as the slow path's; check_replay agrees."""
    def fn(xs, ys, zs, i):
        torch._foreach_div_(xs, [1.0 + i / 7, 2.0 - i / 9, 0.5 + i])
        torch._foreach_addcdiv_(xs, ys, zs, [0.1 * i, -0.3, 1.0 / (i + 1)])
        torch._foreach_mul_(xs, [2.0, 3, 0.5] if i == 2 else [2.0, 3.0, 0.5])
        return xs

    def run(dev, n=4, **settings):
        torch.manual_seed(0)
        xs, ys, zs = ([torch.randn(2, 3).to(dev) for _ in range(3)] for _ in range(3))
        ctx = ae.adaptive() if mode == "adaptive" and dev == N else contextlib.nullcontext()
        ms = []
        with ae.override(**settings), ctx:
            for i in range(n):
                if dev == N:
                    torch.neuron.synchronize()
                    ae.reset_metrics()
                fn(xs, ys, zs, i)
                if dev == N:
                    torch.neuron.synchronize()
                    ms.append(ae.metrics())
        return [x.cpu() for x in xs], ms

    ref, _ = run("cpu")
    out, ms = run(N)
    assert all(torch.equal(x, y) for x, y in zip(out, ref))
    # step 2's int in the list is another key (the slow path); then in eager mode step 3
    # replays all 3 again, in adaptive mode the trace of step 2, till its mul_ (main: none)
    assert [(m.ops, m.replayed_ops) for m in ms[1:]] == [
        (3, 3), (3, 2), (3, 3 if mode == "eager" else 2)], ms
    slow, mss = run(N, replay=False)
    assert all(torch.equal(x, y) for x, y in zip(slow, ref))
    assert all(same_work(a, b) for a, b in zip(ms, mss))
    checked, mc = run(N, check_replay=True)
    assert all(torch.equal(x, y) for x, y in zip(checked, ref))
    assert [m.replayed_ops for m in mc] == [m.replayed_ops for m in ms]


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_in_place_ops_are_replayed_while_a_conj_view_is_alive_elsewhere(mode):
    """Note [Copied views] in errors.py: the replay declines an op that writes a copied
    view's buffer, and only such an op (a first version turned every in-place op's replay off
    once any conj view existed). A steady in-place step on a tensor of its own is replayed
    whole while a materialized conj view lives; the same step given the conj view is
    declined, so the slow path refuses it (replayed, it would write the copy silently)."""
    from adaptive_eager import errors

    def step(t):
        t.add_(1).mul_(2)
        torch.neuron.synchronize()

    z0 = torch.tensor([1 + 2j, 3 - 1j, -2 + 0.5j])
    z = z0.to(N)
    with ae.override(adaptive=mode == "adaptive"):
        view = z.conj()  # materialized on the device: a copied view
        assert view._handle in errors.COPIED_VIEWS
        x = torch.zeros(3, dtype=torch.cfloat).to(N)
        for _ in range(3):
            ae.reset_metrics()
            step(x)
            m = ae.metrics()
        assert (m.ops, m.replayed_ops) == (2, 2), m
        assert torch.equal(x.cpu(), torch.full((3,), 14 + 0j))
        ae.reset_metrics()
        with pytest.raises(RuntimeError, match=r"a write through a conj\(\) or neg view"):
            step(view)
        assert ae.metrics().replayed_ops == 0
        assert torch.equal(z.cpu(), z0) and torch.equal(view.cpu(), z0.conj().resolve_conj())
