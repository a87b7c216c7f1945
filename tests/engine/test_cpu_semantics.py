"""CPU's semantics on neuron, op by op, one test per difference found (by users' programs,
probers and the fuzzer; each failed before its fix): global state in the meta cache, conj
views, bounds, error wording, device-thread errors, deferred-error isolation, out= resizing,
CPU's layouts and dtypes, printing."""
import contextlib
import os
import subprocess
import sys
import textwrap
import traceback
import warnings

import pytest
import torch
import torch.nn.functional as F

import adaptive_eager as ae
from tests.harness.fallback import fallback

N = "neuron"


def _run(code: str) -> subprocess.CompletedProcess:
    """A snippet in a fresh interpreter: an abort kills the child, not the test run."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ))


def test_meta_cache_reads_the_default_dtype(mode):
    x = torch.arange(3, device=N)
    try:
        torch.set_default_dtype(torch.float64)
        assert (x / 2).dtype == (torch.arange(3) / 2).dtype == torch.float64
    finally:
        torch.set_default_dtype(torch.float32)
    assert (x / 2).dtype == torch.float32


def test_conjugate_and_negative_views_give_cpu_values(mode):
    z = torch.randn(4, dtype=torch.complex64)
    torch.testing.assert_close(z.to(N).conj().cpu(), z.conj().resolve_conj())
    torch.testing.assert_close(torch._neg_view(z.to(N)).cpu(), -z)
    torch.testing.assert_close(torch.fft.ifft(z.to(N)).cpu(), torch.fft.ifft(z))
    m = torch.randn(2, 3, dtype=torch.complex64)
    torch.testing.assert_close(m.to(N).mH.cpu(), m.mH.resolve_conj())


def test_views_past_the_buffer_raise_cpu_error(mode):
    with pytest.raises(RuntimeError) as cpu:
        torch.as_strided(torch.arange(10.), (2, 2), (1, 2), 10)
    with pytest.raises(RuntimeError) as dev:
        torch.as_strided(torch.arange(10., device=N), (2, 2), (1, 2), 10)
    assert str(dev.value) == str(cpu.value)
    # the same layout over a larger buffer is fine (the bound is checked per call)
    assert torch.as_strided(torch.arange(20., device=N), (2, 2), (1, 2), 10).tolist() == \
        [[10., 12.], [11., 13.]]


def test_user_errors_are_cpu_worded_unchained_and_short():
    with pytest.raises(RuntimeError) as cpu:
        torch.ones(2, 3) + torch.ones(4, 5)
    with pytest.raises(RuntimeError) as dev:
        torch.ones(2, 3, device=N) + torch.ones(4, 5, device=N)
    e = dev.value
    assert str(e) == str(cpu.value)
    assert e.__cause__ is None and e.__suppress_context__
    frames = traceback.extract_tb(e.__traceback__)
    assert frames[0].filename == __file__ and len(frames) <= 3, frames


def test_meta_refusing_what_cpu_accepts_does_not_abort():
    out = _run("""
        import torch, adaptive_eager, torch.nn.functional as F
        x = torch.randn(1, 5, 0).to("neuron").requires_grad_()
        F.mse_loss(x, torch.zeros(1, 5, 0, device="neuron")).backward()
        print("grad", tuple(x.grad.shape))
    """)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "grad (1, 5, 0)" in out.stdout


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_an_output_meta_shapes_unlike_cpu_takes_cpus_shape(mode, reduction):
    """Note [CPU layouts]: the unreduced multi_margin_loss of one sample is 0-d on CPU and
    (1,) in its meta kernel; the CPU probe's shape was ignored where it differed from meta's,
    so the device silently returned (1,) (found by a scan of compile mode against eager)."""
    x, t = torch.randn(4, generator=torch.Generator().manual_seed(0)), torch.tensor(2)
    want = F.multi_margin_loss(x, t, reduction=reduction)
    got = F.multi_margin_loss(x.to(N), t.to(N), reduction=reduction)
    assert got.shape == want.shape and torch.equal(got.cpu(), want)


def test_functional_batch_norm_in_eval_saves_cpus_empty_statistics(mode):
    """`_native_batch_norm_legit_functional` (what torch.compile's graphs call) in eval
    returns empty saved statistics on CPU, as the other batch norms (`_cpu_shaped`): the
    device made them (C,) and failed copying CPU's into them (an internal error)."""
    args = [torch.randn(2, 3), torch.ones(3), torch.zeros(3), torch.zeros(3), torch.ones(3)]
    want = torch.ops.aten._native_batch_norm_legit_functional(*args, False, 0.1, 1e-5)
    got = torch.ops.aten._native_batch_norm_legit_functional(*(a.to(N) for a in args), False,
                                                             0.1, 1e-5)
    assert [tuple(g.shape) for g in got] == [tuple(w.shape) for w in want]
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want))


def test_error_on_autograds_device_thread_reaches_the_caller():
    """A pending deferred error surfaces at a sync inside backward (a CPU-fallback op): it
    must come back from backward() as a Python exception, never abort the process."""
    out = _run("""
        import torch, adaptive_eager as ae, torch.nn.functional as F
        x = torch.arange(5., device="neuron")
        y = x.index_select(0, torch.tensor([7], device="neuron"))  # deferred: out of range
        w = torch.randn(3, device="neuron", requires_grad=True)
        loss = (w * 2).sum()
        torch.ops.aten.index_select(x, 0, torch.tensor([9], device="neuron"))  # pending again
        try:
            F.logsigmoid(w).sum().backward()
            e = torch.eye(2, device="neuron")
            (loss + torch.ops.aten._test_functorch_fallback(e, e).sum()).backward()  # fallback
        except ae.NeuronRuntimeError as e:
            print("raised", "index_select" in str(e))
        print("alive", (torch.ones(2, device="neuron") + 1).tolist())
    """)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "raised True" in out.stdout and "alive [2.0, 2.0]" in out.stdout


def test_python_error_in_backward_op_is_raised_not_aborted():
    out = _run("""
        import torch, adaptive_eager
        from adaptive_eager.engine import engine as _engine
        real = _engine.Engine.dispatch_plain
        def broken(self, func, args, kwargs, *route, **kw):
            if func is torch.ops.aten.mse_loss_backward.default:
                raise ValueError("boom in backward")
            return real(self, func, args, kwargs, *route, **kw)
        _engine.Engine.dispatch_plain = broken
        x = torch.randn(3, device="neuron", requires_grad=True)
        l = torch.nn.functional.mse_loss(x, torch.zeros(3, device="neuron"))
        try:
            l.backward()
        except ValueError as e:
            print("caught", e)
        _engine.Engine.dispatch_plain = real
        print("alive", (x + 1).shape)
    """)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "caught boom in backward" in out.stdout and "alive" in out.stdout


def test_deferred_error_poisons_only_its_dependents(mode):
    x = torch.arange(5., device=N)
    y = x.index_select(0, torch.tensor([7], device=N))  # out of range: a deferred error
    y2 = y * 2  # depends on the failed op
    z = torch.arange(4., device=N) * 2 + 1  # independent
    with pytest.raises(ae.NeuronRuntimeError, match="index_select"):
        ae.synchronize()
    assert z.tolist() == [1., 3., 5., 7.]  # never silently wrong
    for bad in (y, y2):  # clearly invalid: reading raises the original error again
        with pytest.raises(ae.NeuronRuntimeError, match="index_select"):
            bad.cpu()
    assert (x + 1).tolist() == [1., 2., 3., 4., 5.]  # the engine keeps working


def test_a_layout_only_op_of_a_result_failed_in_its_launch_makes_its_value(mode):
    """Note [Poison]: `ones_like` of a result whose op failed in the same launch is not
    skipped (it reads only the layout); it read the slot the failed op never filled and
    raised a TypeError, its result poisoned by that internal error where eager gives ones
    (fuzzer seed 20800261)."""
    x = torch.arange(5., device=N)
    y = x.index_select(0, torch.tensor([7], device=N)) * 3  # out of range: deferred
    o = torch.ones_like(y)
    z = o + x[1:2]
    with pytest.raises(ae.NeuronRuntimeError, match="index_select"):
        ae.synchronize()
    assert o.tolist() == [1.0] and z.tolist() == [2.0]
    with pytest.raises(ae.NeuronRuntimeError, match="index_select"):
        y.cpu()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_ops_that_read_data_now_raise_a_poisoned_inputs_error(mode):
    """Data-dependent and CPU-fallback ops read a poisoned buffer's (never written) memory
    and returned garbage once its error had been seen; pinning a device tensor made a copy."""
    w = torch.arange(1., 13.).reshape(4, 3).to(N)
    p = torch.nn.functional.embedding(torch.tensor([0, 9]).to(N), w)  # out of range
    with pytest.raises(ae.NeuronRuntimeError, match="embedding"):
        ae.synchronize()
    for read in (lambda: p[p > 0], lambda: p.nonzero(), lambda: p.unique(),
                 lambda: torch.equal(p, p), lambda: torch.allclose(p, w[:2]),
                 lambda: fallback(torch.cat([p, p[:1]]))):
        with pytest.raises(ae.NeuronRuntimeError, match="embedding"):
            read()
    # ops that read only its layout make good values (they raised its error)
    assert torch.zeros_like(p).tolist() == [[0.0] * 3] * 2
    assert torch.full_like(p, 3).tolist() == [[3.0] * 3] * 2 and p.new_ones(2).tolist() == [1, 1]
    with pytest.raises(ae.NeuronRuntimeError, match="embedding"):
        (p + 1).cpu()
    with pytest.raises(RuntimeError, match="only dense CPU tensors can be pinned"):
        w.pin_memory()
    assert not w.is_pinned() and (w[0] * 2).tolist() == [2., 4., 6.]


