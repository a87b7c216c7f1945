"""One structural test per fusion pattern (launches and groups), known non-fusions pinned.

Each runs purely lazily (queue threshold 0) so groups do not depend on simulated timing."""
import pytest
import torch
import torch.nn.functional as F

import adaptive_eager as ae
from tests.harness.fallback import FALLBACK_OP, fallback


def lazy(fn, strategy="graph", **settings):
    """Run fn lazily; return (result, explanation of its one flush, metrics)."""
    with ae.override(queue_low_threshold=0, **settings), ae.adaptive(strategy=strategy):
        ae.reset_metrics()
        out = fn()
        torch.neuron.synchronize()
    m = ae.metrics()
    return out, ae.explain(), m


def rand(*shape):
    return torch.randn(*shape).to("neuron")


def names(ex):
    return [g["name"] for g in ex.groups]


def test_pointwise_chain_is_one_launch():
    x = rand(64, 64)
    out, ex, m = lazy(lambda: ((x * 2 + 1).relu() * 0.5).sigmoid())
    assert m.launches == 1 and m.ops == 5
    assert names(ex) == ["mul.Tensor|add.Tensor|relu|mul.Tensor|sigmoid"]
    torch.testing.assert_close(out.cpu(), ((x.cpu() * 2 + 1).relu() * 0.5).sigmoid())


def test_softmax_decomposed_reductions_and_pointwise_is_one_launch():
    x = rand(8, 32)

    def softmax():
        e = (x - x.amax(-1, keepdim=True)).exp()
        return e / e.sum(-1, keepdim=True)

    out, ex, m = lazy(softmax)
    assert m.launches == 1 and ex.groups[0]["ops"] == 5
    torch.testing.assert_close(out.cpu(), x.cpu().softmax(-1))


def test_layer_norm_decomposed_is_one_launch():
    x, w, b = rand(8, 32), rand(32), rand(32)

    def layer_norm():
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) * torch.rsqrt(var + 1e-5) * w + b

    out, ex, m = lazy(layer_norm)
    assert m.launches == 1 and m.ops >= 8
    torch.testing.assert_close(out.cpu(), F.layer_norm(x.cpu(), (32,), w.cpu(), b.cpu()),
                               rtol=1e-4, atol=1e-5)


def test_gelu_mlp_is_one_launch():
    x, w1, b1, w2, b2 = rand(16, 32), rand(64, 32), rand(64), rand(32, 64), rand(32)
    out, ex, m = lazy(lambda: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2) + x)
    assert names(ex) == ["addmm|gelu|addmm|add.Tensor"]
    assert m.launches == 1
    ref = F.linear(F.gelu(F.linear(x.cpu(), w1.cpu(), b1.cpu())), w2.cpu(), b2.cpu()) + x.cpu()
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)


def test_attention_scores_mask_softmax_and_pv_are_one_launch():
    q, k, v = rand(2, 4, 8, 16), rand(2, 4, 8, 16), rand(2, 4, 8, 16)
    mask = torch.triu(torch.full((8, 8), float("-inf")), 1).to("neuron")
    out, ex, m = lazy(lambda: ((q @ k.transpose(-2, -1)) * 0.25 + mask).softmax(-1) @ v)
    assert m.launches == 1
    assert "bmm|mul.Tensor|add.Tensor|_softmax|" in ex.groups[0]["name"]
    assert ex.groups[0]["name"].count("bmm") == 2
    ref = ((q.cpu() @ k.cpu().transpose(-2, -1)) * 0.25 + mask.cpu()).softmax(-1) @ v.cpu()
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
def test_optimizer_step_over_many_parameters_is_one_launch(foreach):
    params = [torch.nn.Parameter(rand(16, 16)) for _ in range(10)]
    for p in params:
        p.grad = rand(16, 16)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
    _, ex, m = lazy(opt.step)
    assert m.launches == 1, ex
    if foreach:
        assert m.ops < 3 * len(params)  # a few foreach calls for all parameters
    else:
        assert m.ops >= 10 * len(params)  # ~10 ops per parameter, all in one launch


def test_freed_intermediates_are_not_written_back():
    x = rand(256)
    _, ex, m = lazy(lambda: (x * 2 + 1).exp())
    assert m.bytes_saved == 2 * 1024  # (x*2) and (x*2+1) died before the flush
    _, _, m = lazy(lambda: (x * 2 + 1).exp(), skip_intermediate=False)
    assert m.bytes_saved == 0


