"""Executors: the interpreter (default, bit for bit eager) and TorchInductor (`inductor`
blocking, `auto` tiered in the background). Fused groups compiled by Inductor match CPU and
eager within float32 tolerance; random ops stay interpreted; every group left to the
interpreter is counted with its reason.

Inductor compiles take seconds: the tests here compile a handful of tiny groups, and reuse
them (same graphs hit Inductor's FX graph cache under the session's cache directory).
"""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import adaptive_eager as ae
from fusion.executors import tiered

TOL = {"rtol": 1e-5, "atol": 1e-5}  # float32: Inductor's fused loops reorder arithmetic


def chain(x, b):
    return F.gelu(x + b) * 0.5 + x  # bias, GELU, scale, residual: one fused group


def _inputs(seed=0, n=64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 32, generator=g), torch.randn(32, generator=g)


def test_default_executor_is_the_interpreter_and_compiles_nothing():
    assert ae.config.executor == "interpreter"
    x, b = _inputs()
    with ae.adaptive():
        y = chain(x.to("neuron"), b.to("neuron")).cpu()
        assert ae.explain().compiled == [False]
    assert torch.equal(y, chain(x, b))  # bit for bit
    m = ae.metrics()
    assert m.compiled_launches == 0 and m.compiled_groups == 0
    assert m.interpreted_launches == m.launches


def test_unknown_executor_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="unknown executor 'jit'.*interpreter"):
        with ae.override(executor="jit"):
            pass


def test_inductor_compiles_a_fused_group_before_its_first_launch():
    x, b = _inputs()
    xn, bn = x.to("neuron"), b.to("neuron")
    with ae.override(executor="inductor"), ae.adaptive():
        ae.reset_metrics()
        y1 = chain(xn, bn).cpu()
        assert ae.explain().compiled == [True]
        assert "[compiled]" in str(ae.explain())
        y2 = chain(xn, bn).cpu()
        m = ae.metrics()
    torch.testing.assert_close(y1, chain(x, b), **TOL)
    assert torch.equal(y1, y2)
    assert m.compiled_launches == 2 and m.interpreted_launches == 0
    assert m.compiled_groups <= 1  # 0 when an earlier test compiled this group already
    assert m.compile_failures == {}


def test_a_compiled_launch_makes_no_host_views_an_interpreted_one_does():
    """Note [Host views]: TorchInductor's code reads its inputs' storages (FxGroup.args), so
    a compiled launch makes no CPU tensors over its input buffers; the interpreter still
    makes and keeps them, and the results are unchanged."""
    x, b = _inputs()
    xn, bn = x.to("neuron"), b.to("neuron")
    ae.synchronize()
    bufs = [t._handle.buffer for t in (xn, bn)]
    for buf in bufs:
        buf.host = None
    with ae.override(executor="inductor"), ae.adaptive():
        ae.reset_metrics()
        y = chain(xn, bn).cpu()
        assert ae.explain().compiled == [True]
        assert ae.metrics().compiled_launches == 1
    assert [buf.host for buf in bufs] == [None, None]
    torch.testing.assert_close(y, chain(x, b), **TOL)
    with ae.adaptive():  # the interpreter: bit for bit eager, its host views kept
        y = chain(xn, bn).cpu()
        assert ae.explain().compiled == [False]
    assert all(buf.host is not None for buf in bufs)
    assert torch.equal(y, chain(x, b))


