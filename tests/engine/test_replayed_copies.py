"""Note [Guarded replay] (adaptive_eager/engine/replay.py): a steady-state `copy_` between two
tensors of one core that its handler would queue (Note [Direct copies]) is replayed from the
trace like any op, and the view of `a[i]` is found by its view key (results.view_at, Note
[View keys]): `buf.copy_(y)` and `a[i] = y` loops skip the templates and shape inference in
the steady state, with the slow path's values, versions, launches, flushes, device time and
timeline (`replay=False`), and CPU's values and errors."""
import contextlib

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.engine import engine as E
from adaptive_eager.engine import results as R
from adaptive_eager.engine import transfer as T

N = "neuron"
MODES = ["eager", "adaptive", "adaptive-default-policy"]


def _mode(mode):
    if mode == "eager":
        return contextlib.nullcontext()
    if mode == "adaptive":
        return ae.adaptive(strategy="graph")
    return ae.adaptive()  # the default strategy and policy (device-idle flushes)


def run(fn, state, mode, n=3, last=contextlib.nullcontext, **settings):
    """`fn(*state)` n times, each followed by a sync, the last one inside `last()`: the last
    result(s) on the host, the last step's metrics and timeline entries (name, kind,
    duration, bytes, FLOPs)."""
    dev = E.ENGINE.device
    with ae.override(**settings), _mode(mode):
        for _ in range(n - 1):
            fn(*state)
            torch.neuron.synchronize()
        ae.reset_metrics()
        dev.trace.clear()
        with last():
            out = fn(*state)
            torch.neuron.synchronize()
        m = ae.metrics()
        # (durations to the ns: they are differences of clock readings, whose last bits
        # depend on how far the clock has run in this process)
        timeline = [t[:2] + (round(t[3], 3),) + t[4:6] for t in dev.trace]
    outs = out if isinstance(out, (list, tuple)) else [out]
    return [o.cpu() for o in outs], m, timeline


def same_work(a, b) -> bool:
    return (a.ops, a.launches, a.flushes, a.group_sizes, a.device_time_us) == \
        (b.ops, b.launches, b.flushes, b.group_sizes, b.device_time_us)


def copies(buf, x):  # the host-overhead benchmark's copy_ program
    y = x
    for _ in range(6):
        buf.copy_(y)
        y = buf * 1.0001
    return y, buf


def setitem(a, x):  # ... and its setitem program
    y = x
    for i in range(10):
        a[i % 4] = y
        y = y * 1.0001
    return y, a


def _fresh(program, dev):
    x = torch.randn(16, generator=torch.Generator().manual_seed(0)).to(dev)
    return (torch.zeros(16, device=dev), x) if program is copies else \
        (torch.zeros(4, 16, device=dev), x)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("program", [copies, setitem], ids=["copy_", "setitem"])
def test_steady_state_copies_and_setitem_take_the_fast_path(program, mode):
    """The steady step calls no template and no shape inference; every copy_ it queues is
    replayed (eager: each is done at the call, Note [Direct copies], on the host views its
    buffers keep, Note [Host views]); values and versions are CPU's, and the work and
    timeline those of the slow path (`replay=False`), which check_replay agrees with op by
    op."""
    cpu = _fresh(program, "cpu")
    state = _fresh(program, N)
    run(program, state, mode)  # (warm: compiles)
    calls = []

    @contextlib.contextmanager
    def spied():
        with pytest.MonkeyPatch.context() as mp:
            for module, name in [(E, "template"), (T, "template"), (R, "template"),
                                 (E, "infer"), (E, "infer_view"), (T, "buffer_view")]:
                f = getattr(module, name)
                mp.setattr(module, name, lambda *a, _f=f, _n=name, **k: calls.append(_n)
                           or _f(*a, **k))
            yield

    out, m, timeline = run(program, state, mode, last=spied)
    assert calls == []
    n = 3 + 3  # (the warm run's steps too)
    for _ in range(n):
        want = program(*cpu)
    assert all(torch.equal(o, w) for o, w in zip(out, want))
    assert [t._version for t in state] == [t._version for t in cpu]
    views = 10 if program is setitem else 0  # (never replayed: they queue nothing)
    copied = 6 if program is copies else 10
    if mode == "eager":  # every copy_ at the call; the rest from traces (Note [Eager launches])
        assert m.replayed_ops == m.ops - views - copied
    else:  # the step's first copy_ (of x, nothing queued) is done at the call
        assert m.replayed_ops == m.ops - views - 1
    slow, ms, timeline_s = run(program, _fresh(program, N), mode, n, replay=False)
    assert all(torch.equal(o, s) for o, s in zip(out, slow))
    assert same_work(m, ms) and timeline == timeline_s and ms.replayed_ops == 0
    checked, mc, _ = run(program, _fresh(program, N), mode, n, check_replay=True)
    assert all(torch.equal(o, c) for o, c in zip(out, checked))
    assert mc.replayed_ops == m.replayed_ops


def _layouts(dev, inputs):
    """copy_ and setitem of queued values across layouts, broadcasting, dtypes, aliasing."""
    x, xi, big, t, col, ints, f, n, b, h, d = inputs
    y = x * 1.5  # (4, 6), queued in adaptive mode
    t.t().copy_(y)  # into a transposed view
    big[1:5, 2:8].copy_(y.t().t() + 1)  # into a view at an offset
    col.copy_(y[:, :1] * 2)  # (4, 1) from a strided column
    d.copy_(col)  # (4, 1) broadcast into (4, 6)
    d[1:3].copy_(y[0] - 1)  # (6,) broadcast into (2, 6)
    f.copy_(ints + 3)  # int64 -> float32
    n.copy_(y * 10)  # float32 -> int32 (truncated)
    b.copy_(y)  # float32 -> bool
    h.copy_(y / 3)  # float32 -> float16 (rounded)
    y.copy_(y)  # one tensor onto itself
    z = y * 1
    z.t().copy_(y.t())  # transposed onto transposed
    for i in range(4):
        big[i + 2, :6] = z[i] + i  # setitem, rows at offsets
        big[:, 7 - i] = xi[:, i] * 0.5  # columns (stride 8), from a strided source
    big[-1, 1:7] = y[3:4]  # a (1, 6) row into a (6,) view (setitem drops leading 1s)
    return z, t, big, col, d, f, n, b, h