# -- known non-fusions ---------------------------------------------------------------
def test_contraction_limit_per_group():
    x, w = rand(8, 8), rand(8, 8)
    _, ex, m = lazy(lambda: x @ w @ w @ w @ w @ w @ w)
    assert [g["name"].count("mm") for g in ex.groups] == [4, 2]
    assert ex.boundaries == ["contraction limit (4)"]
    _, ex, m = lazy(lambda: x @ w @ w @ w, max_group_contractions=1)
    assert m.launches == 3 and set(ex.boundaries) == {"contraction limit (1)"}


def test_working_set_beyond_sbuf_is_cut_unless_the_group_is_elementwise():
    """Note [Elementwise groups stream]: pointwise ops only run tile by tile (one group,
    whatever SBUF holds); once a reduction joins, every value the group makes counts."""
    from device import DeviceSpec
    ae.set_device_spec(DeviceSpec(sbuf_bytes=2048))
    try:
        x = rand(256)  # 1 KiB values
        chain, ex, m = lazy(lambda: (((x * 2) + 1) * 3) + 4)
        scan, ex2, m2 = lazy(lambda: ((x * 2) + 1).cumsum(0) * 3 + 4)
    finally:
        ae.set_device_spec(DeviceSpec())
    assert [g["ops"] for g in ex.groups] == [4] and ex.boundaries == []
    assert [g["ops"] for g in ex2.groups] == [2, 2, 1]
    assert ex2.boundaries == ["SBUF capacity"] * 2
    xc = x.cpu()
    torch.testing.assert_close(chain.cpu(), (((xc * 2) + 1) * 3) + 4, rtol=0, atol=0)
    torch.testing.assert_close(scan.cpu(), ((xc * 2) + 1).cumsum(0) * 3 + 4, rtol=0, atol=0)


def test_integer_indexing_is_queued_and_a_boolean_mask_is_a_barrier():
    """`x[idx]` (aten::index) is tagged dynamic-shape for the boolean-mask case only: with
    integer (or host) indices it is queued and fused like any op, with a mask it runs now."""
    x = torch.randn(50, 4)
    idx = torch.tensor([3, 1, 4, 1, 5])
    xn, idxn = x.to("neuron"), idx.to("neuron")
    with ae.override(queue_low_threshold=0), ae.adaptive():
        ae.reset_metrics()
        y = (xn[idxn] * 2 + xn[idx]).sum(0)  # a device and a host index tensor
        m = ae.metrics()
        assert m.flushes == {} and m.launches == 0  # nothing ran yet
        picked = xn[xn[:, 0] > 0]  # needs the mask's values now
        assert ae.metrics().flushes.get("data-dependent:aten::index") == 1
    assert torch.equal(y.cpu(), (x[idx] * 3).sum(0))
    assert torch.equal(picked.cpu(), x[x[:, 0] > 0])


def test_isin_is_queued_not_a_fallback():
    """`torch.isin` (generate's stopping criteria, every token) fell back to the CPU: a
    sync per call. Its output has its input's shape: the device runs it queued."""
    x, ids = torch.tensor([[1, 2], [3, 4]]), torch.tensor([2, 3, 9])
    xn, idsn = x.to("neuron"), ids.to("neuron")
    with ae.override(queue_low_threshold=0), ae.adaptive():
        ae.reset_metrics()
        y = torch.isin(xn * 1, idsn) & ~torch.isin(xn, idsn, invert=True)
        m = ae.metrics()
        assert m.flushes == {} and m.cpu_fallbacks == {}
    assert torch.equal(y.cpu(), torch.isin(x, ids))


def test_data_dependent_op_is_a_barrier():
    x = rand(32)
    with ae.override(queue_low_threshold=0), ae.adaptive():
        ae.reset_metrics()
        y = (x * 2).relu()
        nz = torch.nonzero(y)  # needs y's values now
        z = (y + 1).sum()
        z.item()
    m = ae.metrics()
    assert m.flushes.get("data-dependent:aten::nonzero") == 1 and m.flushes.get("item") == 1
    assert m.launches == 3  # [mul|relu], nonzero, [add|sum]
    assert nz.shape[1] == 1