def test_fx_group_inputs_over_slot_storages_and_outputs_in_storages_of_their_own():
    """FxGroup.args and .store, without a compile: each flat input is a CPU tensor of the
    slot's dtype over exactly its elements of the slot's storage (also under a
    `torch.device` context); an output over an input's storage, or over another output's,
    is copied, so every created slot gets a storage of its own; a group without outputs
    (an optimizer's in-place group) leaves the slots alone."""
    from fusion.executors.fx import FxGroup
    x, k = torch.arange(6.0), torch.arange(3, dtype=torch.int64)
    ext = ((0, torch.float32, 4), (1, torch.int64, 3))
    outs = ((2, (4,), (1,), torch.float32), (3, (4,), (1,), torch.float32),
            (4, (2, 2), (2, 1), torch.float32), (5, (2,), (1,), torch.int64))
    st = [x.untyped_storage(), k.untyped_storage(), None, None, None, None]
    with torch.device("meta"):
        args = FxGroup(None, ext, (), outs).args(st, [])
    assert [(a.device.type, a.dtype, a.shape, a.stride()) for a in args] == [
        ("cpu", torch.float32, (4,), (1,)), ("cpu", torch.int64, (3,), (1,))]
    assert args[0].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    y = torch.full((4,), 7.0)
    FxGroup(None, ext, (), outs).store([args[0], y, y.view(2, 2), args[1][:2]], st, args)
    ptrs = [s.data_ptr() for s in st]
    assert len(set(ptrs)) == 6 and ptrs[3] == y.untyped_storage().data_ptr()
    for s, expected in zip(st[2:], (x[:4], y, y, k[:2])):
        got = torch.empty(0, dtype=expected.dtype).set_(s, 0, expected.shape, (1,))
        assert torch.equal(got, expected)
    before = list(st)
    FxGroup(None, ext, (), ()).store([], st, args)
    assert st == before


def test_inductor_in_place_updates_of_inputs_and_strided_views():
    """An optimizer-like update of a buffer from outside the group (written back into its
    storage), reading transposed and sliced views of inputs."""
    torch.manual_seed(0)
    p, g, w = torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 16)

    def step(p, g, w):
        p.mul_(0.9).add_(g * w.t(), alpha=-0.1)  # in place on an input, a transposed view
        return (p[2:, 1:] * 2).sum(0) + w[1:, 2:].t().sum(1)[1:2]  # slices, offsets

    expected = step(p.clone(), g, w)
    pn, gn, wn = p.to("neuron"), g.to("neuron"), w.to("neuron")
    with ae.override(executor="inductor"), ae.adaptive():
        ae.reset_metrics()
        out = step(pn, gn, wn).cpu()
        assert any(ae.explain().compiled)
        assert ae.metrics().compiled_launches >= 1
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(pn.cpu(), p.mul(0.9).add(g * w.t(), alpha=-0.1), **TOL)


def test_repeated_in_place_updates_of_persistent_inputs_over_many_launches():
    """An optimizer loop: the same compiled group launched again and again on the same
    parameter's storage reads and writes its current values every time."""
    torch.manual_seed(0)
    p, g = torch.randn(16, 8), torch.randn(16, 8)
    pn, gn = p.to("neuron"), g.to("neuron")
    with ae.override(executor="inductor"), ae.adaptive():
        ae.reset_metrics()
        for _ in range(5):
            pn.mul_(0.9).add_(gn * gn, alpha=-0.1)
            ae.synchronize()
            p.mul_(0.9).add_(g * g, alpha=-0.1)
        assert ae.metrics().compiled_launches == 5
        torch.testing.assert_close(pn.cpu(), p, **TOL)


def test_inductor_views_of_buffers_made_in_the_group():
    """Views (and writes through them) of a buffer an op made inside the group. Inductor
    lays out a cat of one transposed input transposed, ATen contiguous, and as_strided
    reads whatever storage it is given: `k @ k.T` came out wrong (transformers' KV cache
    does this cat on its first update). Note [Views of buffers made in the group]."""
    torch.manual_seed(0)
    x = torch.randn(3, 2)

    def f(x):
        k = torch.cat([torch.tensor([], device=x.device), x.transpose(0, 1)])
        a = k @ k.T
        y = x * 2  # contiguous, then written through a transposed view and a slice
        y.t()[0].mul_(3)
        y[1:].add_(1)
        b = y + y.t().sum()  # the made view, read after the writes
        return a, b, torch.stack([x.t()]).squeeze(0) * 1

    expected = f(x)
    with ae.override(executor="inductor"), ae.adaptive():
        ae.reset_metrics()
        outs = [t.cpu() for t in f(x.to("neuron"))]
        assert ae.metrics().compiled_launches >= 1
    for out, exp in zip(outs, expected):
        torch.testing.assert_close(out, exp, **TOL)


