"""Custom kernels (Note [Custom kernels] in fusion/kernels.py): a user's custom op with a
neuron kernel runs on the device in eager, adaptive and compile modes, under autograd and
opcheck, with its own launch and cost; the library kernels (adaptive_eager.kernels) match the
ATen ops they replace."""
import warnings

import pytest
import torch

import adaptive_eager as ae
from tests.harness.custom_ops import axpy_

CALLS = []  # the kernel body's arguments' devices, per call


@torch.library.custom_op("aetest::scale_add", mutates_args=())
def scale_add(x: torch.Tensor, y: torch.Tensor, a: float) -> torch.Tensor:
    return x * a + y


@scale_add.register_kernel("neuron")
def _scale_add_neuron(x, y, a):
    CALLS.append(x.device.type)
    if a < 0:
        raise ValueError("scale_add: a must be >= 0")  # the kernel's own check
    return x * a + y


@scale_add.register_fake
def _(x, y, a):
    torch._check(x.shape == y.shape, lambda: "scale_add: x and y must have one shape")
    return torch.empty_like(x)


def _backward(ctx, g):
    return g * ctx.a, g, None


def _setup(ctx, inputs, output):
    ctx.a = inputs[2]


scale_add.register_autograd(_backward, setup_context=_setup)


@ae.register_cost(scale_add)
def _(x, y, a):
    return ae.Cost(flops=2 * x.numel(), bytes_read=2 * x.numel() * 4,
                   bytes_written=x.numel() * 4, overhead_us=3.0)


# The old-style API: torch.library.define + impl for PrivateUse1, no declared cost.
_lib = torch.library.Library("aetest", "FRAGMENT")
_lib.define("twice(Tensor x) -> Tensor")
torch.library.impl(_lib, "twice", "PrivateUse1")(lambda x: x * 2)
torch.library.impl(_lib, "twice", "CPU")(lambda x: x * 2)
torch.library.register_fake("aetest::twice", lambda x: torch.empty_like(x), lib=_lib)


def _xy(n=64):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, generator=g), torch.randn(n, generator=g)


@pytest.fixture(params=["eager", "adaptive"])
def kmode(request):
    if request.param == "eager":
        yield "eager"
        return
    with ae.adaptive(), ae.override(queue_low_threshold=0):
        yield "adaptive"


def test_kernel_runs_on_device_not_cpu_fallback(kmode):
    x, y = _xy()
    CALLS.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a CPU fallback warns
        out = scale_add(x.to("neuron"), y.to("neuron"), 2.0)
        got = out.cpu()
    torch.testing.assert_close(got, x * 2.0 + y, rtol=0, atol=0)
    assert CALLS == ["cpu"]  # the neuron body, over host memory of the device buffers
    m = ae.metrics()
    assert m.cpu_fallbacks == {}
    assert m.kernel_launches == 1 and m.kernels == {"aetest::scale_add": 1}


def test_eager_is_one_launch_with_declared_cost():
    x, y = _xy(1024)
    xn, yn = x.to("neuron"), y.to("neuron")
    ae.reset_metrics()
    scale_add(xn, yn, 2.0)
    ae.synchronize()
    m = ae.metrics()
    assert m.launches == 1 and m.kernel_launches == 1
    spec = ae.DeviceSpec()
    want = spec.launch_us(3 * 1024 * 4, 2 * 1024) + 3.0  # the declared bytes, flops, overhead
    assert m.kernel_time_us == pytest.approx(want)
    assert m.device_time_us == pytest.approx(want)
    assert m.kernel_hbm_bytes == m.hbm_bytes == 3 * 1024 * 4


def test_undeclared_cost_is_a_roofline():
    x = torch.randn(256)
    xn = x.to("neuron")
    ae.reset_metrics()
    out = torch.ops.aetest.twice(xn)
    torch.testing.assert_close(out.cpu(), x * 2)
    m = ae.metrics()
    assert m.kernels == {"aetest::twice": 1}
    assert m.kernel_hbm_bytes == 2 * 256 * 4  # input read once, output written once