def test_cpu_fallback_is_a_barrier():
    x = rand(3, 3)
    ae.engine.engine.ENGINE.warned.discard(FALLBACK_OP)
    with ae.override(queue_low_threshold=0), ae.adaptive(), pytest.warns(UserWarning,
                                                                          match="fell back"):
        ae.reset_metrics()
        y = fallback(x * 2 + torch.eye(3, device="neuron"))
        (y + 1).sum().item()
    assert ae.metrics().flushes.get("fallback:" + FALLBACK_OP) == 1


def test_size_limit_bounds_groups():
    x = rand(8)
    _, ex, m = lazy(lambda: [x.add_(1) for _ in range(10)][-1], max_group_ops=4)
    assert [g["ops"] for g in ex.groups] == [4, 4, 2]
    assert set(ex.boundaries) == {"size limit (4 ops)"}


def test_random_ops_keep_eager_order():
    def draw():
        torch.manual_seed(7)
        a = torch.rand(5, device="neuron") * 2
        b = torch.randn(5, device="neuron") + a
        return a, b

    ea, eb = draw()
    (la, lb), ex, _ = lazy(draw)
    assert torch.equal(ea.cpu(), la.cpu()) and torch.equal(eb.cpu(), lb.cpu())


# -- the reference's matmul strategy ------------------------------------------------
def test_matmul_strategy_reproduces_reference_grouping_on_linear_stack():
    torch.manual_seed(0)
    stack = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8),
                                torch.nn.ReLU(), torch.nn.Linear(8, 8)).to("neuron")
    x = rand(4, 8)
    with torch.no_grad():
        _, ref, _ = lazy(lambda: stack(x), strategy="matmul")
        _, ours, _ = lazy(lambda: stack(x), strategy="graph")
    assert names(ref) == ["addmm", "relu|addmm", "relu|addmm"]
    assert set(ref.boundaries) == {"after matmul"}
    assert names(ours) == ["addmm|relu|addmm|relu|addmm"]


def test_matmul_strategy_runs_inplace_ops_unfused():
    x = rand(8)
    _, ex, m = lazy(lambda: (x * 2).add_(1).mul(3), strategy="matmul")
    assert names(ex) == ["mul.Tensor", "add_.Tensor", "mul.Tensor"]
    assert set(ex.boundaries) == {"in-place op"}


def test_none_strategy_is_eager_grouping():
    x = rand(8)
    _, ex, m = lazy(lambda: (x * 2 + 1).relu(), strategy="none")
    assert m.launches == 3


# -- plans, caches, failures, explain ------------------------------------------------
def test_identical_step_reuses_plan_and_compiles_nothing():
    x, w = rand(16, 16), rand(16, 16)

    def step():
        return ((x @ w).relu() * 0.5 + x).sum()

    lazy(step)
    _, ex, m = lazy(step)
    # a reused plan looks nothing up: no cache hit is counted for it
    assert m.compiles == 0 and m.plan_hits == 1 and m.cache_memory_hits == 0
    assert ex.report.plan_hit


def test_generated_run_calls_kernels_directly():
    """Note [Generated runs]: a fused pointwise chain runs as one generated function calling
    each op's kernel, not through the interpreter's per-op decoding."""
    x = rand(16)
    out, ex, _ = lazy(lambda: ((x * 2 + 1).relu() - 0.5).abs())
    exe = ex.report.plan.groups[0].exe
    code = exe.generated.__code__
    assert "run_instr" not in code.co_names
    assert sorted(n for n in code.co_names if n.startswith("K")) == ["K0", "K1", "K2", "K3",
                                                                    "K4"]
    torch.testing.assert_close(out.cpu(), ((x.cpu() * 2 + 1).relu() - 0.5).abs(),
                               rtol=0, atol=0)
    calls, gen = [], exe.generated

    def counted(*a):
        calls.append(1)
        return gen(*a)
    counted.checked, counted.fixed = gen.checked, gen.fixed
    exe.generated = counted
    try:  # the same step again: its plan, and so this executable, is reused and run
        again, _, m = lazy(lambda: ((x * 2 + 1).relu() - 0.5).abs())
    finally:
        exe.generated = gen
    assert m.plan_hits == 1 and calls == [1] and torch.equal(again.cpu(), out.cpu())