def test_inductor_compiles_groups_with_host_scalar_tensors():
    """0-d CPU tensors in a group (`torch.tensor(1.5, device=...)` uploads, `x * cpu_t`):
    their graph inputs were made with the template's dtype name, an internal TypeError
    reported as a compile failure on every `generate`."""
    x = torch.randn(4)
    with ae.override(executor="inductor"), ae.adaptive():
        ae.reset_metrics()
        c = torch.tensor(1.5, device="neuron")
        out = (x.to("neuron") * c * torch.tensor(2.0)).cpu()
        m = ae.metrics()
    torch.testing.assert_close(out, x * 3.0, **TOL)
    assert m.compile_failures == {} and m.compiled_launches >= 1


def test_foreach_writes_over_aliased_arguments_run_interpreted():
    """Functionalization computes an op's writes from the values before it; eager foreach
    goes tensor by tensor. `_foreach_mul_([x, x], s)` scaled x once under Inductor (fuzzer
    seed 18000295); `_foreach_add_([a, b], [b, a])` added the old a to b."""
    x0, a0, b0 = torch.randn(3), torch.randn(3), torch.randn(3)
    x, a, b = x0.clone(), a0.clone(), b0.clone()
    torch._foreach_mul_([x, x], 0.5)
    torch._foreach_add_([a, b], [b, a])
    with ae.override(executor="inductor"), ae.adaptive():
        ae.reset_metrics()
        xn, an, bn = x0.to("neuron"), a0.to("neuron"), b0.to("neuron")
        torch._foreach_mul_([xn, xn], 0.5)
        torch._foreach_add_([an, bn], [bn, an])
        outs = [t.cpu() for t in (xn, an, bn)]
        m = ae.metrics()
    for out, exp in zip(outs, (x, a, b)):
        torch.testing.assert_close(out, exp, **TOL)
    assert set(m.compile_failures) <= {"an op writes one buffer through two arguments",
                                       "a foreach op writes a buffer another of its "
                                       "arguments reads"}


def test_out_of_another_dtype_runs_interpreted():
    """`torch.sum(float_t, 0, out=int_t)`: Inductor's functional form gave other integers
    than eager's kernel (fuzzer seed 21000083)."""
    x = torch.randn(2, 3, 4) * 3
    out = torch.empty(3, 4, dtype=torch.int64)
    torch.sum(x * 1, 0, out=out)
    with ae.override(executor="inductor"), ae.adaptive():
        ae.reset_metrics()
        on = torch.empty(3, 4, dtype=torch.int64, device="neuron")
        torch.sum(x.to("neuron") * 1, 0, out=on)
        got = (on + 0).cpu()
        m = ae.metrics()
    assert torch.equal(got, out)
    assert "out= of another dtype than its inputs" in m.compile_failures


def test_inductor_gradient_through_an_expanded_scalar_of_the_group():
    """mean's backward expands a 0-d value made in the group; its storage node was an
    as_strided_scatter of the 0-d value, which Inductor turned into zeros here: the gradient
    came out 0 (fuzzer seed 23001022)."""
    def run(executor):
        torch.manual_seed(0)
        with ae.override(executor=executor), ae.adaptive(strategy="matmul"):
            v2 = torch.randn((1, 2, 2), device="neuron")
            v4 = v2.detach().requires_grad_()
            torch.neuron.synchronize()
            y = F.batch_norm(v2, None, None, training=True)  # kept: part of the group's output
            v4.pow(1).mean().backward()
            return v4.grad.cpu() + 0 * y.sum().cpu()
    torch.testing.assert_close(run("inductor"), run("interpreter"), **TOL)
    assert torch.equal(run("interpreter"), torch.full((1, 2, 2), 0.25))