def test_arange_into_an_out_takes_each_calls_length(mode):
    """arange(n, out=t)'s n is part of its signature (it was a runtime scalar: the first
    call's length stuck, showing never-written memory or dropping elements), as in the
    windows built on it."""
    for n in (8, 5, 9):
        o = torch.arange(n, out=torch.empty(0, device=N))
        assert o.cpu().tolist() == list(range(n))
        assert torch.arange(0., n / 2, 0.5, out=torch.empty(0, device=N)).shape == (n,)
    torch.hann_window(7, device=N)
    assert torch.equal(torch.hann_window(7, periodic=False, device=N).cpu(),
                       torch.hann_window(7, periodic=False))


def test_a_negative_zero_or_nan_argument_is_its_own_signature(mode):
    """A float argument's -0.0 keyed as 0.0 (nan_to_num(nan=-0.0) reused nan=0.0's
    executable, normal_(mean=-0.0)), and NaN keyed as nothing (a miss at every call)."""
    x = torch.tensor([float("nan"), float("inf"), -float("inf")])
    for z in (-0.0, 0.0, -0.0):
        got = torch.nan_to_num(x.to(N), nan=z, posinf=z, neginf=z).cpu()
        assert got.signbit().tolist() == [z < 0 or str(z) == "-0.0"] * 3
    torch.manual_seed(0)
    want = [torch.empty(6).normal_(mean=m, std=0.0) for m in (0.0, -0.0)]
    torch.manual_seed(0)
    got = [torch.empty(6, device=N).normal_(mean=m, std=0.0).cpu() for m in (0.0, -0.0)]
    assert [g.signbit().tolist() for g in got] == [w.signbit().tolist() for w in want]
    y = torch.tensor([1.0, float("nan")], device=N)
    before = len(ae.engine.engine.ENGINE.meta_cache)
    for _ in range(3):
        torch.nan_to_num(y, nan=float("nan"))
    assert len(ae.engine.engine.ENGINE.meta_cache) <= before + 1


def test_deterministic_mode_fills_new_memory_as_cpu():
    """With torch.use_deterministic_algorithms(True), CPU fills new memory (NaN, or the
    largest integer); neuron's empty, empty_strided and a growing resize_ showed whatever
    bytes were there."""
    def made(dev):
        return [torch.empty(3, device=dev), torch.empty(3, dtype=torch.int32, device=dev),
                torch.ones(2, device=dev).resize_(4), torch.empty(2, dtype=torch.bool, device=dev),
                torch.empty_strided((2, 2), (1, 2), device=dev),
                torch.ones(2, device=dev).new_empty(3)]
    torch.use_deterministic_algorithms(True)
    try:
        for g, w in zip(made(N), made("cpu")):
            assert torch.equal(g.cpu().nan_to_num(7.0), w.nan_to_num(7.0)), (g, w)
    finally:
        torch.use_deterministic_algorithms(False)


def test_kaiser_window_on_the_device():
    """Its kernel is a CPU-only stub: an internal assert ("DispatchStub: missing kernel")."""
    for args in [(7,), (7, False), (8, True, 5.0)]:
        assert torch.equal(torch.kaiser_window(*args, device=N).cpu(), torch.kaiser_window(*args))


def test_two_failed_ops_in_one_group_each_name_their_own(mode):
    """Every value poisoned in a fused group named the group's first failed op: the second
    failure's value (and its dependents) reported the first's error and line."""
    w = torch.arange(12.0).reshape(4, 3).to(N)
    g1 = torch.gather(w, 1, torch.tensor([[5]] * 4).to(N))
    g2 = torch.nn.functional.embedding(torch.tensor([10]).to(N), w)
    g3 = g2 * 2 + g1.sum()
    g4 = g2 * 3
    with pytest.raises(ae.NeuronRuntimeError, match="gather"):
        ae.synchronize()
    with pytest.raises(ae.NeuronRuntimeError, match="gather"):
        g1.cpu()
    for t in (g2, g4):
        with pytest.raises(ae.NeuronRuntimeError, match="embedding"):
            t.cpu()
    with pytest.raises(ae.NeuronRuntimeError):
        g3.cpu()
    assert (w[0] + 1).tolist() == [1.0, 2.0, 3.0]


def test_a_python_kernels_own_error_is_a_device_error_not_an_internal_one(mode):
    """A kernel that is a Python function (fusion/ops.py's `_histc`, `_div_mode`) raising in a
    generated run was reported as a bug of ours ("internal error ... please report it") with
    no source line: on 3.11 its traceback stops at the CALL's last cache entry, not the CALL
    (found by PyTorch's test_reductions.py::test_histc)."""
    torch.histc(torch.tensor([0.5], device=N)).cpu()  # the signature's first call: at the call
    h = torch.histc(torch.tensor([float("inf")], device=N))  # found at run time
    with pytest.raises(ae.NeuronRuntimeError, match=r"operation=aten::histc.*not finite"):
        h.cpu()
    assert (torch.ones(2, device=N) + 1).tolist() == [2.0, 2.0]


def test_launch_blocking_raises_at_the_op_in_adaptive_mode():
    with ae.adaptive(), ae.override(launch_blocking=True):
        x = torch.arange(5., device=N)
        with pytest.raises(ae.NeuronRuntimeError, match="index_select"):
            x.index_select(0, torch.tensor([7], device=N))
        assert (x * 2).tolist() == [0., 2., 4., 6., 8.]


def test_out_of_the_wrong_shape_is_resized_with_cpus_warning(mode):
    out = torch.zeros(2, 2, device=N)
    with pytest.warns(UserWarning, match="resized"):
        r = torch.add(torch.ones(1, 4, device=N), 1, out=out)
    assert r is out and out.shape == (1, 4) and out.tolist() == [[2., 2., 2., 2.]]
    small = torch.zeros(2, 3, device=N)
    torch.mul(torch.ones(5, device=N), 3, out=small)
    assert small.shape == (5,) and small.tolist() == [3.] * 5


def test_out_and_resize_grow_past_their_buffer_as_on_cpu(mode):
    out = torch.empty(0, device=N)
    r = torch.add(torch.ones(1, 4, device=N), 1, out=out)
    assert r is out and out.shape == (1, 4) and out.tolist() == [[2., 2., 2., 2.]]
    x = torch.arange(3., device=N)
    view = x[:2]
    x.resize_(2, 3)  # grows: the old values stay in front, as on CPU
    assert x.shape == (2, 3) and x.flatten()[:3].tolist() == [0., 1., 2.]
    x[1] = 7
    x[0, 0] = 5
    assert x.tolist()[1] == [7., 7., 7.]
    assert view.tolist() == [5., 1.]  # views share the grown storage, as on CPU
    t = torch.randn(5, 2).t()  # out= resized from an input's layout takes CPU's strides
    assert torch.clamp(t.to(N), 0, 1, out=torch.empty(1, 1, device=N)).stride() == \
        torch.clamp(t, 0, 1, out=torch.empty(1, 1)).stride()
    with pytest.raises(RuntimeError, match="out of bounds for storage"):
        torch.arange(4., device=N).as_strided_((3, 3), (3, 1))
    y = torch.arange(2., device=N)  # resize_as_ grows too (it raised "out of bounds")
    y.resize_as_(torch.ones(2, 3, 2, device=N).transpose(1, 2))
    assert y.shape == (2, 2, 3) and y.stride() == (6, 3, 1) and y.flatten()[:2].tolist() == [0., 1.]