def test_generated_run_stops_at_a_failed_op_as_the_interpreter_does(monkeypatch):
    """A kernel error in the middle of a generated run: the ops before it ran, the failed
    op's dependents are poisoned (reading them raises the op's error), independent ops
    after it still run; the interpreter (forced by a poisoned entry) agrees."""
    from fusion import program

    def run(force_interpreter):
        x = torch.arange(5.).to("neuron")
        idx = torch.tensor([7]).to("neuron")
        a = x * 2
        bad = x.index_select(0, idx) * 3  # out of range: fails at run time
        ok = a + 1  # independent of the failure, after it in the group
        with pytest.raises(ae.NeuronRuntimeError, match="index_select"):
            torch.neuron.synchronize()
        with pytest.raises(ae.NeuronRuntimeError, match="index_select"):
            bad.cpu()
        return a.cpu().tolist(), ok.cpu().tolist()

    with ae.override(queue_low_threshold=0), ae.adaptive(strategy="graph"):
        generated = run(False)
        real = program.Executable.run

        def interpreted(self, st, inputs, rng, poisoned, causes=None, views=None):
            poisoned.add(-1)  # no slot is -1: the interpreter runs, nothing is skipped
            try:
                return real(self, st, inputs, rng, poisoned, causes, views)
            finally:
                poisoned.discard(-1)
        monkeypatch.setattr(program.Executable, "run", interpreted)
        interp = run(True)
    assert generated == interp == ([0., 2., 4., 6., 8.], [1., 3., 5., 7., 9.])


def test_generated_run_tells_kernel_errors_from_internal_ones_by_op():
    """Note [Generated runs]: an exception names the op it stopped at, and is the kernel's
    own error (the kernel call raised) or an internal one (anything else: here a runtime
    scalar missing from the op's inputs, as a bug of ours would leave it)."""
    x = rand(16)
    _, ex, _ = lazy(lambda: (x * 2 + 1) * 3)
    exe = ex.report.plan.groups[0].exe
    assert len(exe.instrs) == 3

    def run(inputs):
        st = [None] * exe.program.n_slots
        st[0] = x._handle.buffer.storage
        return exe.generated(st, inputs, None, [None] * (exe.n_views + exe.program.n_slots))

    for _ in range(20):  # the same answers once Python has specialized the function
        assert run([[2], [1], [3]]) is None
        k, err = run([[2], [], [3]])  # op 1's scalar is missing: our bug, not the kernel's
        assert k == 1 and err.internal and isinstance(err.cause, IndexError)
        k, err = run([[2], [1], ["3"]])  # op 2's kernel refuses its argument
        assert k == 2 and not err.internal and "Expected a value of type" in str(err.cause)


def test_layouts_are_checked_until_two_runs_prove_them():
    """Note [Proven layouts] in fusion/codegen.py: a generated run checks each result's
    layout until two runs needed no copy; then it skips the checks, with the same values. A
    run that had to copy a result into its layout keeps checking."""
    from fusion import program

    x = rand(4, 4)
    step = lambda: (x * 2 + 1) * 3  # noqa: E731
    ref = (x.cpu() * 2 + 1) * 3
    out, ex, _ = lazy(step)
    exe = ex.report.plan.groups[0].exe
    assert exe.generated.checked and not exe.generated.fixed
    for _ in range(3):  # runs 2 (checked: proves them), 3 and 4 (unchecked)
        again, ex2, m = lazy(step)
        assert m.plan_hits == 1 and ex2.report.plan.groups[0].exe is exe
        assert not exe.generated.checked and torch.equal(again.cpu(), ref)
    assert "stride" not in exe.generated.__code__.co_names  # no check left

    # an op whose result comes out laid out otherwise than its signature says
    o = exe.instrs[0].outs[0]
    exe.instrs[0].outs = (o[:2] + ((1, 4),) + o[3:],)  # column-major, unlike mul's result
    exe.generated = program.generate(exe.instrs, exe.n_views, exe.program.outputs,
                                     program.run_instr)
    exe.checked_runs = 0
    for _ in range(3):
        st = [None] * exe.program.n_slots
        st[0] = x._handle.buffer.storage
        exe.run(st, [[2], [1], [3]], None, set())
    assert exe.generated.checked and 0 in exe.generated.fixed  # (and its reader)