_Y = torch.tensor([[3, 0, -1, 1, 0], [1, 2, 4, -1, 0], [0, 1, 2, 3, 4], [-1, 0, 0, 0, 0]])
_T = torch.tensor([0, 2, 1, 4])
_NAN = torch.tensor([[float("nan"), 0.1, 0.2, -0.1, 0.05], [0.3, float("inf"), 0.0, 0.2, 0.1],
                     [0.5, -0.2, 0.9, 0.0, 0.4], [0.1, 0.1, 0.2, 0.3, -0.4]])
_WRONGLY_DECOMPOSED = {  # name -> (function of x, input); x is the neuron input
    "multilabel -1 mean": (lambda x: F.multilabel_margin_loss(x * 1, _Y.to(x.device)), None),
    "multilabel -1 sum": (lambda x: F.multilabel_margin_loss(
        x * 1, _Y.to(x.device), reduction="sum"), None),
    "multilabel -1 none": (lambda x: F.multilabel_margin_loss(
        x * 1, _Y.to(x.device), reduction="none"), None),
    "multilabel -1 unbatched none": (lambda x: F.multilabel_margin_loss(
        x[1] * 1, _Y[1].to(x.device), reduction="none"), None),
    "multi_margin inf": (lambda x: F.multi_margin_loss(x * 1, _T.to(x.device)), _NAN),
    "multi_margin p=2 weight": (lambda x: F.multi_margin_loss(
        x * 1, _T.to(x.device), p=2, margin=0.5,
        weight=torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0]).to(x.device)), _NAN),
    "multi_margin unbatched none": (lambda x: F.multi_margin_loss(
        x[2] * 1, _T[1].to(x.device), reduction="none"), None),
    "softshrink nan": (lambda x: F.softshrink(x * 1, 0.3), _NAN.clamp(max=2.0)),  # (NaN kept)
}


@pytest.mark.parametrize("name", list(_WRONGLY_DECOMPOSED))
def test_ops_pytorch_decomposes_wrongly_compile_to_cpus_values(name):
    """Note [Wrong decompositions in graphs] in fusion/decomps.py: Inductor traced
    multilabel_margin_loss with PyTorch's decomposition, which counts targets after a -1 (it
    stayed a CPU fallback for that); multi_margin_loss summed a NaN term (NaN for CPU's
    1.02), its unreduced loss of one sample raised in backward; softshrink gave 0 at NaN.
    The groups' graphs call the corrected decompositions: device ops, compiled, CPU's values
    and gradients, forward and backward (multilabel_margin_loss_backward, with no meta
    kernel, runs at once: LIMITS)."""
    fn, inp = _WRONGLY_DECOMPOSED[name]
    if inp is None:
        inp = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    xc = inp.clone().requires_grad_()
    want = fn(xc)
    want.sum().backward()
    xn = inp.to("neuron").requires_grad_()
    with ae.override(executor="inductor"), ae.adaptive():
        ae.reset_metrics()
        out = fn(xn)
        got = out.detach().cpu()
        forward = ae.explain().groups
        out.sum().backward()
        grad = xn.grad.cpu()
        m = ae.metrics()
    assert got.shape == want.shape
    torch.testing.assert_close(got, want.detach(), equal_nan=True, **TOL)
    torch.testing.assert_close(grad, xc.grad, equal_nan=True, **TOL)
    assert m.cpu_fallbacks == {} and m.compile_failures == {}
    op = name.split()[0]  # its group ran Inductor's code
    assert [g["compiled"] for g in forward if op in g["name"]] == [True], forward