def test_copies_across_layouts_dtypes_and_aliasing_are_cpus_and_replayed():
    g = torch.Generator().manual_seed(1)

    def inputs(dev):
        return [v.to(dev) for v in (
            torch.randn(4, 6, generator=g), torch.randn(8, 4, generator=g),
            torch.zeros(8, 8), torch.zeros(6, 4), torch.zeros(4, 1),
            torch.randint(-50, 50, (4, 6), generator=g), torch.zeros(4, 6),
            torch.zeros(4, 6, dtype=torch.int32), torch.zeros(4, 6, dtype=torch.bool),
            torch.zeros(4, 6, dtype=torch.float16), torch.zeros(4, 6))]

    base = inputs("cpu")
    cpu = [v.clone() for v in base]
    want = _layouts("cpu", cpu)
    for mode in MODES:
        run(_layouts, (N, [v.to(N) for v in base]), mode)  # (warm: compiles)
        out, m, timeline = run(_layouts, (N, [v.to(N) for v in base]), mode)
        assert all(o.dtype == w.dtype and torch.equal(o, w) for o, w in zip(out, want)), mode
        slow, ms, timeline_s = run(_layouts, (N, [v.to(N) for v in base]), mode, replay=False)
        assert all(torch.equal(o, s) for o, s in zip(out, slow))
        assert same_work(m, ms) and timeline == timeline_s, mode
        if mode != "eager":  # (eager: every copy_ here is done at the call)
            assert m.replayed_ops > m.ops // 2, (mode, m.replayed_ops, m.ops)
        checked, _, _ = run(_layouts, (N, [v.to(N) for v in base]), mode, check_replay=True)
        assert all(torch.equal(o, c) for o, c in zip(out, checked))


@pytest.mark.parametrize("mode", MODES)
def test_errors_of_a_replayed_step_are_cpus_at_the_call(mode):
    """In the steady state, a copy_ or setitem CPU refuses (broadcast, overlap, index out of
    range) raises CPU's error at the call, and the engine goes on with CPU's values."""
    cpu = _fresh(setitem, "cpu")
    state = _fresh(setitem, N)

    def bad(a, x, kind):
        y = x * 2
        a[1] = y
        if kind == "broadcast":
            a[2].copy_(torch.ones(5, device=a.device) * y[:5])
        elif kind == "index":
            a[4] = y
        elif kind == "overlap":
            z = y * 1
            z[1:].copy_(z[:-1])
        a[3] = y + 1
        return a

    with _mode(mode):
        for _ in range(3):
            setitem(*state)
            torch.neuron.synchronize()
        for _ in range(3):
            setitem(*cpu)
        for kind in ("broadcast", "index", "overlap"):
            with pytest.raises(Exception) as ec:
                bad(*cpu, kind)
            with pytest.raises(type(ec.value)) as e:
                bad(*state, kind)
            assert str(e.value) == str(ec.value), kind
            for _ in range(2):
                out = setitem(*state)[1]
                torch.neuron.synchronize()
                want = setitem(*cpu)[1]
                assert torch.equal(out.cpu(), want)
            assert torch.equal(state[0].cpu(), cpu[0])


def test_a_traced_copy_the_handler_would_do_at_the_call_is_not_replayed():
    """Note [Guarded replay]: a trace's copy_ was queued because its source was poisoned (a
    failed launch: Note [Poison]); the same step on a healthy source matches the trace
    op for op, but the handler copies at the call (nothing queued touches either buffer,
    Note [Direct copies]), so the replay does not queue it: the work is the slow path's."""
    x = torch.arange(5.).to(N)

    def step(buf, src):
        y = x * 2
        buf.copy_(src)
        return buf + y

    def runs(replay):
        buf = torch.zeros(1).to(N)
        good = torch.ones(1).to(N)
        with ae.override(replay=replay), ae.adaptive(strategy="graph"):
            for _ in range(2):  # the copy_'s signature, queued (its source is queued)
                buf.copy_(good * 1)
                torch.neuron.synchronize()
            bad = x.index_select(0, torch.tensor([9]).to(N))  # fails at run time
            with pytest.raises(ae.NeuronRuntimeError):
                torch.neuron.synchronize()
            poisoned = step(buf, bad)  # the copy_ is queued: its source is poisoned
            torch.neuron.synchronize()
            with pytest.raises(ae.NeuronRuntimeError):
                poisoned.cpu()
            buf = torch.zeros(1).to(N)  # (the failed step poisoned the old one)
            ae.reset_metrics()
            out = step(buf, good)
            torch.neuron.synchronize()
            return out.cpu(), ae.metrics()

    out, m = runs(True)
    slow, ms = runs(False)
    assert torch.equal(out, slow) and torch.equal(out, torch.ones(1) + torch.arange(5.) * 2)
    assert same_work(m, ms) and m.flushes == {"direct copy": 1, "synchronize": 1}
    assert m.replayed_ops == 1  # the mul from the poisoned step's trace; the copy_ at the
    # call, the add the slow way