def test_runtime_scalars_do_not_recompile():
    x = rand(16)
    lazy(lambda: x * 0.5 + 1)
    _, _, m = lazy(lambda: x * 0.25 + 3)
    assert m.compiles == 0 and m.plan_hits == 1


def test_bad_fused_executable_runs_ops_one_by_one(recwarn):
    from fusion.program import CompileError
    runner = ae.engine.engine.ENGINE.runner

    def fail_fused(program):
        if len(program.instrs) > 1:
            raise CompileError("injected compiler failure")

    x = rand(32)
    runner.compile_hook = fail_fused
    try:
        out, ex, m = lazy(lambda: (x * 3 - 1).abs().neg())
        assert m.launches == 4  # the group's 4 ops, one by one
        assert any("failed to compile" in str(w.message) for w in recwarn.list)
        torch.testing.assert_close(out.cpu(), -((x.cpu() * 3 - 1).abs()))
        _, _, m2 = lazy(lambda: (x * 3 - 1).abs().neg())
        assert m2.launches == 4  # marked bad for the process
        assert m.bad_executables == {"CompileError: injected compiler failure": 1}
        assert "injected compiler failure" in str(ae.explain())
    finally:
        runner.compile_hook = None


def test_internal_compiler_bug_is_not_taken_for_a_failed_fusion():
    """Only a CompileError sends a group op by op; any other error is a bug and propagates."""
    x = rand(8)
    # (a runner of its own with no disk cache: an earlier test's executable of the same
    # program, written to the session's disk cache, would skip the compile)
    with ae.override(disable_disk_cache=True):
        runner = ae.engine.engine.ENGINE.runner
        runner.compile_hook = lambda program: 1 / 0
        try:
            with pytest.raises(ZeroDivisionError):
                lazy(lambda: (x * 5 - 2).abs())
        finally:
            runner.compile_hook = None
        assert ae.metrics().bad_executables == {}
        assert lazy(lambda: (x * 5 - 2).abs())[0].shape == (8,)  # and the engine still works


def test_counters_never_go_negative_across_settings_changes():
    x = rand(16)

    def run():
        with ae.adaptive():
            (x * 2 + 1).relu().sin().cpu()

    ae.reset_metrics()
    with ae.override(disable_disk_cache=True):  # (it compiles: no earlier test's executable)
        run()
    before = ae.metrics()
    assert before.compiles > 0 and before.cache_misses == before.compiles
    with ae.override(max_group_ops=3, cache_max_entries=7):  # a new runner, strategy, cache
        run()
    from device import DeviceSpec
    core, held = ae.core_metrics(0), torch.neuron.memory_allocated()
    ae.set_device_spec(DeviceSpec(launch_overhead_us=25.0))  # new figures
    try:
        after = ae.metrics()
        for f in ("compiles", "cache_misses", "compile_time_us", "launches", "device_time_us",
                  "ops"):
            assert getattr(after, f) >= getattr(before, f) >= 0, f
        # the core's share and the memory its live tensors hold carry over too
        assert ae.core_metrics(0) == core and torch.neuron.memory_allocated() == held > 0
    finally:
        ae.set_device_spec(DeviceSpec())


def test_a_reset_while_ops_are_queued_counts_their_launches_before_it():
    # Resetting at the start of a measured region must not leave the queued ops before it to
    # be launched and counted after it, without being counted as ops (a group of 4 ops
    # counted after a reset that saw 1 op).
    x = rand(16)
    with ae.adaptive():
        y = (x * 2 + 1).relu()  # queued
        ae.reset_metrics()
        m = ae.metrics()
        assert m.ops == 0 and m.launches == 0 and sum(m.flushes.values()) == 0
        z = y.sin().cpu()
    after = ae.metrics()
    assert after.launches == 1 and after.mean_group_size == 1  # sin alone
    assert torch.equal(z, (x.cpu() * 2 + 1).relu().sin())


def test_explain_and_dot():
    x = rand(4, 4)
    _, ex, _ = lazy(lambda: (x @ x).relu() @ x, max_group_contractions=1)
    text = str(ex)
    assert "3 ops -> 2 launches" in text and "contraction limit (1)" in text
    dot = ex.to_dot()
    assert dot.startswith("digraph") and "cluster_0" in dot and "cluster_1" in dot
    assert '[label="RAW"' in dot