def test_adaptive_kernel_is_a_boundary_and_neighbours_fuse():
    x, y = _xy()
    xn, yn = x.to("neuron"), y.to("neuron")
    with ae.adaptive(), ae.override(queue_low_threshold=0):
        ae.reset_metrics()
        a = (xn + 1).relu()
        b = scale_add(a, yn, 2.0)
        c = (b * 3).sin().exp()
        got = c.cpu()
        e = ae.explain()
    torch.testing.assert_close(got, ((((x + 1).relu()) * 2 + y) * 3).sin().exp())
    names = [g["name"] for g in e.groups]
    assert names == ["add.Tensor|relu", "aetest::scale_add", "mul.Tensor|sin|exp"], names
    assert e.boundaries == ["custom kernel aetest::scale_add (a launch of its own)",
                            "after custom kernel aetest::scale_add"]
    assert "[custom kernel]" in str(e)
    m = ae.metrics()
    assert m.launches == 3 and m.kernel_launches == 1


def test_shape_error_from_fake_impl_at_the_call(kmode):
    with pytest.raises(RuntimeError, match="x and y must have one shape"):
        scale_add(torch.ones(3, device="neuron"), torch.ones(4, device="neuron"), 1.0)
    # the engine stays usable
    torch.testing.assert_close(scale_add(torch.ones(3, device="neuron"),
                                         torch.ones(3, device="neuron"), 1.0).cpu(),
                               torch.full((3,), 2.0))


def test_kernel_error_is_deferred_naming_kernel_and_lines(kmode):
    xn = torch.ones(3, device="neuron")
    out = scale_add(xn, xn, -1.0)  # the kernel raises when it runs
    with pytest.raises(ae.NeuronRuntimeError) as info:
        out.cpu()
    msg = str(info.value)
    assert "operation=aetest::scale_add" in msg
    assert "a must be >= 0" in msg
    assert "test_kernels.py" in msg  # the user's call line
    line = _scale_add_neuron.__code__.co_firstlineno + 4  # its `raise` (from the decorator)
    assert f"raised in kernel aetest::scale_add at {__file__}:{line}" in msg
    torch.testing.assert_close(scale_add(xn, xn, 1.0).cpu(), torch.full((3,), 2.0))


def test_kernel_result_unlike_fake_impl_is_named():
    @torch.library.custom_op("aetest::liar", mutates_args=())
    def liar(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @liar.register_kernel("neuron")
    def _(x):
        return x[:1].clone()

    @liar.register_fake
    def _(x):
        return torch.empty_like(x)

    out = liar(torch.ones(4, device="neuron"))
    with pytest.raises(ae.NeuronRuntimeError, match="fake impl said shape \\[4\\]"):
        out.cpu()


def test_float64_inputs_run_as_float32_like_any_op(kmode):
    """Note [float64 policy]: a kernel's float64 inputs reach its body as float32 twins, so
    its float64 result comes back float32; the check against the fake impl refused it ("the
    neuron kernel and the fake impl must agree"), every float64 call failed (fuzzer seed
    20800000)."""
    x, y = (t.double() for t in _xy(8))
    out = scale_add(x.to("neuron"), y.to("neuron"), 2.0)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out.cpu(), x * 2 + y, rtol=1e-6, atol=1e-6)


def test_autograd_matches_cpu(kmode):
    x, y = _xy()
    xc, yc = x.clone().requires_grad_(), y.clone().requires_grad_()
    (scale_add(xc, yc, 3.0).sin().sum()).backward()
    xn, yn = x.to("neuron").requires_grad_(), y.to("neuron").requires_grad_()
    ae.reset_metrics()
    (scale_add(xn, yn, 3.0).sin().sum()).backward()
    torch.testing.assert_close(xn.grad.cpu(), xc.grad)
    torch.testing.assert_close(yn.grad.cpu(), yc.grad)
    m = ae.metrics()  # the forward on the device (the backward is ATen ops: g * a, g)
    assert m.kernels == {"aetest::scale_add": 1} and m.cpu_fallbacks == {}