@pytest.mark.parametrize("name,f", [
    ("nonzero", lambda x: torch.nonzero(x > 0)),
    ("argwhere", lambda x: torch.argwhere(x > 0)),
    ("where", lambda x: torch.where(x > 0)[0]),
    ("floordiv_t", lambda x: x.t() // 2),
    ("copysign_t", lambda x: torch.copysign(x.t(), x.new_ones(4))),
    ("xlogy_t", lambda x: torch.xlogy(x.t().abs(), 2.0)),
    ("mT_index", lambda x: x.mT[torch.tensor([0, 2])]),
    ("logical_mixed", lambda x: torch.logical_and(x.t(), x.new_ones(4, 3).t())),
    ("logical_mixed2", lambda x: torch.logical_xor(x, x.new_ones(3, 4).t())),
])
def test_outputs_have_cpus_strides(name, f, mode):
    x = torch.randn(4, 3)
    cpu, dev = f(x), f(x.to(N))
    assert dev.stride() == cpu.stride() and dev.dtype == cpu.dtype
    torch.testing.assert_close(dev.cpu(), cpu)


@pytest.mark.parametrize("rows", [3, 2200], ids=["probed", "too_big_to_probe"])
@pytest.mark.parametrize("keepdim", [False, True])
def test_an_empty_dim_list_reduces_as_on_cpu(rows, keepdim, mode):
    # nansum's meta kernel reduces no dim for `dim=[]`, CPU's every dim (as sum's): the
    # device returned x's shape, each element the total
    x = torch.randn(rows, 2048)
    x[0, 0] = float("nan")
    for f in (torch.nansum, torch.nanmean):
        cpu, dev = f(x, dim=[], keepdim=keepdim), f(x.to(N), dim=[], keepdim=keepdim)
        assert dev.shape == cpu.shape
        assert torch.equal(dev.cpu(), cpu)


def test_a_result_shaped_unlike_its_plan_raises_never_broadcasts(monkeypatch, mode):
    # Note [Misshaped results]: a meta kernel shaping unlike CPU's over inputs too big to
    # probe (here: nansum's, its correction taken away) planned a (2201, 2048) result for
    # CPU's 0-d total; copied into the planned buffer, it filled all of it
    from adaptive_eager.engine import meta
    monkeypatch.setattr(meta, "_cpu_shaped", lambda func, m_args, m_kwargs, out: out)
    x = torch.ones(2201, 2048)  # (a shape of its own: no other test meets this signature)
    y = torch.nansum(x.to(N), dim=[])
    with pytest.raises(RuntimeError, match="nansum returned a result of shape"):
        y.cpu()


def test_a_host_run_view_of_another_dtype_is_not_its_input(mode):
    # prims.real (CPU fallback) of a 0-d complex tensor: its float view has the input's
    # size, stride and offset; the device handed back the complex input itself
    z = torch.tensor(1.5 - 2.5j)
    for f in (torch.ops.prims.real.default, torch._refs.real, torch.ops.prims.imag.default):
        cpu, dev = f(z), f(z.to(N))
        assert dev.dtype == cpu.dtype == torch.float32
        assert torch.equal(dev.cpu(), cpu)


def test_nonzero_flatten_is_a_copy_as_on_cpu(mode):
    x = torch.tensor([[0., 1.], [1., 1.]])
    c, d = torch.nonzero(x), torch.nonzero(x.to(N))
    c.flatten()[:] = 9
    d.flatten()[:] = 9
    assert d.tolist() == c.tolist()
    with pytest.raises(RuntimeError):
        torch.nonzero(x).view(-1)
    with pytest.raises(RuntimeError):
        torch.nonzero(x.to(N)).view(-1)


@pytest.mark.parametrize("name,f", [
    ("bool_pow", lambda d: torch.tensor([True, False], device=d) ** False),
    ("bool_pow_", lambda d: torch.tensor([True, False], device=d).pow_(False)),
    ("mm_f64", lambda d: torch.mm(torch.ones(2, 2, device=d),
                                  torch.ones(2, 2, device=d, dtype=torch.float64))),
    ("linear_f64", lambda d: F.linear(torch.ones(2, 2, device=d),
                                      torch.ones(2, 2, device=d, dtype=torch.float64))),
    ("float_and", lambda d: torch.ones(2, device=d) & torch.ones(2, device=d)),
    ("log_softmax_empty_bool", lambda d: torch.log_softmax(
        torch.zeros(0, dtype=torch.bool, device=d), 0)),
    ("bmm_empty_mixed", lambda d: torch.bmm(torch.ones(0, 2, 2, device=d),
                                            torch.ones(0, 2, 2, device=d, dtype=torch.float64))),
    ("leaky_relu_int", lambda d: F.leaky_relu(torch.arange(3, device=d))),
    ("uniform_int", lambda d: torch.arange(3, device=d).uniform_()),
    ("cross_entropy_1d", lambda d: F.cross_entropy(torch.tensor([0.5, -1.0], device=d),
                                                   torch.tensor([1], device=d))),
    ("masked_fill_nan_int", lambda d: torch.tensor([3, 1], device=d).masked_fill(
        torch.tensor([True, False], device=d), float("nan"))),
    ("cat_0d", lambda d: torch.cat([torch.tensor(True, device=d)] * 2, -1)),
    # torch.tensor of a list of 0-d tensors reads each one (with the Python key excluded)
    ("tensor_of_0d_complex", lambda d: torch.tensor([torch.tensor(1 + 2j, device=d)] * 2)),
    ("tensor_of_0d_complex128", lambda d: torch.tensor(
        [torch.tensor(3 - 1j, dtype=torch.complex128, device=d), 2j])),
])
def test_dtypes_and_exceptions_match_cpu(name, f, mode):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            cpu = f("cpu")
        except Exception as e:
            with pytest.raises(type(e)):
                f(N)
            return
        dev = f(N)
    assert dev.dtype == cpu.dtype and dev.shape == cpu.shape
    assert torch.equal(dev.cpu(), cpu)


def test_printing_matches_cpu():
    assert f"{torch.tensor(-3, device=N)}" == f"{torch.tensor(-3)}" == "-3"
    assert f"{torch.tensor(2.5, device=N):.2f}" == "2.50"
    for dt in (torch.int64, torch.bool, torch.float16):
        assert repr(torch.tensor([], dtype=dt, device=N)) == \
            repr(torch.tensor([], dtype=dt)).replace("tensor([]", "tensor([], device='neuron:0'")


def test_in_place_on_an_expanded_float64_tensor(mode):
    """float64 runs as float32 and is written back: into a broadcast (stride-0) tensor too."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        v0 = torch.randn(1).double()
        d0 = v0.to(N)
        v0.expand(2, 1).zero_()
        d0.expand(2, 1).zero_()
        assert d0.cpu().tolist() == v0.tolist() == [0.0]
        # a write to one broadcast element is a write to all that share its memory
        x = torch.tensor([[1.5]], dtype=torch.float64)
        dx = x.to(N)
        x.view(-1).expand(2, 1)[torch.tensor([-1])] = -2.0
        dx.view(-1).expand(2, 1)[torch.tensor([-1], device=N)] = -2.0
        assert dx.cpu().tolist() == x.tolist() == [[-2.0]]


def test_float64_arguments_over_one_memory_see_each_others_writes(mode):
    """fuzzer (optim family): the float32 twins of float64 arguments that share memory share
    it too, so a foreach op given one tensor twice updates it twice, as on CPU."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        x = torch.tensor([1.5, -2.0, 4.0], dtype=torch.float64)
        dx = x.to(N)
        torch._foreach_add_([x, x], [x, x], alpha=0.5)
        torch._foreach_add_([dx, dx], [dx, dx], alpha=0.5)
        torch._foreach_mul_([x, x[:1]], 2.0)  # x[0] is doubled twice
        torch._foreach_mul_([dx, dx[:1]], 2.0)
        assert dx.cpu().tolist() == x.tolist() == [13.5, -9.0, 18.0]


def test_a_float64_scalar_past_float32s_range_is_its_float32_infinity(mode):
    """PyTorch's test_reductions.py::test_reduce_dtype: logcumsumexp's float64 backward fills
    with float64's `lowest()`, which CPU's float32 kernels refuse ("value cannot be converted
    to type float without overflow"): the float32 twin holds what a cast gives, -inf."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        x, gi = torch.randn(3, 3), torch.randn(3, 3)
        grads = []
        for dev in ("cpu", N):
            xd = x.to(dev).requires_grad_()
            g, = torch.autograd.grad([torch.logcumsumexp(xd.double(), 0)], [xd],
                                     gi.double().to(dev))
            grads.append(g.cpu())
        torch.testing.assert_close(grads[1], grads[0])
        lowest = torch.finfo(torch.float64).min
        d = torch.zeros(2, dtype=torch.float64, device=N).fill_(lowest)
        assert d.cpu().tolist() == [float("-inf")] * 2
        assert (torch.ones(1, dtype=torch.float64, device=N) * 1e300).item() == float("inf")


def test_float64_random_draws_from_float64s_range(mode):
    """PyTorch's test_tensor_creation_ops.py::test_random_default / test_random_full_range
    (float64): random_'s default range is its dtype's, integers up to 2**53 for float64 (2**24
    for float32), so the float32 twin drew below 2**24, silently; and a range past 2**24 drew
    float32's warning ("to - 1 is out of bounds"), which CPU gives only past 2**53."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", "float64 is not supported")
        for dev in ("cpu", N):
            for call, lo, hi in ((lambda t: t.random_(), 0, 2**53),
                                 (lambda t: t.random_(-2**53, None), -2**53, 2**53),
                                 (lambda t: t.random_(2**40), 0, 2**40),
                                 (lambda t: t.random_(-2**40, 2**40), -2**40, 2**40)):
                t = call(torch.empty(4000, dtype=torch.float64, device=dev)).cpu()
                assert lo <= t.min().item() < lo + (hi - lo) / 10, (dev, lo, hi, t.min())
                assert hi - (hi - lo) / 10 < t.max().item() <= hi, (dev, lo, hi, t.max())
                if dev == N:  # Note [float64 policy]: values carry float32 precision
                    assert torch.equal(t, t.float().double())


def test_sparse_and_dense_dim_are_cpus_without_a_fallback(mode):
    """PyTorch's test_shape_ops.py::test_sparse_dense_dim: metadata of a strided tensor, not
    a CPU fallback (nor its warning)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for shape in [(), (2,), (2, 3)]:
            c = torch.rand(shape)
            d = c.to(N)
            assert (d.sparse_dim(), d.dense_dim()) == (c.sparse_dim(), c.dense_dim())
    assert not ae.metrics().cpu_fallbacks


def test_one_hot_is_laid_out_as_on_cpu_and_refuses_a_bad_class(mode):
    """fuzzer (nn family): PyTorch's one_hot for Python-key tensors is `eq` against an
    arange, laid out like a transposed input and all zeros for a class out of range."""
    x = torch.tensor([[0, 2], [1, 5]]).mT
    d = x.to(N)
    for k in (6, -1):
        out = F.one_hot(d, k)
        assert out.stride() == F.one_hot(x, k).stride()
        assert torch.equal(out.cpu(), F.one_hot(x, k))
    with pytest.raises(ae.NeuronRuntimeError, match="out of bounds"):
        F.one_hot(d, 3).cpu()
    assert F.one_hot(torch.zeros(0, 2, dtype=torch.long, device=N), 3).shape == (0, 2, 3)


def test_in_place_foreach_ops_bump_versions_as_cuda_kernels_do(mode):
    """fuzzer (optim family): `_foreach_add_` has no ADInplaceOrView kernel, so autograd saw
    no write: a view of the written tensor kept no grad_fn (its backward dropped the gradient)
    and an overwritten saved tensor (optimizer.step() before backward()) raised nothing."""
    b = torch.zeros(1, 1, device=N)
    view = b.expand(2, 1, 1)
    w = torch.ones(1, 1, device=N, requires_grad=True)
    torch._foreach_add_([b], [w])
    view.sum().backward()
    assert w.grad.cpu().tolist() == [[2.0]]
    p = torch.ones(3, device=N, requires_grad=True)
    loss = (p * p).sum()
    with torch.no_grad():
        torch._foreach_mul_([p], 0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with torch.inference_mode():
        t = torch.ones(2, device=N)
        torch._foreach_add_([t], 1.0)  # inside inference mode: allowed
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside"):
        torch._foreach_add_([t], 1.0)
    assert t.cpu().tolist() == [2.0, 2.0]


def test_foreach_scalars_packed_in_a_host_tensor_are_taken_as_on_cuda(mode):
    # test_foreach.py (tensor-of-scalarlist overload): `_foreach_addcmul(x, a, b, scalars)`
    # with a 1-D CPU `scalars` (where CUDA requires it) raised the two-devices error
    xs, a, b = ([torch.randn(3, 3), torch.randn(2)] for _ in range(3))
    scalars = torch.tensor([2.0, -3.0])
    dev = [[t.to(N) for t in ts] for ts in (xs, a, b)]
    for f in (torch._foreach_addcmul, torch._foreach_addcdiv):
        for c, d in zip(f(xs, a, b, scalars), f(*dev, scalars)):
            assert torch.equal(d.cpu(), c)
    for f in (torch._foreach_addcmul_, torch._foreach_addcdiv_):
        f(xs, a, b, scalars)
        f(*dev, scalars)
        for c, d in zip(xs, dev[0]):
            assert torch.equal(d.cpu(), c)
    with pytest.raises(RuntimeError, match="two devices"):  # a list's tensor still may not
        torch._foreach_addcmul(dev[0], [a[0], dev[1][1]], dev[2], scalars)


@pytest.mark.parametrize("fn", [F.silu, F.mish], ids=["silu", "mish"])
def test_low_precision_backward_uses_cpus_kernel_not_a_decomposition(mode, fn):
    """PyTorch decomposes silu_backward for backends without a kernel: in bfloat16 every
    intermediate rounds, where CPU's and CUDA's kernels round once (LLaMA's MLP)."""
    x = torch.randn(64, generator=torch.Generator().manual_seed(0)).bfloat16()
    grads = []
    for dev in ("cpu", N):
        xi = x.to(dev).detach().requires_grad_()
        fn(xi).backward(torch.full_like(xi, 0.37))
        grads.append(xi.grad.cpu())
    assert torch.equal(grads[0], grads[1])


def test_channels_last_convolution_keeps_cpus_memory_format(mode):
    """A channels_last conv gives a channels_last output on CPU; meta's is contiguous, and
    convolutions were never probed (every layer after it then differed in layout)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 3, 3, 3, generator=g).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 8, 8, generator=g).to(memory_format=torch.channels_last)
    xs = []
    for dev in ("cpu", N):
        y = F.max_pool2d(F.relu(F.conv2d(x.to(dev), w.to(dev), padding=1)), 2)
        xs.append(y)
    assert xs[1].stride() == xs[0].stride() and xs[1].is_contiguous(
        memory_format=torch.channels_last)
    assert torch.allclose(xs[1].cpu(), xs[0], atol=1e-5)


def test_transformer_fast_path_on_a_column_major_input_has_cpus_layout(mode):
    """tests/conformance/test_modules.py (TransformerEncoderLayer, norm_first, eval under
    no_grad): CPU's `_transformer_encoder_layer_fwd` returns a contiguous output for a
    column-major input; its meta output follows the input's strides, and contractions of
    one dtype were not probed (Note [CPU probe]), so neuron's output kept the input's."""
    torch.manual_seed(0)
    m = torch.nn.TransformerEncoderLayer(4, 2, 16, dropout=0.0, batch_first=True,
                                         norm_first=True).eval()
    x = torch.randn(2, 3, 4).mT.contiguous().mT
    with torch.no_grad():
        expected = m(x)
        m.to(N)
        y = m(x.to(N).mT.contiguous().mT)
    assert expected.stride() == (12, 4, 1) and y.stride() == expected.stride()
    assert torch.equal(y.cpu(), expected)


@pytest.mark.parametrize("dtype,good,bad", [(torch.int64, 1.5, float("nan")),
                                             (torch.uint8, 1.0, -1.0),
                                             (torch.float16, 1.0, 1e10)])
def test_a_fill_value_the_dtype_cannot_hold_raises_at_the_call_every_time(mode, dtype, good,
                                                                          bad):
    """fuzzer (seed 8102060): CPU checks the conversion per call; the probe saw only a
    signature's first value, so a later nan filled into int64 went unchecked until the sync."""
    for dev in ("cpu", N):
        t = torch.zeros(3, dtype=dtype, device=dev)
        t.fill_(good)  # the signature is now cached
        t[torch.tensor([0], device=dev)] = good
        fills = [lambda: t.fill_(bad), lambda: t.masked_fill(t == 0, bad)]
        if not dtype.is_floating_point:  # CPU's own setitem skips the check for floats
            fills.append(lambda: t.__setitem__(torch.tensor([0], device=dev), bad))
        for fill in fills:
            with pytest.raises(RuntimeError, match="cannot be converted to type .* without "
                                                   "overflow"):
                fill()
    assert torch.equal(t.cpu(), torch.full((3,), good, dtype=dtype))
    # scatter with nothing to write returns before converting (final bar, seed 9634635)
    for dev in ("cpu", N):
        e = torch.zeros(1, 0, dtype=torch.long, device=dev)
        for _ in range(2):  # the second call hits the cached signature
            e.scatter(0, torch.zeros(3, 0, dtype=torch.long, device=dev), float("nan"))


def test_two_tensors_over_one_memory_are_not_one_tensor(mode):
    """Note [Tensor identity] (fuzzer, every bar pair): CPU's overlap check refuses one tensor
    passed twice but cannot prove an overlap of two empty ones; the program handed the op one
    host tensor for both, so `x.scatter_(0, i, x.detach())` raised on neuron only."""
    outcomes = []
    for dev in ("cpu", N):
        x = torch.ones(2, 2, 0, device=dev)
        i = torch.zeros(1, 2, 0, dtype=torch.long, device=dev)
        x.scatter_(0, i, x.detach())  # distinct tensors: no overlap to refuse
        x.scatter_(0, i, x.squeeze())  # (a view with the same layout)
        torch.neuron.synchronize()  # nothing deferred either
        with pytest.raises(RuntimeError, match="single memory location"):
            x.scatter_(0, i, x)  # the same tensor: refused
            torch.neuron.synchronize()
        outcomes.append(x.shape)
    assert outcomes[0] == outcomes[1]


def test_boolean_mask_backward_is_not_refused_by_the_probe(mode):
    """index_put with a mask: the probe's blank masks select 0 or all elements, which is no
    user error (the real mask decides)."""
    x = torch.tensor([[1., -1.], [-1., 1.]])
    d = x.to(N).requires_grad_()
    d[d > 0].sum().backward()
    c = x.clone().requires_grad_()
    c[c > 0].sum().backward()
    assert d.grad.tolist() == c.grad.tolist()


def test_the_same_tensor_twice_gets_cpus_overlap_error(mode):
    """`v.index_copy_(0, i, v)`: CPU refuses a source that is the destination itself before
    it checks sizes; the CPU probe passes one twin for the one tensor, so neuron does too."""
    def go(dev):
        v = torch.zeros(2, 1, 0, dtype=torch.bool, device=dev)
        with pytest.raises(Exception) as info:
            v.index_copy_(0, torch.tensor([-4], device=dev), v)
        return type(info.value), str(info.value)
    assert go(N) == go("cpu")


def test_optional_scalars_are_keyed_by_type(mode):
    """clamp's `min`/`max` are `Scalar?`: runtime scalars keyed by their type, never by value
    (0 == False == -0.0 made one cache entry, and the first call's dtype won; fuzzer seed
    2011793)."""
    calls = ["min=0, max=1", "min=0.0, max=1", "min=False, max=True", "max=1", "max=1.0",
             "max=True", "min=-0.0", "min=0", "min=False, max=-0.0", "min=0, max=0"]
    for dt in (torch.int64, torch.int32, torch.float32):
        for args in calls:
            want = eval(f"torch.full((2,), 3).to(dt).clamp({args})")
            got = eval(f"torch.full((2,), 3, device=N).to(dt).clamp({args})")
            assert (got.dtype, got.cpu().tolist()) == (want.dtype, want.tolist()), (dt, args)


def test_every_optional_scalar_argument_is_a_runtime_input():
    from fusion.ir import scalar_positions
    pos, names = scalar_positions(torch.ops.aten.clamp.default)
    assert {1, 2} <= pos and {"min", "max"} <= names


def test_index_put_takes_host_indices_as_cuda_does(mode):
    """`x[cpu_idx] = v`, boolean host masks, `index_put_` with host indices and
    `nn.init.sparse_` (host randperm indices): CUDA copies host indices to the device; these
    raised "Expected all tensors to be on the same device" on neuron."""
    def run(dev):
        x = torch.zeros(3, 4, device=dev, requires_grad=True).clone()
        x[torch.tensor([0, 2])] = 1.0
        x[torch.tensor([True, False, True]), 1] += 5
        x.index_put_((torch.tensor([1]), torch.tensor([3])), torch.tensor(7.0, device=dev),
                     accumulate=True)
        x.sum().backward()
        torch.manual_seed(0)
        w = torch.nn.init.sparse_(torch.empty(6, 5, device=dev), 0.5)
        return x.detach().cpu(), (w.cpu() == 0).sum(0)
    for a, b in zip(run("neuron"), run("cpu")):
        assert torch.equal(a, b)


def test_ops_run_on_the_host_still_refuse_two_devices(mode):
    """A fallback (or data-dependent) op runs on the host, yet its arguments obey CUDA's
    device rule: `torch.equal(neuron_t, cpu_t)` said True, where CUDA raises."""
    n, c = torch.ones(3, device="neuron"), torch.ones(3)
    for f in (lambda: torch.equal(n, c), lambda: torch.allclose(n, c),
              lambda: torch.nonzero(n + c)):
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            f()
    assert torch.equal(n, n) and torch.equal(n, torch.ones(3, device="neuron"))
    assert torch.equal(n * torch.tensor(2.0), torch.full((3,), 2.0, device="neuron"))  # 0-d


def test_a_host_tensor_indexed_by_device_indices_raises_indexs_error(mode):
    """`cpu_t[neuron_idx]` raised the two-devices error; CUDA raises index's own check, which
    PyTorch's test_torch.py::test_advancedindex_mixed_devices_error expects."""
    x, i = torch.randn(3, 4, 4), torch.tensor([0, 2, 1], device="neuron")
    for f in (lambda: x[i], lambda: x[:, torch.tensor([0, 2, 1]), None, i]):
        with pytest.raises(RuntimeError, match=r"^indices should be either on cpu or on the "
                                               r"same device as the indexed tensor \(cpu\)$"):
            f()
    assert torch.equal(x.to("neuron")[i].cpu(), x[i.cpu()])  # a device tensor takes them


def test_a_host_scalar_tensor_is_an_input_never_an_output(mode):
    """CUDA takes a 0-d CPU tensor as a value beside device tensors, never as the tensor an
    op writes. `total = torch.tensor(0.); total += loss` style code wrote wrong values into
    the CPU tensor (`pow_` gave 1., `clamp_` 0.) or raised an AttributeError after zeroing it."""
    n = torch.tensor(2.0, device="neuron")
    writes = [lambda c: c.pow_(n), lambda c: c.clamp_(max=n), lambda c: c.mul_(n),
              lambda c: c.add_(n), lambda c: c.addcmul_(n, n),
              lambda c: torch.add(c, n, out=c), lambda c: torch._foreach_add_([c], [n]),
              lambda c: c.put_(torch.tensor([0], device="neuron"), n.view(1))]
    for write in writes:
        c = torch.tensor(3.0)
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            write(c)
        assert c.item() == 3.0  # untouched
    c = torch.tensor(3.0)
    assert (n * c).item() == 6.0 and torch.clamp(c, max=n).item() == 2.0  # as values: fine
    c = torch.zeros(2)
    c.copy_(n)  # a device-to-host copy
    assert c.tolist() == [2.0, 2.0] and (n ** 2).item() == 4.0  # the engine still works


def test_histc_counts_integer_tensors_as_cuda_does(mode):
    """CPU's histc takes floating point only; CUDA's (and so the device's) counts integers
    too, as MoE routing in transformers does on every device but cpu and mps (Mixtral,
    Qwen2-MoE raised "histogram_cpu" not implemented for 'Int')."""
    def cuda_histc(values, bins, lo, hi):  # CUDA's integer kernel, written out
        if lo == hi:
            lo, hi = min(values), max(values)
        if lo == hi:
            lo, hi = lo - 1, hi + 1
        out = [0] * bins
        for v in values:
            if lo <= v <= hi:
                out[min((v - lo) * bins // (hi - lo), bins - 1)] += 1
        return out
    values = [0, 1, 1, 3, 5, -2, 7, 7]
    for dtype in (torch.int32, torch.int64, torch.uint8):
        vals = [v for v in values if v >= 0] if dtype is torch.uint8 else values
        x = torch.tensor(vals, dtype=dtype, device="neuron")
        for bins, lo, hi in ((4, 0, 3), (3, 0, 0), (5, 1, 7), (2, 4, 4)):
            h = torch.histc(x * 1, bins=bins, min=lo, max=hi)
            assert h.dtype == dtype and h.tolist() == cuda_histc(vals, bins, lo, hi)
    f = torch.randn(50)
    assert torch.equal(torch.histc(f.to("neuron"), bins=7).cpu(), torch.histc(f, bins=7))


def test_a_hook_that_raises_in_backward_raises_to_the_caller():
    """A tensor hook (or post-accumulate hook) raising inside a neuron backward aborted the
    process ("terminate called without an active exception": the error unwound through
    the Python device guard). Note [Hooks that raise] in hooks.py. In a child process:
    the old behaviour kills it."""
    r = _run("""
        import pytest, torch, adaptive_eager as ae
        def boom(*_):
            raise ValueError("boom")
        for adaptive in (False, True):
            ae.set_adaptive(adaptive)
            w = torch.randn(4, 4, device="neuron", requires_grad=True)
            h = (w * 2).relu()
            h.register_hook(boom)
            with pytest.raises(ValueError, match="boom"):
                h.sum().backward()
            handle = w.register_post_accumulate_grad_hook(boom)
            with pytest.raises(ValueError, match="boom"):
                (w * 3).sum().backward()
            handle.remove()
            with pytest.raises(ValueError, match="boom"):  # outside a backward: as any call
                next(iter(h._backward_hooks.values()))(torch.ones(4, 4))
            m = torch.nn.Linear(4, 4).to("neuron")
            x = torch.randn(2, 4, device="neuron", requires_grad=True)
            for register in (m.register_full_backward_hook, m.register_full_backward_pre_hook):
                handle = register(boom)  # a module's, through BackwardHook's node hooks
                with pytest.raises(ValueError, match="boom"):
                    m(x).sum().backward()
                handle.remove()
            m.register_full_backward_hook(lambda mod, gi, go: (gi[0] * 2,))
            m(x).sum().backward()
            assert torch.equal(x.grad.cpu(), 2 * m.weight.detach().cpu().sum(0).expand(2, 4))
            v = torch.ones(3, device="neuron", requires_grad=True)
            v.register_hook(lambda g: g * 10)  # hooks that work still work
            (v * 2).sum().backward()
            assert v.grad.tolist() == [20.0] * 3
            assert (w * 3).sum().item() == (w.detach().cpu() * 3).sum().item()
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_unpack_hooks_checkpoint_recompute_and_wrong_hook_returns_raise_as_on_cpu():
    """More of Note [Hooks that raise]: a saved-tensor unpack hook that raises (so any error in
    a non-reentrant checkpoint's recompute: Transformers' gradient checkpointing), a tensor or
    post-accumulate hook returning a non-tensor, and a legacy module backward hook that raises
    each aborted the process in a neuron backward. Each must raise what CPU raises."""
    r = _run("""
        import torch, adaptive_eager as ae
        from torch.utils.checkpoint import checkpoint
        def outcome(dev, case):
            x = torch.ones(2, 3, device=dev, requires_grad=True)
            try:
                if case == "unpack":
                    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: 1 / 0):
                        y = x.exp()
                elif case == "recompute":
                    w = {"w": torch.ones(3, 4, device=dev)}
                    y = checkpoint(lambda a: a @ w["w"], x, use_reentrant=False)
                    w["w"] = torch.ones(5, 4, device=dev)
                elif case == "recompute_shape":
                    n = {"k": 2}
                    y = checkpoint(lambda a: a[:n["k"]].exp(), x, use_reentrant=False)
                    n["k"] = 1
                elif case == "tensor_hook":
                    y = x * 2
                    y.register_hook(lambda g: (g,))
                elif case == "post_hook":
                    x.register_post_accumulate_grad_hook(lambda p: 1)
                    y = x * 2
                elif case == "legacy":
                    m = torch.nn.Linear(3, 3).to(dev)
                    m.register_backward_hook(lambda m, gi, go: 1 / 0)
                    y = m(x)
                y.sum().backward()
                return "no error"
            except Exception as e:
                return f"{type(e).__name__}: {str(e).splitlines()[0]}"
        import warnings
        warnings.simplefilter("ignore")
        for adaptive in (False, True):
            ae.set_adaptive(adaptive)
            for case in ("unpack", "recompute", "recompute_shape", "tensor_hook", "post_hook",
                         "legacy"):
                cpu, neuron = outcome("cpu", case), outcome("neuron", case)
                assert cpu == neuron and cpu != "no error", (case, cpu, neuron)
            x = torch.randn(4, 4, device="neuron", requires_grad=True)
            y = checkpoint(lambda a: (a * 2).sin().sum(), x, use_reentrant=False)
            y.backward()  # a working checkpoint still works, as on CPU
            xc = x.detach().cpu().requires_grad_()
            (xc * 2).sin().sum().backward()
            assert torch.equal(x.grad.cpu(), xc.grad)
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_views_in_inference_mode_follow_their_base(mode):
    """In inference mode a view of an ordinary tensor is an ordinary tensor, and a view of an
    inference tensor is an inference tensor anywhere (CPU). Every view of a neuron tensor made
    in inference mode raised "Cannot set version_counter for inference tensor" (so
    nn.MultiheadAttention under torch.inference_mode), and one of an inference tensor taken
    outside it could be written in place."""
    def program(dev):
        x = torch.arange(6.).to(dev)
        with torch.inference_mode():
            views = [x.view(2, 3), x[1:], x.view(2, 3).t(), x.detach(), *x.split(2)]
            a = torch.ones(3, device=dev)
        flags = [v.is_inference() for v in views] + [a[:2].is_inference()]
        try:
            a[:2].mul_(2)
            err = None
        except RuntimeError as e:
            err = str(e)
        return flags, err, [v.cpu().tolist() for v in views]
    assert program("neuron") == program("cpu")
    mha = torch.nn.MultiheadAttention(4, 2)
    q = torch.randn(3, 2, 4)
    with torch.inference_mode():
        ref = mha(q, q, q)[0]
    mha.to("neuron")
    qn = q.to("neuron")  # one tensor, as on CPU: `query is key is value` picks the packed
    with torch.inference_mode():  # in-projection (one linear, not three: other rounding)
        out = mha(qn, qn, qn)[0]
    assert torch.equal(out.cpu(), ref)


def test_composite_ops_in_inference_mode_decompose_as_on_cpu(mode):
    """Note [Composite ops in inference mode] (engine/handlers.py): with autograd's key skipped,
    `to`, `softmax`, `layer_norm`... reached the device whole: `.cpu()` of a tensor made in
    inference mode returned a neuron tensor, and softmax or layer_norm fell back to the CPU."""
    x = torch.randn(4, 8)
    with torch.inference_mode():
        y = x.to("neuron") * 2
        inside = y.cpu()
        z = torch.nn.functional.layer_norm(y.softmax(-1), (8,))
    outside = y.cpu()
    assert type(inside) is torch.Tensor and inside.device.type == "cpu"
    assert type(outside) is torch.Tensor and outside.device.type == "cpu"
    with torch.inference_mode():
        ref = torch.nn.functional.layer_norm((x * 2).softmax(-1), (8,))
    assert torch.equal(z.cpu(), ref) and torch.equal(outside, x * 2)
    assert not ae.metrics().cpu_fallbacks


def test_composite_views_in_inference_mode_are_views_of_their_base(mode):
    """Note [Composite ops in inference mode]: a composite view (`reshape`, `flatten`, `mT`,
    `movedim`, `expand_as`...) of an ordinary tensor made in inference mode was a tensor of its
    own over the same buffer, without `requires_grad`: an in-place change of it, then a
    backward through its base, gave a wrong gradient where CPU raises."""
    views = {"reshape": lambda y: y.reshape(-1), "flatten": lambda y: y.flatten(),
             "mT": lambda y: y.mT, "movedim": lambda y: y.movedim(0, 1),
             "expand_as": lambda y: y.expand_as(y), "narrow": lambda y: y.narrow(0, 1, 1),
             "unflatten": lambda y: y.unflatten(1, (3, 1)), "chunk": lambda y: y.chunk(2)[1],
             "view_as": lambda y: y.view_as(y), "T": lambda y: y.T}

    def program(d):
        out = []
        for name, view in views.items():
            w = torch.tensor([[1., 2., 3.], [4., 5., 6.]], device=d, requires_grad=True)
            y = w.exp()  # saves its output
            with torch.inference_mode():
                v = view(y)
                out.append((name, v.requires_grad, v._is_view(), v.is_inference()))
                v.mul_(2)
            try:
                y.sum().backward()
                out.append(w.grad.cpu().tolist())
            except RuntimeError as e:
                out.append(("raised", y._version, "modified by an inplace" in str(e)))
        return out
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes():  # CPU's own path (a dispatch mode changes it)
        ref = program("cpu")
    assert program("neuron") == ref


def test_writes_in_inference_mode_flushed_outside_it_are_cpus(mode):
    """Note [Flushes outside inference mode]: a flush inside inference mode (a new op's, under
    the matmul strategy) made the host view its buffer keeps an inference tensor, and the
    write through a view queued after it, flushed outside the mode, raised "Inplace update to
    inference tensor outside InferenceMode" (fuzzer seed 95069, matmul and none)."""
    def program(d):
        torch.manual_seed(0)
        v = torch.randn(3, device=d)
        with torch.inference_mode():
            v.reshape(-1).mul_(2)
        ae.synchronize()  # (outside dispatch: autograd's keys check inference tensors)
        w = torch.randn(2, 3, device=d) * 2
        with torch.inference_mode():
            w[1].add_(v)
            s = w.sum()
        ae.synchronize()
        w.mul_(3)
        return [t.cpu().tolist() for t in (v, w, s)]
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes():
        ref = program("cpu")
    assert program("neuron") == ref


def test_out_arguments_of_host_run_ops_are_resized_as_on_cpu(mode):
    """An op run on the host (data-dependent shapes: nonzero, masked_select; CPU fallbacks:
    linalg, fft) into an out= of the wrong shape left the device tensor unchanged (the
    `torch.empty(0)` idiom gave an empty result, silently); sort into strided outs of the
    right shape recursed forever."""
    import warnings

    def program(d):
        x = torch.tensor([0., 1., 0., 2., 3.]).to(d)
        a = torch.tensor([[2., 0.], [0., 4.]]).to(d)
        o1 = torch.empty(0, dtype=torch.long).to(d)
        same = torch.nonzero(x, out=o1) is o1
        o2 = torch.full((5,), -1.).to(d)
        torch.masked_select(x, x > 0, out=o2)
        o3 = torch.empty(0).to(d)
        torch.linalg.inv(a, out=o3)
        o4 = torch.empty(0, dtype=torch.complex64).to(d)
        torch.fft.rfft(x, out=o4)
        o5 = torch.empty(2, 2).to(d).t()
        torch.linalg.inv(a, out=o5)
        v, i = torch.zeros(10).to(d)[::2], torch.zeros(10, dtype=torch.long).to(d)[::2]
        torch.sort(x, out=(v, i))
        return [same] + [(t.cpu().tolist(), t.shape, t.stride()) for t in (o1, o2, o3, o4, o5, v, i)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert program("neuron") == program("cpu")


def test_double_backward_matches_cpu_bit_for_bit(mode):
    """Autograd orders the nodes a double backward creates by a per-thread sequence number: on
    autograd's device thread a gradient penalty summed in another order than CPU's (224 of
    1000 elements a few ulps off). A neuron backward runs on the caller's thread, as CPU's."""
    x0 = torch.randn(1000, generator=torch.Generator().manual_seed(0))

    def run(dev):
        z = x0.clone().to(dev).requires_grad_()
        g, = torch.autograd.grad((z * z * z).sum() + z.exp().sum(), z, create_graph=True)
        h, = torch.autograd.grad((g * g).sum() + g.sin().sum(), z)
        return g.detach().cpu(), h.cpu()
    for a, b in zip(run("cpu"), run("neuron")):
        assert torch.equal(a, b)


def test_argument_errors_of_ops_with_data_dependent_shapes_are_cpus(mode):
    """An op the host waits for (unique, bincount, masked_select, repeat_interleave) raised
    its argument errors as NeuronRuntimeError: `except IndexError` missed them."""
    def program(d):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).to(d)
        out = []
        for f in (lambda: torch.unique(x, dim=3), lambda: torch.bincount(x.flatten()),
                  lambda: torch.masked_select(x, torch.ones(5, dtype=torch.bool).to(d)),
                  lambda: torch.repeat_interleave(torch.tensor([1, -1]).to(d))):
            try:
                f()
                out.append(None)
            except Exception as e:
                out.append((type(e), str(e)))
        return out + [(x * 2).sum().item()]
    assert program("neuron") == program("cpu")


def test_integer_division_of_int_min_by_minus_one_does_not_kill_the_process():
    """CPU's `div(..., rounding_mode=...)` traps on INT_MIN / -1 (SIGFPE); the device gives
    CUDA's wrapped quotient. In a child process: the old behaviour kills it."""
    r = _run("""
        import torch, adaptive_eager as ae
        for adaptive in (False, True):
            ae.set_adaptive(adaptive)
            for dt in (torch.int64, torch.int32):
                lo = torch.iinfo(dt).min
                a = torch.tensor([lo, 7, -7, lo], dtype=dt).to("neuron")
                b = torch.tensor([-1, -1, 2, 3], dtype=dt).to("neuron")
                assert torch.div(a, b, rounding_mode="trunc").tolist() == [lo, -7, -3, lo // 3 + 1]
                assert torch.div(a, -1, rounding_mode="floor").tolist() == [lo, -7, 7, lo]
                c = a.clone()
                c.div_(b, rounding_mode="trunc")
                assert c.tolist() == [lo, -7, -3, lo // 3 + 1]
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])


def test_singular_and_eigenvalues_match_cpu_bit_for_bit(mode):
    """PyTorch asks LAPACK for vectors too for any tensor subclass (linalg.py): svdvals,
    eigvalsh, the nuclear norm, cond and svd(compute_uv=False) were a few ulps off CPU's."""
    from torch.utils._python_dispatch import _disable_current_modes
    a = torch.randn(5, 5, generator=torch.Generator().manual_seed(0))
    s = a @ a.t() + torch.eye(5)
    for f in (lambda a, s: torch.linalg.svdvals(a), lambda a, s: torch.linalg.eigvalsh(s),
              lambda a, s: torch.linalg.matrix_norm(a, "nuc"),
              lambda a, s: torch.linalg.cond(a),
              lambda a, s: torch.svd(a, compute_uv=False)[1]):
        with _disable_current_modes():  # CPU's own path (any dispatch mode changes it)
            ref = f(a, s)
        assert torch.equal(f(a.to("neuron"), s.to("neuron")).cpu(), ref)
    an, ac = a.to("neuron").requires_grad_(), a.clone().requires_grad_()
    torch.linalg.svdvals(an).sum().backward()
    torch.linalg.svdvals(ac).sum().backward()
    assert torch.equal(an.grad.cpu(), ac.grad)


def test_an_in_place_op_never_reshapes_its_self(mode):
    """`x.addr_(u, v)` of a 0-d x: the meta kernel reshapes `self`, CPU's kernel refuses. The
    device took it for an out= to resize: x became (3, 2) of uninitialized memory, silently."""
    def program(d):
        out = []
        for f in (lambda: torch.tensor(1.5).to(d).addr_(torch.arange(3.).to(d),
                                                          torch.arange(2.).to(d)),
                  lambda: torch.zeros(1, 1).to(d).addr_(torch.arange(3.).to(d),
                                                        torch.arange(2.).to(d))):
            try:
                f()
                out.append(None)
            except RuntimeError as e:
                out.append(str(e))
        return out
    assert program("neuron") == program("cpu") and None not in program("cpu")


def test_composite_in_place_ops_in_inference_mode_keep_cpus_checks(mode):
    """Note [Composite ops in inference mode]: a composite in-place op (`square_`, `clip_`)
    decomposed on the device did not bump the version of what it wrote (a backward then gave
    a wrong gradient where CPU raises), nor refuse an inference tensor outside the mode."""
    import warnings

    def program(d):
        out = []
        for op in (lambda y: y.square_(), lambda y: y.clip_(0, 2),
                   lambda y: y.true_divide_(2.0)):
            w = torch.tensor([1., 2., 3.], device=d, requires_grad=True)
            y = w * 1
            z = (y * y).sum()
            with torch.inference_mode():
                op(y)
            try:
                z.backward()
                out.append(("no error", w.grad.cpu().tolist()))
            except RuntimeError as e:
                out.append(("raised", y._version, "modified by an inplace" in str(e)))
            with torch.inference_mode():
                x = torch.ones(3, device=d)
            try:
                op(x)
                out.append("no error")
            except RuntimeError as e:
                out.append(str(e))
        return out
    from torch.utils._python_dispatch import _disable_current_modes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with _disable_current_modes():  # CPU's own path (a dispatch mode changes it)
            ref = program("cpu")
        assert program("neuron") == ref


@pytest.mark.parametrize("op", [lambda t: t.t_(), lambda t: t.transpose_(0, 5),
                                lambda t: t.squeeze_(7), lambda t: t.unsqueeze_(9),
                                lambda t: t.as_strided_((2,), (1,), -1)],
                         ids=["t_", "transpose_", "squeeze_", "unsqueeze_", "as_strided_"])
def test_refused_inplace_views_raise_cpus_errors(mode, op):
    """A meta kernel's refusal of an in-place view op is not CPU's (`t_` of a 3-d tensor
    raised AssertionError): CPU's own error, type and words (fuzzer seed 72019429)."""
    def err(dev):
        t = torch.zeros(1, 2, 3).to(dev)
        with pytest.raises(Exception) as e:
            op(t)
        return type(e.value), str(e.value)
    assert err(N) == err("cpu")


# -- Note [Copied views] (adaptive_eager/errors.py) ------------------------------------------
_CONJ_WRITES = {
    "add_": lambda z: z.conj().add_(1),
    "imag.fill_": lambda z: z.conj().imag.fill_(1),
    "copy_ device": lambda z: z.conj().copy_(torch.ones(3, dtype=torch.cfloat, device=z.device)),
    "copy_ host": lambda z: z.conj().copy_(torch.ones(3, dtype=torch.cfloat)),
    "out=": lambda z: torch.mul(z, 2, out=z.conj()),
    "neg_": lambda z: z.conj().imag.neg_(),
    "setitem": lambda z: z.conj().__setitem__(0, 5),
    "fallback put_": lambda z: z.conj().real.put_(torch.tensor([0], device=z.device),
                                                 torch.tensor([9.0], device=z.device)),
}
_CONJ_READS = {
    "clone then write": lambda z: z.conj().clone().add_(1),
    "resolve_conj then write": lambda z: z.conj().resolve_conj().add_(1),
    "read": lambda z: z.conj() * 2,
    "resolve of a plain tensor is itself": lambda z: torch.tensor(float(z.resolve_conj() is z)),
}


@pytest.mark.parametrize("adaptive", [False, True], ids=["eager", "adaptive"])
@pytest.mark.parametrize("name", list(_CONJ_WRITES))
def test_a_write_through_a_conj_view_is_refused(name, adaptive):
    """A conj view is a copy on the device: a write through it left `z` unchanged where CPU
    writes `z` (silently wrong; found by PyTorch's test_view_ops.py). Refused at the call,
    the tensor untouched and the engine usable."""
    z0 = torch.tensor([1 + 2j, 3 - 1j, -2 + 0.5j])
    with ae.adaptive() if adaptive else contextlib.nullcontext():
        z = z0.to("neuron")
        with pytest.raises(RuntimeError, match=r"a write through a conj\(\) or neg view"):
            _CONJ_WRITES[name](z)
        assert torch.equal(z.cpu(), z0)
        x = torch.arange(4.0, device="neuron")
        assert torch.equal((x * 2).cpu(), torch.arange(4.0) * 2)


@pytest.mark.parametrize("adaptive", [False, True], ids=["eager", "adaptive"])
@pytest.mark.parametrize("name", list(_CONJ_READS))
def test_reads_and_copies_of_a_conj_view_are_cpus(name, adaptive):
    z0 = torch.tensor([1 + 2j, 3 - 1j, -2 + 0.5j])
    want = _CONJ_READS[name](z0.clone())
    with ae.adaptive() if adaptive else contextlib.nullcontext():
        z = z0.to("neuron")
        got = _CONJ_READS[name](z)
        assert torch.equal(got.cpu(), want) and torch.equal(z.cpu(), z0)


def _untagged_overloads(d):
    """In-place and out= overloads PyTorch leaves without its pointwise tag, and the
    reductions distributions' argument checks call (`_is_all_true`)."""
    x = torch.linspace(-3, 3, 11).to(d)
    o = torch.empty(11, device=d)
    aten = torch.ops.aten
    return [aten.gelu_(x.clone()), aten.gelu.out(x, out=o.clone()),
            aten.softshrink.out(x, 0.5, out=o.clone()), aten.softplus.out(x, 1, 20, out=o.clone()),
            F.mish(x.clone(), inplace=True), F.threshold(x.clone(), 0.1, 2.0, inplace=True),
            torch._is_all_true(x > -5).reshape(1), torch._is_any_true(x > 5).reshape(1),
            # overloads named other than `default` (`eq_.Scalar` -> `eq.Scalar`), dunders
            x.clone().eq_(0.6), x.clone().gt_(x.flip(0)), x.clone().ne_(0), x.clone().lt_(0.1),
            x.clone().le_(x * 0), x.clone().ge_(-0.6), x.clone().copysign_(-1.0),
            x.clone().copysign_(x.flip(0)), x.abs().xlogy_(2.0),
            torch.arange(-4, 7, device=d).__irshift__(1), torch.arange(11, device=d).__irshift__(
                torch.arange(11, device=d) % 3)]


@pytest.mark.parametrize("adaptive", [False, True], ids=["eager", "adaptive"])
def test_untagged_inplace_and_out_overloads_run_on_the_device(adaptive):
    """They took their functional form's class only by tag: each fell back to CPU (warning,
    copies, a sync in adaptive mode)."""
    _on_the_device_as_cpu(_untagged_overloads, adaptive)


def _on_the_device_as_cpu(make, adaptive):
    """`make(device)`'s tensors on neuron equal CPU's, with no op falling back."""
    want = make("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "fell back to CPU"
        with ae.adaptive() if adaptive else contextlib.nullcontext():
            got = [t.cpu() for t in make("neuron")]
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


def _ops_without_a_class(d):
    """ATen ops the device had no class for (a scan of every op with a CPU kernel)."""
    x = torch.linspace(-3, 3, 12).to(d)
    w = torch.arange(12.0).reshape(4, 3).to(d)
    img = torch.arange(16.0).reshape(1, 4, 2, 2).to(d)
    theta = torch.tensor([[[1.0, 0.2, 0.0], [0.0, 1.0, 0.1]]]).to(d)
    return [torch.block_diag(x[:4].reshape(2, 2), x[None, 4:7]),
            F.affine_grid(theta, [1, 1, 3, 4], align_corners=False),
            torch.conv_tbc(x[:10].reshape(5, 1, 2), w[:3, :2].reshape(3, 2, 1).expand(3, 2, 2),
                           x[:2].clone()),
            torch.nonzero_static(x > 0, size=8, fill_value=-1),
            torch.native_channel_shuffle(img, 2),
            x.clone().put_(torch.tensor([1, 1, -1], device=d), x[:3], accumulate=True),
            x.clone().put(torch.tensor([0, 5], device=d), x[:2]),
            F.embedding(torch.tensor([0, 2, 2], device=d), w.clone(), max_norm=5.0),
            torch._VF._add_relu(x, x.flip(0)),
            torch.ops.aten._unsafe_masked_index(w, x[5:9, None] > 0,
                                                [torch.tensor([0, 3, 1, 2], device=d)], -1.0),
            torch.ops.aten._unsafe_masked_index_put_accumulate(
                w, x[5:9, None] > 0, [torch.tensor([0, 3, 3, 2], device=d)], w[:, :1] * 0.5),
            torch.hash_tensor(torch.arange(6, device=d).reshape(2, 3), [1]),
            *torch.histogram(x, bins=torch.tensor([-3.0, 0.0, 1.0, 3.0], device=d), weight=x.abs()),
            torch.histogram(x, 5, range=(-1.0, 1.0), density=True).hist,
            *_histogramdd(torch.stack([x, x.flip(0)], 1))] + _bn_with_update(d)


def _histogramdd(points):
    hist, edges = torch.histogramdd(points, bins=[3, 2])
    return [hist, *edges]


def _bn_with_update(d):
    """Batch norm's forms for graphs (`_batch_norm_with_update`, its backward and its
    functional and no-update forms): values, running statistics and gradients."""
    x = torch.linspace(-2, 3, 24).reshape(4, 3, 2).to(d).requires_grad_()
    w = torch.tensor([0.5, -1.0, 2.0]).to(d).requires_grad_()
    rm, rv = torch.zeros(3).to(d), torch.ones(3).to(d)
    out = torch.ops.aten._batch_norm_with_update(x, w, w * 0.1, rm, rv, 0.1, 1e-5)
    out[0].pow(2).sum().backward()
    args = (x.detach(), w.detach(), None, rm, rv, 0.1, 1e-5)
    return [*out[:3], rm, rv, x.grad, w.grad, torch.ops.aten._batch_norm_no_update(*args)[0],
            *torch.ops.aten._batch_norm_with_update_functional(*args)[3:]]


@pytest.mark.parametrize("adaptive", [False, True], ids=["eager", "adaptive"])
def test_ops_the_device_had_no_class_for_run_on_the_device(adaptive):
    """block_diag, affine_grid, conv_tbc, nonzero_static, native_channel_shuffle, put(_),
    embedding's max_norm renorm, _add_relu, the _unsafe_masked_index ops (decompositions'),
    hash_tensor, the _batch_norm_with_update family and histogram(dd) (then run at the call,
    now queued: test_histograms_queue_on_the_device) fell back to the CPU (warning, copies, a sync in adaptive mode)."""
    _on_the_device_as_cpu(_ops_without_a_class, adaptive)


def _histograms(d):
    """histc, histogram (bin count, range, bin tensor, weight, density) and histogramdd (bin
    counts, bin tensors) of a strided input."""
    x = torch.linspace(-3, 3, 24).reshape(4, 6).T.to(d)  # column-major
    pts = x[:, :2]
    edges = [torch.tensor([-3.0, -1.0, 0.5, 3.0], device=d), torch.tensor([-2.0, 2.0], device=d)]
    return [torch.histc(x, bins=7), torch.histc(x, bins=5, min=-1, max=2),
            *torch.histogram(x, 5), *torch.histogram(x, 3, range=(-1.0, 1.0)),
            *torch.histogram(x, edges[0], weight=x.abs(), density=True),
            *_histogramdd(pts), *torch.histogramdd(pts, bins=edges, weight=x[:, 2])[:1],
            torch.histogramdd(pts, bins=[4, 2], range=[-2.0, 2.0, -1.0, 3.0], density=True).hist]


@pytest.mark.parametrize("adaptive", [False, True], ids=["eager", "adaptive"])
def test_histograms_queue_on_the_device(adaptive):
    """histogram and histogramdd had no meta kernel (their shapes follow from the bins): they
    ran at the call, a sync in adaptive mode. CPU's rules (meta.py `_META_AS_CPU`) make them
    queued device ops, as histc; CPU's values, no flush until the read."""
    _on_the_device_as_cpu(_histograms, adaptive)
    with ae.adaptive():
        before = ae.metrics()
        got = _histograms("neuron")
        assert (ae.metrics() - before).flushes == {}
        got[-1].sum().item()


def test_histogram_errors_as_cpu(mode):
    """Shape, dtype and bin errors raise at the call with CPU's words; a range taken from
    non-finite values (a check of values) at the next sync, as histc's and an index out of
    range's."""
    x = torch.randn(5, device=N)
    for call, words in ((lambda: torch.histogram(x, 0), "bins must be > 0"),
                        (lambda: torch.histogram(x, 3, range=(2.0, 1.0)), "min should not exceed"),
                        (lambda: torch.histogram(x, 3, weight=x[:4]), "if weight tensor"),
                        (lambda: torch.histogram(x, torch.tensor([1, 2], device=N)), "same dtype"),
                        (lambda: torch.histogramdd(x[:, None], [3, 2]), "bins")):
        with pytest.raises(RuntimeError, match=words):
            call()
    inf = torch.tensor([1.0, float("inf")], device=N)
    for call, op in ((lambda: torch.histogram(inf, 3), "histogram"),
                     (lambda: torch.histogramdd(inf[:, None], [3]), "_histogramdd_bin_edges"),
                     (lambda: torch.histc(inf), "histc")):
        y = call()
        with pytest.raises(ae.NeuronRuntimeError, match=f"aten::{op}.*is not finite"):
            ae.synchronize()
    assert torch.histogram(x.cpu(), 3).hist.tolist() == torch.histogram(x, 3).hist.tolist()


def test_index_of_a_tensor_refuses_from_metadata_without_a_sync():
    """`operator.index` of a floating, complex or many-element tensor raises CPU's TypeError
    without reading the value (PyTorch's argument parser asks it of tensors in a list given
    where an overload takes int[]: a sync each); an integer or bool one-element tensor reads it."""
    import operator
    with ae.adaptive():
        x = torch.arange(3.0, device=N) * 2
        before = ae.metrics()
        for t in (x, x[1], x.long(), x.to(torch.complex64)[:1]):
            with pytest.raises(TypeError, match="only integer tensors of a single element"):
                operator.index(t)
            with pytest.raises(TypeError, match="only integer tensors of a single element"):
                operator.index(torch.empty_like(t, device="cpu"))  # CPU's words
        assert (ae.metrics() - before).flushes == {}
        assert operator.index(x.long()[1:2]) == 2 and operator.index(x[1:2] > 1) == 1


def _segment_reductions(d):
    """torch.segment_reduce by lengths and by offsets, each reduction, along the last and an
    inner axis of a strided input, empty segments, `initial`, and each one's gradient."""
    data = torch.linspace(-2, 3, 24).reshape(4, 6).T.to(d)  # (6, 4), column-major
    lengths = torch.tensor([2, 0, 3, 1], device=d)
    offsets = torch.tensor([[0, 1, 1, 4], [0, 2, 4, 4]], device=d)  # axis 1 of a (2, 4, 3)
    cube = torch.arange(24.0).reshape(2, 4, 3).to(d)
    out = []
    for reduce, initial in (("sum", None), ("mean", 0.5), ("max", None), ("min", -1.0),
                            ("prod", 2.0)):
        x, c = data.clone().requires_grad_(), cube.clone().requires_grad_()
        y = torch.segment_reduce(x, reduce, lengths=lengths, initial=initial)
        z = torch.segment_reduce(c, reduce, offsets=offsets, axis=1, initial=initial,
                                 unsafe=True)
        (y * torch.arange(1.0, 5.0, device=d)[:, None]).sum().add(z.pow(2).sum()).backward()
        out += [y, z, x.grad, c.grad]
    return out


@pytest.mark.parametrize("adaptive", [False, True], ids=["eager", "adaptive"])
def test_segment_reduce_and_its_backward_run_on_the_device(adaptive):
    """They fell back to the CPU (a sync in adaptive mode); then the CPU probe took their
    lengths check (they must sum to the data's size), which its blank buffers fail for every
    filling, for a user error. Values and gradients are CPU's bit for bit."""
    _on_the_device_as_cpu(_segment_reductions, adaptive)
    if adaptive:
        with ae.adaptive():
            before = ae.metrics()
            _segment_reductions("neuron")[-1].sum().item()
        assert list((ae.metrics() - before).flushes) == ["item"]


def test_segment_reduce_errors_as_cpu(mode):
    """Shape errors raise at the call with CPU's message; lengths that do not sum to the
    data's size (a check of values) at the next sync, as an index out of range does."""
    data = torch.arange(6.0, device=N)
    with pytest.raises(RuntimeError, match="reduce argument"):
        torch.segment_reduce(data, "median", lengths=torch.tensor([6], device=N))
    with pytest.raises(RuntimeError, match="Expected axis to be the last dimension"):
        torch.segment_reduce(data.reshape(2, 3), "sum", lengths=torch.tensor([1, 1], device=N),
                             axis=1)
    y = torch.segment_reduce(data, "sum", lengths=torch.tensor([2, 3], device=N))
    with pytest.raises(ae.NeuronRuntimeError, match="segment_reduce.*sum to data.size"):
        y.tolist()
    assert torch.segment_reduce(data, "max", lengths=torch.tensor([2, 4], device=N)).tolist() \
        == [1.0, 5.0]