def test_dependency_graph_edges_raw_war_waw():
    x = rand(4)
    x0 = x.cpu()
    with ae.override(queue_low_threshold=0), ae.adaptive():
        y = x * 2        # 0: reads x
        x.add_(1)        # 1: writes x after 0 read it (WAR), reads x
        z = x + y        # 2: RAW on x (1) and y (0)
        x.zero_()        # 3: WAW with 1, WAR with 2
        torch.neuron.synchronize()
    g = ae.explain().to_networkx()
    kinds = {(u, v): d["kind"] for u, v, d in g.edges(data=True)}
    assert kinds[(0, 1)] == "WAR" and kinds[(0, 2)] == "RAW"
    assert kinds[(1, 2)] == "RAW" and kinds[(1, 3)] == "WAW" and kinds[(2, 3)] == "WAR"
    assert torch.equal(z.cpu(), (x0 + 1) + x0 * 2)  # z read x after the add_, before zero_
    assert torch.equal(x.cpu(), torch.zeros(4))


def test_adaptive_policy_changes_launch_counts_not_results():
    from device import DeviceSpec
    x, w = rand(16, 16), rand(16, 16)

    def work():
        y = x
        for _ in range(6):
            y = (y @ w).tanh() * 0.5
        return y

    eager = work()
    lazy_out, _, lm = lazy(work)  # threshold 0: flush only at the sync
    with ae.adaptive():  # threshold 15, a fast host: flushes at natural cuts as it goes
        ae.reset_metrics()
        busy = work()
        torch.neuron.synchronize()
    m = ae.metrics()
    assert m.flushes.get("device idle", 0) >= 1 and lm.flushes == {"synchronize": 1}
    assert m.launches == lm.launches  # natural cuts: the same groups
    ae.set_device_spec(DeviceSpec(launch_overhead_us=10_000.0))  # a device always behind
    try:
        with ae.adaptive(), ae.override(max_group_contractions=1):
            ae.reset_metrics()
            behind = work()
            torch.neuron.synchronize()
            assert ae.metrics().flushes.get("device idle", 0) < 6  # it kept buffering
    finally:
        ae.set_device_spec(DeviceSpec())
    for r in (lazy_out, busy, behind):
        assert torch.equal(r.cpu(), eager.cpu())


def test_explain_save_writes_dot_without_graphviz(tmp_path):
    x = rand(4, 4)
    _, ex, _ = lazy(lambda: (x * 2).relu())
    path = ex.save(str(tmp_path / "g.svg"))
    assert open(path).read().startswith("digraph")


def test_plan_cache_keys_on_strategy_settings():
    x, w = rand(8, 8), rand(8, 8)
    _, _, m4 = lazy(lambda: x @ w @ w)
    _, _, m1 = lazy(lambda: x @ w @ w, max_group_contractions=1)
    assert (m4.launches, m1.launches) == (1, 2)


def test_an_adamw_foreach_step_beyond_sbuf_is_one_launch_bit_for_bit():
    """Note [Elementwise groups stream]: AdamW's 8 foreach ops over parameters larger than
    SBUF were 8 launches ("SBUF capacity" before each); they are one group now, with CPU's
    values bit for bit over several steps (the bias corrections change every step)."""
    from device import DeviceSpec

    def train(device, steps=3):
        torch.manual_seed(0)
        m = torch.nn.Linear(32, 32).to(device)  # 4 KiB of weights: 2x the SBUF below
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True)
        x = torch.randn(4, 32).to(device)
        for _ in range(steps):
            m(x).square().mean().backward()
            if device == "neuron":
                torch.neuron.synchronize()  # the optimizer step alone in the next flush
            opt.step()
            opt.zero_grad()
            if device == "neuron":
                torch.neuron.synchronize()
        return [p.detach().cpu() for p in m.parameters()]
    cpu = train("cpu")
    ae.set_device_spec(DeviceSpec(sbuf_bytes=2048))
    try:
        with ae.override(queue_low_threshold=0), ae.adaptive():
            ae.reset_metrics()
            neuron = train("neuron")
            ex = ae.explain()
    finally:
        ae.set_device_spec(DeviceSpec())
    assert [g["name"].count("_foreach_") for g in ex.groups] == [8], ex.groups
    for a, b in zip(neuron, cpu):
        assert torch.equal(a, b)