def test_compile_sees_the_custom_op():
    import torch._dynamo
    torch._dynamo.reset()
    x, y = _xy()

    def f(a, b):
        return scale_add(a.relu(), b, 2.0).cos()

    xn, yn = x.to("neuron"), y.to("neuron")
    cf = torch.compile(f, backend="neuron", fullgraph=True)
    ae.reset_metrics()
    got = cf(xn, yn).cpu()
    torch.testing.assert_close(got, f(x, y))
    assert ae.metrics().kernels == {"aetest::scale_add": 1}
    torch._dynamo.reset()


# Two of opcheck's checks cannot take neuron tensors: the autograd-registration check refuses
# devices other than CPU/CUDA/XPU ("NYI", torch/testing/_internal/optests/
# autograd_registration.py), and the fake-tensor check reads `_typed_storage()`, which a
# neuron tensor refuses (its bytes are device memory). They run on CPU's tensors (the op's
# default kernel against its fake impl); the engine itself checks the neuron kernel's results
# against the fake impl (test_kernel_result_unlike_fake_impl_is_named).
_ON_DEVICE = ("test_schema", "test_aot_dispatch_dynamic")
_ON_CPU = ("test_autograd_registration", "test_faketensor")


def test_opcheck():
    x, y = _xy(8)
    xn, yn = x.to("neuron").requires_grad_(), y.to("neuron")
    torch.library.opcheck(scale_add, (xn, yn, 2.0), test_utils=_ON_DEVICE)
    torch.library.opcheck(scale_add, (x.requires_grad_(), y, 2.0), test_utils=_ON_CPU)
    torch.library.opcheck(torch.ops.aetest.twice.default, (x.detach().to("neuron"),),
                          test_utils=_ON_DEVICE)


def test_profiler_and_trace_name_kernels():
    x, y = _xy()
    xn, yn = x.to("neuron"), y.to("neuron")
    with torch.profiler.profile() as prof:
        scale_add(xn, yn, 2.0).cpu()
    names = {e.name for e in prof.events()}
    assert "neuron::kernel:aetest::scale_add" in names
    from adaptive_eager.engine import engine
    trace = engine.ENGINE.device.chrome_trace()
    assert any(e.get("cat") == "kernel" and e["name"] == "aetest::scale_add"
               for e in trace["traceEvents"])


def test_sbuf_over_capacity_is_refused_at_the_call():
    @torch.library.custom_op("aetest::greedy", mutates_args=())
    def greedy(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    greedy.register_kernel("neuron")(lambda x: x.clone())
    greedy.register_fake(lambda x: torch.empty_like(x))
    ae.register_cost(greedy, lambda x: ae.Cost(sbuf_bytes=1 << 40))
    with pytest.raises(RuntimeError, match="SBUF"):
        greedy(torch.ones(2, device="neuron"))


def test_mutating_kernel_in_a_loop_matches_cpu(kmode):
    """An in-place kernel (mutates_args) updates the device buffer; repeated steps (plans
    and traces reused in adaptive mode) stay right."""
    x, y = _xy()
    yc = y.clone()
    xn, yn = x.to("neuron"), y.to("neuron")
    for i in range(6):
        axpy_(0.5, x, yc)
        yc.mul_(0.9)
        axpy_(0.5, xn, yn)
        yn.mul_(0.9)
    torch.testing.assert_close(yn.cpu(), yc)
    assert ae.metrics().kernels == {"aetest::axpy_": 6}


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_compile_of_a_mutating_kernel_matches_cpu(mode):
    """A custom op writing an argument is auto_functionalized in a compiled graph; that
    higher-order operator had no rule for the neuron tensor ("There was no rule registered
    for HOP auto_functionalized_v2"), so any compiled function calling one failed (fuzzer
    seed 21000001). Its dense rule runs it as on the CPU: a clone, the kernel, a copy back."""
    import contextlib
    import torch._dynamo
    torch._dynamo.reset()
    x, y = _xy()

    def f(a, b):
        c = b * 2
        axpy_(0.5, a[1:], c[1:])  # through a view
        return c.sin(), b

    want = f(x, y.clone())
    with ae.adaptive(strategy=mode) if mode != "eager" else contextlib.nullcontext():
        got = torch.compile(f, backend="neuron")(x.to("neuron"), y.to("neuron"))
        for g, w in zip(got, want):
            torch.testing.assert_close(g.cpu(), w)
    torch._dynamo.reset()


# -- the library kernels ----------------------------------------------------------------
import torch.nn.functional as F  # noqa: E402

from adaptive_eager import kernels as K  # noqa: E402


def _attn_inputs(s=160, d=16, b=2, h=2):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(b, h, s, d, generator=g) for _ in range(3)]