def test_out_forms_of_wrongly_decomposed_ops_run_interpreted():
    """Functionalization hands `multi_margin_loss.out` to Inductor's decomposition table,
    whose multi_margin_loss summed a NaN term (NaN for CPU's 1.02): such a group runs
    interpreted, counted."""
    mml = torch.ops.aten.multi_margin_loss.out
    want = torch.empty(())
    mml(_NAN * 1, _T, 1, 1, None, 1, out=want)
    with ae.override(executor="inductor"), ae.adaptive():
        ae.reset_metrics()
        on = torch.empty((), device="neuron")
        mml(_NAN.to("neuron") * 1, _T.to("neuron"), 1, 1, None, 1, out=on)
        got = (on + 0).cpu()
        m = ae.metrics()
    assert torch.equal(got, want)  # interpreted: bit for bit
    assert m.compile_failures == {
        "aten::multi_margin_loss.out (PyTorch decomposes it wrongly)": 1}


def test_the_inductor_executor_leaves_cpus_decompositions_alone():
    """Note [Wrong decompositions in graphs]: the groups' graphs call the corrected functions;
    CPU's autograd key and Inductor's decomposition table keep PyTorch's (a fresh
    interpreter: the fuzzer's tests install ours for CPU in this one)."""
    code = (
        "import torch, torch.nn.functional as F, adaptive_eager as ae\n"
        "from torch._C import DispatchKey as K\n"
        "from torch._inductor.decomposition import select_decomp_table\n"
        "from torch._decomp import decompositions as d\n"
        "op = torch.ops.aten.multilabel_margin_loss_forward.default\n"
        "x, y = torch.randn(2, 3), torch.tensor([[2, -1, 0], [1, 0, 2]])\n"
        "with ae.override(executor='inductor'), ae.adaptive():\n"
        "    got = F.multilabel_margin_loss(x.to('neuron') * 1, y.to('neuron')).cpu()\n"
        "    m = ae.metrics()\n"
        "print(m.compiled_launches >= 1, torch.allclose(got, F.multilabel_margin_loss(x, y)),\n"
        "      K.AutogradCPU in op.py_kernels,\n"
        "      op.py_kernels[K.Autograd] is d.multilabel_margin_loss_forward,\n"
        "      select_decomp_table()[op].__module__ == d.__name__)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.stdout.split() == ["True", "True", "False", "True", "True"], out.stderr[-2000:]


def test_random_ops_stay_interpreted_so_dropout_masks_equal_eager():
    x, _ = _inputs()

    def f(x):
        torch.manual_seed(3)
        return F.dropout(x * 2, 0.5) + 1

    eager = f(x.to("neuron")).cpu()
    with ae.override(executor="inductor"), ae.adaptive():
        ae.reset_metrics()
        lazy = f(x.to("neuron")).cpu()
        m = ae.metrics()
    assert torch.equal(lazy, eager)
    assert m.compiled_launches == 0
    assert m.compile_failures.get("random op") == 1


def test_an_inductor_failure_runs_interpreted_counted_with_its_reason(monkeypatch):
    def boom(gm, example_inputs):
        raise RuntimeError("no lowering for this group")
    monkeypatch.setattr(torch._inductor, "compile", boom)
    x, b = _inputs(n=48)  # shapes no other test compiles
    with ae.override(executor="inductor"), ae.adaptive():
        ae.reset_metrics()
        y = chain(x.to("neuron"), b.to("neuron")).cpu()
        y2 = chain(x.to("neuron"), b.to("neuron")).cpu()
        m = ae.metrics()
    assert torch.equal(y, chain(x, b)) and torch.equal(y2, y)  # interpreted: bit for bit
    assert m.compile_failures == {
        "inductor: RuntimeError: no lowering for this group": 1}
    assert m.compiled_launches == 0 and m.compiled_groups == 0


def test_baked_runtime_scalars_that_keep_changing_stay_interpreted(monkeypatch):
    """Scalars of an op on integer tensors are baked in (Note [Scalars as graph inputs]):
    a group compiled for MAX_VARIANTS sets of them and launched with another is left to the
    interpreter."""
    monkeypatch.setattr(tiered, "MAX_VARIANTS", 1)
    x, b = (torch.randint(-50, 50, (40, 32)), torch.randint(-50, 50, (32,)))
    xn, bn = x.to("neuron"), b.to("neuron")
    with ae.override(executor="inductor"), ae.adaptive():
        ae.reset_metrics()
        outs = [((xn + bn) * s).cpu() for s in (3, 3, 5, 7)]
        m = ae.metrics()
    for s, o in zip((3, 3, 5, 7), outs):
        assert torch.equal(o, (x + b) * s)
    assert m.compiled_launches == 2  # the two launches with the scalars it was compiled for
    assert m.compile_failures == {"runtime scalars change between launches": 1}


def test_float32_runtime_scalars_are_graph_inputs_compiled_once(monkeypatch):
    """Note [Scalars as graph inputs]: float32 ops take their scalars as one graph input, so
    new values at every launch run the one compiled graph, with CPU's values: through the
    Tensor slot (`x * s`), a Tensor overload (`lerp`, `clamp`, `pow`), addcmul/addcdiv's
    formulas, foreach ops per element (Scalar and Scalar[]), an int scalar, an out-of-place
    foreach op's list of results."""
    monkeypatch.setattr(tiered, "MAX_VARIANTS", 1)
    g = torch.Generator().manual_seed(5)
    x, y, z = (torch.rand(24, 16, generator=g) + 0.5 for _ in range(3))

    def f(x, y, z, s, t, n):
        a = (x * s).lerp(y, t).clamp(min=s)
        b = torch.addcmul(a, y, z, value=s).addcdiv(y, z, value=t)
        xs = [b.clone(), (y + 0).clone()]
        torch._foreach_add_(xs, [s, t])
        torch._foreach_mul_(xs, n)
        outs = torch._foreach_addcdiv(xs, [y, z], [z, y], [t, s])
        torch._foreach_lerp_(outs, [z, x], s)
        return outs
    values = [(0.5, 0.25, 2), (0.75, 0.125, 3), (1.5, 0.5, -1)]
    expected = [f(x, y, z, *v) for v in values]
    xn, yn, zn = x.to("neuron"), y.to("neuron"), z.to("neuron")
    with ae.override(executor="inductor"), ae.adaptive():
        ae.reset_metrics()
        got = []
        for v in values:
            got.append([t.cpu() for t in f(xn, yn, zn, *v)])
            assert ae.explain().compiled == [True]
        m = ae.metrics()
    for outs, exp in zip(got, expected):
        for o, e in zip(outs, exp):
            torch.testing.assert_close(o, e, **TOL)
    assert m.compile_failures == {} and m.compiled_launches == 3 and m.compiled_groups == 1


def test_out_variants_with_runtime_scalars_write_their_out_under_inductor():
    """`addcmul(..., value=s, out=o)` keeps its scalar baked (the addcmul formula would not
    write `out`), `mul(x, s, out=o)` takes it as a graph input: both write `out` as CPU."""
    x, y = torch.rand(8, 6) + 0.5, torch.rand(8, 6) + 0.5

    def f(x, y, s, o1, o2):
        torch.addcmul(x * 1, x, y, value=s, out=o1)
        torch.mul(x + 0, s, out=o2)
        return o1 + 0, o2 + 0
    with ae.override(executor="inductor"), ae.adaptive():
        xn, yn = x.to("neuron"), y.to("neuron")
        for s in (0.5, 0.25):
            got = [t.cpu() for t in f(xn, yn, s, torch.empty(8, 6, device="neuron"),
                                      torch.empty(8, 6, device="neuron"))]
            for o, r in zip(got, f(x, y, s, torch.empty(8, 6), torch.empty(8, 6))):
                torch.testing.assert_close(o, r, **TOL)
        assert ae.metrics().compiled_launches >= 1


def test_graph_input_scalars_at_the_edges_of_float32_match_cpu():
    """Note [Scalars as graph inputs]: -0.0, inf, nan, values that round to 0 in float32 give
    CPU's values; a finite value beyond float32's range runs that launch interpreted, so
    lerp raises eager's overflow error at the sync and the engine keeps working."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, generator=g)
    x[:4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])
    y = torch.randn(64, generator=g) + 3

    def f(x, y, s):
        a = x * s + 1
        return [a, torch.lerp(a, y, s), torch.addcdiv(a, x, y, value=s)]
    with ae.override(executor="inductor"), ae.adaptive():
        xn, yn = x.to("neuron"), y.to("neuron")
        for s in (0.5, -0.0, float("inf"), float("-inf"), float("nan"), 1e-50, 2 ** 60):
            for o, r in zip([t.cpu() for t in f(xn, yn, s)], f(x, y, s)):
                torch.testing.assert_close(o, r, equal_nan=True, **TOL)
                assert torch.equal(o.signbit(), r.signbit()), s
        assert ae.metrics().compile_failures == {}
        with pytest.raises(RuntimeError, match="cannot be converted to type float without "
                                               "overflow"):
            f(x, y, 1e300)
        with pytest.raises(RuntimeError, match="cannot be converted to type float without "
                                               "overflow"):
            [t.cpu() for t in f(xn, yn, 1e300)]
        torch.testing.assert_close(f(xn, yn, 0.25)[1].cpu(), f(x, y, 0.25)[1], equal_nan=True,
                                   **TOL)


def test_adamw_over_steps_cpu_eager_and_adaptive_with_each_executor():
    """AdamW (foreach) whose bias corrections change every step: the interpreter gives CPU's
    values bit for bit, eager too; Inductor and tiered compile the optimizer's group once
    (its per-step scalars are graph inputs) and match CPU within float32 tolerance."""
    def train(device, steps=4):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 4)).to(device)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
        x = torch.randn(8, 16).to(device)
        for _ in range(steps):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if device == "neuron":
                torch.neuron.synchronize()
        state = [v for s in opt.state.values() for v in (s["exp_avg"], s["exp_avg_sq"])]
        return [t.detach().cpu() for t in list(m.parameters()) + state]
    cpu = train("cpu")
    assert all(torch.equal(a, b) for a, b in zip(train("neuron"), cpu))  # eager
    with ae.override(executor="interpreter"), ae.adaptive():
        assert all(torch.equal(a, b) for a, b in zip(train("neuron"), cpu))
    for executor in ("inductor", "auto"):
        with ae.override(executor=executor, tier_up=1), ae.adaptive():
            ae.reset_metrics()
            got = train("neuron")
            ae.wait_for_compiles()
            m = ae.metrics()
        for a, b in zip(got, cpu):
            torch.testing.assert_close(a, b, **TOL)
        assert m.compile_failures == {}, executor
        if executor == "inductor":
            assert m.interpreted_launches == 0 and m.compiled_launches >= 4


def test_auto_interprets_until_tier_up_then_swaps_compiled_code_in():
    x, b = _inputs()
    xn, bn = x.to("neuron"), b.to("neuron")
    with ae.override(executor="auto", tier_up=2), ae.adaptive():
        ae.reset_metrics()
        first = [chain(xn, bn).cpu() for _ in range(2)]  # launches 1, 2: interpreted
        assert ae.metrics().compiled_launches == 0
        assert ae.metrics().tier_ups == 1  # the second launch sent it to the compiler
        ae.wait_for_compiles()
        after = chain(xn, bn).cpu()
        assert ae.explain().compiled == [True]
        m = ae.metrics()
    assert all(torch.equal(f, chain(x, b)) for f in first)  # interpreted: bit for bit
    torch.testing.assert_close(after, chain(x, b), **TOL)
    assert m.compiled_launches == 1 and m.interpreted_launches == 2


def test_a_second_process_with_a_warm_cache_compiles_nothing(tmp_path):
    """Inductor's caches live under TORCH_NEURONX_NEFF_CACHE_DIR: a new process finds the
    group's compiled code there (FX graph cache hit), so Inductor generates nothing.

    Both processes are fresh children with their own cache folder. Inductor's FX graph key
    holds process-wide state (torch.get_num_threads(), the default dtype, the fp32_precision
    settings, deterministic flags, Inductor's config): when this test process filled the
    cache, a setting an earlier test had left changed gave the entry a key a fresh process
    never computes, and the test failed in full-suite runs only (test_cpu_settings.py left
    torch.backends.cuda.matmul.fp32_precision "ieee" where a fresh process has "none";
    torch.set_num_threads(1) in the writer does the same)."""
    script = tmp_path / "warm.py"
    script.write_text(
        "import json, torch, torch.nn.functional as F\n"
        "import adaptive_eager as ae\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x, b = torch.randn(64, 32, generator=g), torch.randn(32, generator=g)\n"
        "with ae.override(executor='inductor'), ae.adaptive():\n"
        "    xn, bn = x.to('neuron'), b.to('neuron')\n"
        "    y = (F.gelu(xn + bn) * 0.5 + xn).cpu()\n"
        "    m = ae.metrics()\n"
        "print(json.dumps({'groups': m.compiled_groups, 'hits': m.inductor_cache_hits,\n"
        "                  'launches': m.compiled_launches,\n"
        "                  'threads': torch.get_num_threads()}))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path),
               TORCH_NEURONX_NEFF_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # under the cache folder above (tiered.py)

    def child():
        out = subprocess.run([sys.executable, str(script)], env=env, check=True,
                             capture_output=True, text=True).stdout.splitlines()[-1]
        return json.loads(out)

    cold, warm = child(), child()
    assert cold == {"groups": 1, "hits": 0, "launches": 1, "threads": cold["threads"]}, cold
    assert warm == {"groups": 1, "hits": 1, "launches": 1, "threads": cold["threads"]}, warm


def test_metrics_report_shows_the_executor_rows():
    text = ae.metrics_report()
    for row in ("launches compiled / interpreted", "Inductor compile time (wall)",
                "tier-ups", "groups not compiled"):
        assert row in text


def test_benchmark_smoke_tiny_sizes():
    """benchmarks/executors.py at a tiny size: every mode runs and the figures are there."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    import executors
    res = executors.run("mlp_train", executors.TINY["mlp_train"],
                        ["cpu", "interpreter", "inductor", "ltc"], rounds=1, per_round=1,
                        first_n=2)
    assert set(res["steady"]) == {"cpu", "interpreter", "inductor", "ltc"}
    assert res["first"]["inductor"]["compiled_launches"] > 0
    assert any(r["compiled"] for r in res["calibration"])
    assert "| mlp_train | inductor |" in executors.table([res])
    # where the step's time goes: compiled launches timed apart from the rest
    b = res["breakdown"]["inductor"]
    assert b["compiled launches"] > 0 and b["compiled"] > 0 and b["host"] > 0
    # of the host time, the per-op dispatch path: part of it, over every op of the step
    assert 0 < b["dispatch"] < b["host"] and b["ops dispatched"] > 10
    # of the compiled time, Inductor's extern GEMM calls (the step's 4 + 8 matmuls), timed
    assert b["gemm calls"] == 12 and 0 < b["gemm"] < b["compiled"]
    assert res["breakdown"]["interpreter"].get("compiled launches", 0) == 0
    assert res["breakdown"]["interpreter"]["gemm"] == 0  # (the interpreter runs ATen's mm)
    assert "| mlp_train | inductor |" in executors.breakdown_table([res])
    # PyTorch's lazy tensors ran the step as graphs (at least one per step)
    assert res["first"]["ltc"]["ltc_graphs_per_step"] >= 1
    # AdamW's step alone (--optimizer)
    opt = executors.optimizer_step(["cpu", "interpreter"], d=32, tokens=16, steps=3, warm=1)
    assert set(opt) == {"cpu", "interpreter"} and all(t > 0 for t in opt.values())