def _moe_inputs(t=24, d=16, f=20, e=4):
    g = torch.Generator().manual_seed(2)
    return [torch.randn(t, d, generator=g), torch.randn(t, e, generator=g),
            torch.randn(e, f, d, generator=g) * 0.3, torch.randn(e, f, d, generator=g) * 0.3,
            torch.randn(e, d, f, generator=g) * 0.3]


def _grads_match(fn, ref, cpu_inputs, grad_of, run=None):
    """fn on neuron (through `run`: eager/adaptive call, or a compiled wrapper) vs ref on
    CPU: values and the gradients of the inputs `grad_of` (indices)."""
    cin = [t.clone().requires_grad_(i in grad_of) for i, t in enumerate(cpu_inputs)]
    nin = [t.to("neuron").requires_grad_(i in grad_of) for i, t in enumerate(cpu_inputs)]
    want = ref(*cin)
    got = (run or fn)(*nin)
    torch.testing.assert_close(got.cpu(), want.detach(), rtol=1e-4, atol=1e-5)
    (want * want).sum().backward()
    (got * got).sum().backward()
    for i in grad_of:  # (float32 sums of different orders: tolerance scaled to the grads)
        scale = max(1.0, cin[i].grad.abs().max().item())
        torch.testing.assert_close(nin[i].grad.cpu(), cin[i].grad, rtol=1e-4,
                                   atol=1e-5 * scale)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_matches_sdpa_with_grads(kmode, causal):
    ae.reset_metrics()
    _grads_match(lambda q, k, v: K.flash_attention(q, k, v, causal=causal, scale=0.3),
                 lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                scale=0.3),
                 _attn_inputs(), (0, 1, 2))
    assert ae.metrics().kernels == {"aelib::flash_attention_fwd": 1,
                                    "aelib::flash_attention_bwd": 1}


def test_rms_norm_matches_aten_with_grads(kmode):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(3, 7, 48, generator=g), torch.randn(48, generator=g)
    ae.reset_metrics()
    _grads_match(lambda x, w: K.rms_norm(x, w, 1e-5),
                 lambda x, w: F.rms_norm(x, (48,), w, 1e-5), [x, w], (0, 1))
    assert ae.metrics().kernels == {"aelib::rms_norm_fwd": 1, "aelib::rms_norm_bwd": 1}


def test_moe_mlp_matches_aten_with_grads(kmode):
    ae.reset_metrics()
    _grads_match(lambda *a: K.moe_mlp(*a, top_k=2), lambda *a: K.moe_reference(*a, top_k=2),
                 _moe_inputs(), (0, 1, 2, 3, 4))
    assert ae.metrics().kernels == {"aelib::moe_mlp_fwd": 1, "aelib::moe_mlp_bwd": 1}
    assert ae.metrics().cpu_fallbacks == {}


def test_library_kernels_under_compile():
    import torch._dynamo
    torch._dynamo.reset()

    def block(x, w, q, k, v):
        return K.flash_attention(K.rms_norm(q, w), k, v, causal=True).sum() + x.sum()

    def ref(x, w, q, k, v):
        return F.scaled_dot_product_attention(F.rms_norm(q, (16,), w, 1e-6), k, v,
                                              is_causal=True).sum() + x.sum()

    q, k, v = _attn_inputs()
    g = torch.Generator().manual_seed(5)
    ins = [torch.randn(3, generator=g), torch.randn(16, generator=g), q, k, v]
    ae.reset_metrics()
    _grads_match(block, ref, ins, (1, 2, 3, 4),
                 run=torch.compile(block, backend="neuron", fullgraph=True))
    assert set(ae.metrics().kernels) == {"aelib::flash_attention_fwd",
                                         "aelib::flash_attention_bwd", "aelib::rms_norm_fwd",
                                         "aelib::rms_norm_bwd"}
    torch._dynamo.reset()


def test_library_kernels_bad_shapes_raise_at_the_call():
    q, k, v = (t.to("neuron") for t in _attn_inputs())
    with pytest.raises(RuntimeError, match="do not fit"):
        K.flash_attention(q, k[..., :8], v)
    with pytest.raises(RuntimeError, match="does not fit input"):
        K.rms_norm(q, torch.ones(5, device="neuron"))
    with pytest.raises(RuntimeError, match="top_k=9 with 4 experts"):
        K.moe_mlp(*(t.to("neuron") for t in _moe_inputs()), top_k=9)


def test_library_kernels_opcheck():
    q, k, v = _attn_inputs(s=20, d=8, b=1, h=2)
    x, w = torch.randn(5, 8), torch.randn(8)
    samples = [(K._flash_fwd, (q, k, v, True, 0.5)), (K._rms_fwd, (x, w, 1e-6)),
               (K._moe_fwd, tuple(_moe_inputs(t=6, d=8, f=8, e=3)) + (2,))]
    for op, args in samples:
        dev = tuple(a.to("neuron").requires_grad_(a.is_floating_point())
                    if isinstance(a, torch.Tensor) else a for a in args)
        torch.library.opcheck(op, dev, test_utils=_ON_DEVICE)
        cpu = tuple(a.clone().requires_grad_(a.is_floating_point())
                    if isinstance(a, torch.Tensor) else a for a in args)
        torch.library.opcheck(op, cpu, test_utils=_ON_CPU)


def test_flash_attention_hbm_bytes_are_o_seq_d_and_under_an_eighth_of_the_unfused_ops():
    """Note [Kernel tiling]: modeled HBM bytes, the kernel against the ATen ops it replaces
    (eager: each op reads and writes HBM), at sequence 1024, head dim 64, one head (4096:
    benchmarks/test_kernel_targets.py)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 1, 1024, 64, generator=g).to("neuron") for _ in range(3))
    ae.reset_metrics()
    K.attention_reference(q, k, v, causal=True)
    ae.synchronize()
    unfused = ae.metrics().hbm_bytes
    ae.reset_metrics()
    K.flash_attention(q, k, v, causal=True)
    ae.synchronize()
    flash = ae.metrics().hbm_bytes
    assert flash * 8 <= unfused, (flash, unfused)
    assert flash == 1024 * 64 * 4 * 4 + 1024 * 4  # q, k, v read, out and lse written


def test_demo_kernels(capsys):
    """`python -m adaptive_eager demo --kernels`: the GPT with flash_attention beside the
    plain one, in eager and adaptive mode; losses within tolerance, kernel launches counted."""
    from adaptive_eager.tools import demo
    assert demo.main(["--kernels", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "adaptive graph+kernels" in out and "eager+kernels" in out
    assert "kernels within float32 tolerance" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("eager+kernels")
               and "HBM" not in line and line.count("|") == 3)
    assert row.split("|")[2].strip() == "4"  # 2 layers x (forward, backward) per step


def test_neuron_kernel_registered_after_a_first_call():
    """A custom op called on neuron before its neuron kernel exists falls back to the CPU
    (warned); once registered, the kernel runs on the device."""
    @torch.library.custom_op("aetest::late", mutates_args=())
    def late(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    late.register_fake(lambda x: torch.empty_like(x))
    xn = torch.zeros(3, device="neuron")
    with pytest.warns(UserWarning, match="aetest::late' fell back to CPU"):
        torch.testing.assert_close(late(xn).cpu(), torch.ones(3))
    late.register_kernel("neuron")(lambda x: x + 2)
    ae.reset_metrics()
    torch.testing.assert_close(late(xn).cpu(), torch.full((3,), 2.0))
    assert ae.metrics().kernels == {"aetest::late": 1} and ae.metrics().cpu_fallbacks == {}
