"""Where PyTorch picks a different path for a non-CPU device (or any tensor subclass), neuron
takes CPU's, bit for bit (each failed before its fix)."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

import adaptive_eager as ae  # noqa: F401

N = "neuron"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1.0])
def test_dropout_forward_backward_and_rng_as_cpu(mode, dtype, p):
    """ATen's dropout ran the fused native_dropout on neuron: its backward scales in float,
    CPU's multiplies by mask / (1 - p) in the input's dtype (float16 / bfloat16 gradients an
    ulp off: every HF model with dropout trained in half precision)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1000, generator=g).to(dtype)
    go = torch.randn(1000, generator=g).to(dtype)

    def run(d):
        torch.manual_seed(0)
        xi = x.to(d).detach().requires_grad_()
        y = F.dropout(xi, p=p, training=True)
        y.backward(go.to(d))
        return y.detach().cpu(), xi.grad.cpu(), torch.rand(3, device=d).cpu()
    with _disable_current_modes():
        ref = run("cpu")
    for a, b in zip(run(N), ref):
        assert torch.equal(a, b)


def test_dropout_identity_cases_and_errors_as_cpu():
    x = torch.ones(3, device=N, requires_grad=True)
    assert F.dropout(x, 0.0) is x and F.dropout(x, 0.5, training=False) is x
    with pytest.raises(RuntimeError, match="dropout probability has to be between 0 and 1"):
        torch.dropout(x, 1.5, True)


@pytest.mark.parametrize("make, shape", [
    (lambda: torch.nn.BatchNorm1d(6), (8, 6)), (lambda: torch.nn.BatchNorm2d(6), (4, 6, 3, 3)),
    (lambda: torch.nn.InstanceNorm1d(6, affine=True), (8, 6, 5))])
def test_norm_backward_of_an_input_without_grad(mode, make, shape):
    """A norm on raw data (an input that needs no gradient): batch norm's backward leaves
    grad_input undefined on CPU (output_mask), its meta kernel made one, and the device
    crashed reading the missing result."""
    import copy
    torch.manual_seed(0)
    m, x = make(), torch.randn(shape)

    def grads(d):
        md = copy.deepcopy(m).to(d)
        md(x.to(d)).pow(2).sum().backward()
        return [p.grad.cpu() for p in md.parameters()]
    with _disable_current_modes():
        ref = grads("cpu")
    assert all(torch.equal(a, b) for a, b in zip(grads(N), ref))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_fallback_kernel_sees_one_tensor_passed_twice_as_one(mode):
    """MultiheadAttention's inference fast path (a CPU fallback) fuses the q/k/v projection
    when query, key and value are one tensor; the fallback gave each argument its own host
    view, so CPU's kernel took the separate projections (an ulp off)."""
    torch.manual_seed(0)
    m = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        with _disable_current_modes():
            ref = m(x, x, x, need_weights=False)[0]
        xn = x.to(N)
        out = m.to(N)(xn, xn, xn, need_weights=False)[0]
    assert torch.equal(out.cpu(), ref)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_complex_kernels_that_make_conjugate_views_inside(mode):
    """Inside __torch_dispatch__ the Conjugate key is excluded: CPU kernels that conjugate
    lazily inside (pinv's U.mH(), solve(left=False), lstsq's residuals) read the views
    unconjugated (errors of order 1), and `solve(left=False)`'s conjugate-view result was
    stored unconjugated (Note [CPU kernels inside dispatch])."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 3, dtype=torch.complex64, generator=g)
    b = torch.randn(3, 3, dtype=torch.complex64, generator=g)
    c = torch.randn(5, 3, dtype=torch.complex64, generator=g)
    d = torch.randn(5, 2, dtype=torch.complex64, generator=g)

    def run(x, y, z, w):
        lu, piv = torch.linalg.lu_factor(x)
        return [torch.linalg.solve(x, y, left=False), torch.linalg.lu_solve(lu, piv, y, left=False),
                torch.linalg.pinv(x), torch.linalg.lstsq(z, w, driver="gelsd").residuals,
                (x.mH @ y).conj()]
    with _disable_current_modes():
        ref = run(a, b, c, d)
    got = run(*(v.to(N) for v in (a, b, c, d)))
    for i, (r, o) in enumerate(zip(ref, got)):
        assert torch.equal(o.cpu(), r), (i, (o.cpu() - r).abs().max())


def test_a_conjugate_is_no_autograd_view_of_its_base(mode):
    """Conjugates are materialized on the device, but autograd took `conj()` for a view:
    an in-place change of the base was rebased onto it, and `resolve_conj()` (a copy on
    CPU, the tensor itself here) lost its gradient: 0 where CPU gives 1 (fuzzer seed
    40003841)."""
    def run(dev):
        v2 = torch.zeros((), dtype=torch.float32, device=dev).requires_grad_()
        v4 = torch.complex(v2, v2.neg())
        v5 = torch.view_as_real(v4.conj().resolve_conj())
        v4.zero_()
        F.logsigmoid(v5).sum().backward()
        return v5.detach().cpu(), v2.grad.cpu()
    with _disable_current_modes():
        want = run("cpu")
    got = run(N)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("kind", ["LSTMCell", "GRUCell", "RNNCell"])
def test_rnn_cells_forward_and_backward_as_cpu(mode, kind):
    """ATen's LSTMCell / GRUCell take the fused kernels on any PrivateUse1 device: a few ulps
    off CPU forward, up to ~150 in gradients (ModuleInfo sweep)."""
    def run(dev):
        torch.manual_seed(0)
        cell = getattr(torch.nn, kind)(33, 57)
        x, h = torch.randn(7, 33), torch.randn(7, 57)
        state = (h, torch.randn(7, 57)) if kind == "LSTMCell" else h
        cell = cell.to(dev)
        xs = x.to(dev).requires_grad_()
        out = cell(xs, torch.utils._pytree.tree_map(lambda t: t.to(dev), state))
        outs = out if isinstance(out, tuple) else (out,)
        sum(o.sum() for o in outs).backward()
        return [o.detach().cpu() for o in outs] + [xs.grad.cpu(), cell.weight_hh.grad.cpu()]
    with _disable_current_modes():
        want = run("cpu")
    assert all(torch.equal(g, w) for g, w in zip(run(N), want))


@pytest.mark.parametrize("mode_", ["bilinear", "nearest", "bicubic"])
def test_grid_sample_forward_backward_on_the_device_as_cpu(mode, mode_):
    """`F.grid_sample` (spatial transformers, deformable sampling): grid_sampler_2d/3d and
    their backwards fell back to the CPU (found running PyTorch's test_compare_cpu). CPU's
    kernels on the device: values and both gradients bit for bit, 0 fallbacks."""
    def run(d, dims, pad, ac):
        g = torch.Generator().manual_seed(dims)
        shape, gshape = ((2, 3, 5, 6), (2, 4, 7, 2)) if dims == 4 else \
            ((2, 3, 4, 5, 6), (2, 4, 3, 7, 3))
        x = torch.randn(*shape, generator=g).to(d).requires_grad_()
        grid = (torch.rand(*gshape, generator=g) * 2.4 - 1.2).to(d).requires_grad_()
        y = F.grid_sample(x, grid, mode=mode_, padding_mode=pad, align_corners=ac)
        (y * y).sum().backward()
        return [y.detach().cpu(), x.grad.cpu(), grid.grad.cpu()]
    ae.reset_metrics()
    for dims in (4, 5) if mode_ != "bicubic" else (4,):
        for pad, ac in (("zeros", False), ("border", True), ("reflection", False)):
            with _disable_current_modes():
                ref = run("cpu", dims, pad, ac)
            got = run(N, dims, pad, ac)
            assert all(torch.equal(a, b) for a, b in zip(got, ref)), (dims, pad, ac)
    assert ae.metrics().cpu_fallbacks == {}


def _fractional_pools(x, g):
    torch.manual_seed(0)  # (their random samples: the device draws CPU's stream)
    return (F.fractional_max_pool2d(x[:, :, 0], 2, output_ratio=(0.5, 0.5)).pow(2).sum()
            + F.fractional_max_pool3d(x, 2, output_size=2).pow(2).sum())


_NN = {  # name -> (input shape, function of x and a generator); forward and backward on CPU's kernels
    "interpolate nearest 1d/3d, exact": ((1, 2, 4, 3, 5), lambda x, g: F.interpolate(
        x, scale_factor=2, mode="nearest").sum() + F.interpolate(
        x[:, :, 0, 0], scale_factor=1.5, mode="nearest-exact").pow(2).sum()),
    "interpolate linear, bicubic, trilinear, antialias": ((1, 2, 4, 3, 5), lambda x, g: (
        F.interpolate(x[:, :, 0, 0], size=7, mode="linear").pow(2).sum()
        + F.interpolate(x[:, :, 0], size=(5, 6), mode="bicubic", align_corners=True).pow(2).sum()
        + F.interpolate(x, scale_factor=1.5, mode="trilinear").pow(2).sum()
        + F.interpolate(x[:, :, 0], size=(2, 3), mode="bilinear", antialias=True).pow(2).sum())),
    "interpolate nearest/bilinear 2d backward": ((2, 3, 4, 5), lambda x, g: (
        F.interpolate(x, scale_factor=2).pow(2).sum()
        + F.interpolate(x, size=(7, 3), mode="bilinear").pow(2).sum())),
    "adaptive max pool, adaptive avg 3d, pool 3d": ((1, 2, 4, 6, 5), lambda x, g: (
        F.adaptive_max_pool2d(x[:, :, 0], (2, 3)).pow(2).sum()
        + F.adaptive_max_pool1d(x[:, :, 0, 0], 3).pow(2).sum()
        + F.adaptive_max_pool3d(x, 2).pow(2).sum() + F.adaptive_avg_pool3d(x, 2).pow(2).sum()
        + F.max_pool3d(x, 2).pow(2).sum() + F.avg_pool3d(x, 2).pow(2).sum())),
    "fractional max pool 2d/3d": ((1, 2, 5, 6, 6), _fractional_pools),
    "reflection and replication padding": ((1, 2, 4, 5, 6), lambda x, g: (
        F.pad(x[:, :, 0, 0], (2, 1), mode="reflect").pow(2).sum()
        + F.pad(x[:, :, 0], (2, 1, 1, 2), mode="reflect").pow(2).sum()
        + F.pad(x, (1, 1, 2, 1, 1, 2), mode="reflect").pow(2).sum()
        + F.pad(x[:, :, 0, 0], (2, 1), mode="replicate").pow(2).sum()
        + F.pad(x[:, :, 0], (2, 1, 1, 2), mode="replicate").pow(2).sum()
        + F.pad(x, (1, 1, 2, 1, 1, 2), mode="replicate").pow(2).sum())),
    "activations": ((4, 6), lambda x, g: (
        F.hardswish(x).pow(2).sum() + F.hardsigmoid(x).pow(2).sum() + F.logsigmoid(x).sum()
        + F.elu(x).pow(2).sum() + F.softplus(x).pow(2).sum() + F.relu6(x * 4).pow(2).sum()
        + F.leaky_relu(x).pow(2).sum() + F.prelu(x, torch.tensor([0.25, 0.5] * 3).to(x.device))
        .pow(2).sum() + (1 - x).pow(2).sum() + torch.rsub(x, x.exp()).sum()
        + F.mish(x).pow(2).sum())),
    "losses": ((4, 6), lambda x, g: (
        F.binary_cross_entropy_with_logits(x, torch.rand(4, 6, generator=g).to(x.device))
        + F.smooth_l1_loss(x, x.detach().flip(0)) + F.huber_loss(x, x.detach().flip(1))
        + F.soft_margin_loss(x, x.detach().sign())
        + F.multi_margin_loss(x, torch.tensor([0, 5, 2, 1]).to(x.device)))),
    "bilinear, rot90, max_unpool, floor_divide, complex, polar": ((2, 4, 6), lambda x, g: (
        F.bilinear(x, x, torch.ones(3, 6, 6, device=x.device) / 7).pow(2).sum()
        + torch.rot90(x, 1, (1, 2)).pow(2).sum()
        + F.max_unpool2d(*F.max_pool2d(x[None], 2, return_indices=True), 2).pow(2).sum()
        + torch.view_as_real(torch.complex(x, x * 2) * torch.polar(x.abs(), x)).sum()
        + torch.floor_divide(x.detach() * 7, 2).sum())),
    "embedding_bag sum, mean, max, per-sample weights, padding": ((7, 4), lambda x, g: (
        F.embedding_bag(torch.tensor([0, 2, 6, 1, 3, 2]).to(x.device), x,
                        torch.tensor([0, 2, 2]).to(x.device)).pow(2).sum()
        + F.embedding_bag(torch.tensor([[1, 5, 3], [4, 0, 0]]).to(x.device), x, mode="max",
                          padding_idx=0).pow(2).sum()
        + F.embedding_bag(torch.tensor([3, 1, 1, 6]).to(x.device), x,
                          torch.tensor([0, 1]).to(x.device), mode="mean", include_last_offset=True)
        .pow(2).sum()
        + F.embedding_bag(torch.tensor([4, 2, 5]).to(x.device), x, torch.tensor([0]).to(x.device),
                          per_sample_weights=x[:3, 0].detach(), mode="sum").pow(2).sum())),
    "cdist, pdist, cross, diag, masked softmax, rrelu": ((5, 3), lambda x, g: (
        torch.cdist(x, x.detach()[:4] * 2).sum() + F.pdist(x).sum()
        + torch.linalg.cross(x, x.detach().flip(0)).pow(2).sum() + torch.diag(x[:3]).sum()
        + torch.diag(x[0]).pow(2).sum()
        + torch._masked_softmax(x, x.detach() > 0, 1, 0).pow(2).sum()
        + (torch.manual_seed(1) and F.rrelu(x, training=True).pow(2).sum()))),
    "ctc loss, lengths on the host and on the device": ((12, 2, 6), lambda x, g: sum(
        F.ctc_loss(x.log_softmax(-1), torch.tensor([[1, 2, 3, 1], [2, 2, 4, 0]]).to(x.device),
                   torch.tensor([12, 10]).to(d), torch.tensor([4, 3]).to(d), reduction=r)
        .sum() for d, r in (("cpu", "mean"), (x.device, "sum")))),
    "grouped_mm 2-D x 3-D, 3-D x 3-D, 2-D x 2-D (MoE experts)": ((12, 8), lambda x, g: (
        torch._grouped_mm(x, torch.randn(4, 8, 8, generator=g).to(x.device),
                          offs=torch.tensor([3, 3, 9, 12], dtype=torch.int32).to(x.device))
        .pow(2).sum()
        + torch._grouped_mm(x.view(3, 4, 8), torch.randn(3, 8, 8, generator=g).to(x.device))
        .pow(2).sum()
        + torch._grouped_mm(x.t(), torch.randn(12, 8, generator=g).to(x.device),
                            offs=torch.tensor([4, 4, 12], dtype=torch.int32).to(x.device))
        .pow(2).sum())),
}


@pytest.mark.parametrize("kind", ["attention", "encoder"])
def test_transformer_fast_paths_in_inference_run_on_the_device_as_cpu(mode, kind):
    """nn.MultiheadAttention and nn.TransformerEncoderLayer in eval under no_grad take
    PyTorch's fused fast path on a PrivateUse1 device (`_native_multi_head_attention`,
    `_transformer_encoder_layer_fwd`), which fell back to the CPU: CPU's kernels on the device
    now, bit for bit, with and without a padding mask. (Attention without its weights stays
    a fallback: CPU returns None for them.)"""
    def run(d):
        torch.manual_seed(0)
        if kind == "attention":
            m = torch.nn.MultiheadAttention(16, 4, batch_first=True)
        else:
            m = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(
                16, 4, 32, batch_first=True), 2, enable_nested_tensor=False)
        m = m.to(d).eval()
        x = torch.randn(2, 5, 16).to(d)
        pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2]).to(d)
        with torch.no_grad():
            if kind == "attention":
                outs = [*m(x, x, x), *m(x, x, x, key_padding_mask=pad)]
            else:
                outs = [m(x), m(x, src_key_padding_mask=pad)]
        return [t.cpu() for t in outs]
    with _disable_current_modes():
        ref = run("cpu")
    ae.reset_metrics()
    got = run(N)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert ae.metrics().cpu_fallbacks == {}
    if kind == "attention":
        torch.manual_seed(0)
        m = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
        x = torch.randn(2, 5, 16)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (fell back to CPU: once per process)
            xn = x.to(N)  # (the fast path is self-attention's only)
            out, weights = m.to(N)(xn, xn, xn, need_weights=False)
        assert weights is None and out.shape == (2, 5, 16)
        assert ae.metrics().cpu_fallbacks == {"aten::_native_multi_head_attention": 1}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shapes", [((1, 0, 1, 1), (1, 0, 1, 1)), ((0, 1, 2, 2), (0, 1, 2, 2)),
                                    ((1, 1, 0, 2), (1, 1, 3, 2)), ((1, 1, 2, 2), (1, 1, 0, 2)),
                                    ((1, 1, 2, 0), (1, 1, 3, 0))])
def test_attention_of_empty_inputs_as_cpu(mode, shapes, causal):
    """CPU's sdpa answers an empty query, key or value itself (zeros, its inputs' gradients
    zeros too); the device ran CPU's flash kernel, which `_fused_sdp_choice` picks for zero
    heads or batch, and which divides by zero there: the process died of SIGFPE (fuzzer seed
    5571)."""
    qs, ks = shapes

    def run(d):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(s, generator=g).to(d).requires_grad_() for s in (qs, ks, ks))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        out.sum().backward()
        return [(t.shape, t.stride(), t.detach().cpu()) for t in (out, q.grad, k.grad, v.grad)]
    for (shape, stride, value), (want_shape, want_stride, want) in zip(run(N), run("cpu")):
        assert (shape, stride) == (want_shape, want_stride) and torch.equal(value, want)


@pytest.mark.parametrize("how", ["position", "keyword"])
def test_attention_without_weights_falls_back_however_need_weights_is_passed(how):
    """`_native_multi_head_attention` called with need_weights=False by position or by
    keyword: CPU's kernel, which returns None for the weights; with True, the device."""
    mha = torch.ops.aten._native_multi_head_attention.default
    torch.manual_seed(0)
    m = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(2, 5, 16)

    def call(d, need_weights):
        ts = [t.to(d) for t in (x, m.in_proj_weight, m.in_proj_bias, m.out_proj.weight,
                                m.out_proj.bias)]
        args = (ts[0], ts[0], ts[0], 16, 4, *ts[1:])
        with torch.no_grad():
            if how == "position":
                return mha(*args, None, need_weights)
            return mha(*args, need_weights=need_weights)
    want_out, want_w = call("cpu", False)
    ae.reset_metrics()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (fell back to CPU: once per process)
        out, w = call(N, False)
    assert w is None is want_w and torch.equal(out.cpu(), want_out)
    assert ae.metrics().cpu_fallbacks == {"aten::_native_multi_head_attention": 1}
    ae.reset_metrics()
    out, w = call(N, True)
    assert all(torch.equal(a.cpu(), b) for a, b in zip((out, w), call("cpu", True)))
    assert ae.metrics().cpu_fallbacks == {}


def test_attention_fast_path_reads_need_weights_by_its_name_in_the_schema():
    """The handler read need_weights as `args[10]`: a schema that moved it would have made it
    read another argument (here an int, truthy: the device's empty weights for CPU's None)."""
    from adaptive_eager.engine.handlers import _attention_fast_path
    assert "need_weights" in [
        a.name for a in torch.ops.aten._native_multi_head_attention.default._schema.arguments]

    class Moved:  # an op whose need_weights is second
        _schema = torch._C.parse_schema(
            "moved(Tensor query, bool need_weights, " +
            ", ".join(f"int a{i}=0" for i in range(10)) + ") -> (Tensor, Tensor)")

    class Engine:
        def dispatch_plain(self, func, args, kwargs):
            return "device"

        def run_now(self, func, args, kwargs, fallback):
            return "cpu" if fallback else "device at once"
    q, rest = torch.zeros(1), tuple(range(1, 11))
    assert _attention_fast_path(Engine(), Moved(), (q, False) + rest, {}) == "cpu"
    assert _attention_fast_path(Engine(), Moved(), (q, True) + rest, {}) == "device"
    assert _attention_fast_path(Engine(), Moved(), (q,), {"need_weights": False}) == "cpu"
    assert _attention_fast_path(Engine(), Moved(), (q,), {}) == "device"  # (True if left out)


def _train(name, d):
    """`_NN[name]`'s value and its input's gradient on device `d`."""
    shape, fn = _NN[name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g).to(d).requires_grad_()
    y = fn(x, g)
    y.backward()
    return y.detach().cpu(), x.grad.cpu()


@pytest.mark.parametrize("name", list(_NN))
def test_common_nn_ops_train_on_the_device_as_cpu(mode, name):
    """Interpolation (1d, 3d, bicubic, trilinear, antialias, and the 2d backwards), adaptive
    max, fractional max and 3d pooling, reflection and replication padding, activations'
    backwards (ReLU6, LeakyReLU, ELU, Softplus, Hardswish, LogSigmoid), losses (BCE with
    logits, smooth L1, Huber, multi-margin), Bilinear, rot90, max_unpool, floor_divide,
    complex, polar and embedding_bag all fell back to the CPU (found by a scan of OpInfo's
    samples; embedding_bag by a sweep of compile mode; `_grouped_mm`, Transformers' MoE
    experts, by a tour of its models): CPU's
    kernels on the device, values and gradients bit for bit, 0 fallbacks."""
    with _disable_current_modes():
        ref = _train(name, "cpu")
    ae.reset_metrics()
    got = _train(name, N)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert ae.metrics().cpu_fallbacks == {}


def test_common_nn_ops_under_the_inductor_executor_are_cpus_within_tolerance():
    """The same ops in groups TorchInductor compiles (its code, not CPU's kernels): within
    float tolerance of CPU. (multilabel_margin_loss, multi_margin_loss and softshrink, which
    PyTorch decomposes wrongly, are tested in tests/engine/test_executors.py.)"""
    for name in _NN:
        with _disable_current_modes():
            ref = _train(name, "cpu")
        with ae.override(executor="inductor"), ae.adaptive():
            got = _train(name, N)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_queues_with_cpus_layout_and_flops(dtype):
    """Torch's meta kernel of `_grouped_mm` is CUDA's: bfloat16 only (a float32 call, every
    MoE layer of a float32 model, ran at once: a sync in adaptive mode) and rows unpadded
    in a CPU build (a bfloat16 batch was contiguous where CPU pads each row to 16 bytes, so
    `view(-1)` worked where CPU's raises). The device's rule is CPU's (meta.py
    `_META_AS_CPU`), and its FLOPs are counted (the cost model saw one per output element)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 6, 8, generator=g).to(dtype)
    b = torch.randn(4, 3, 8, generator=g).to(dtype).transpose(-2, -1)  # N = 3: padded rows
    want = torch._grouped_mm(a, b)
    with ae.adaptive():
        a_n, b_n = a.to(N), b.to(N)
        torch.neuron.synchronize()
        ae.reset_metrics()
        a_n = a_n * 1  # queued: a sync would flush it
        got = torch._grouped_mm(a_n, b_n)
        assert ae.metrics().flushes == {}  # queued too, not run at once
        assert got.stride() == want.stride() and torch.equal(got.cpu(), want)
    x = torch.randn(512, 512, device=N)
    w = torch.randn(1, 512, 512, device=N)
    offs = torch.tensor([512], dtype=torch.int32, device=N)
    times = []
    for f in (lambda: torch._grouped_mm(x, w, offs=offs), lambda: x @ w[0]):
        torch.neuron.synchronize()
        before = ae.metrics()
        f()
        torch.neuron.synchronize()
        times.append((ae.metrics() - before).device_time_us)
    assert times[0] == pytest.approx(times[1])  # one group: mm's FLOPs, compute-bound


def _chunked_cross_entropy(d, reduction, dtype, **options):
    """F.linear_cross_entropy's chunked path (`options=`) on `d`: loss and gradients."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 8, generator=g).to(dtype).to(d).requires_grad_()
    w = torch.randn(40, 8, generator=g).to(dtype).to(d).requires_grad_()
    b = torch.randn(40, generator=g).to(dtype).to(d).requires_grad_()
    y = torch.randint(0, 40, (16,), generator=g).to(d)
    loss = F.linear_cross_entropy(x, w, y, linear_bias=b, reduction=reduction,
                                  options=torch.nn.LinearCrossEntropyOptions(**options))
    loss.sum().backward()
    return [t.detach().cpu() for t in (loss, x.grad, w.grad, b.grad)]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk", [None, 4])
def test_linear_cross_entropy_chunked_path_runs_on_the_device(mode, reduction, chunk):
    """The chunked path is PyTorch's custom op (`torch_nn::_linear_cross_entropy_batch_chunked`,
    `..._no_reduction`), one CompositeExplicitAutograd kernel in torch ops for any device: as
    a custom op without a neuron kernel it fell back to the CPU (a sync in adaptive mode). Its
    kernel runs on the device, as on CUDA (fusion.ops `_COMPOSITE_CUSTOM_OPS`)."""
    with _disable_current_modes():
        want = _chunked_cross_entropy("cpu", reduction, torch.float32, batch_chunk_size=chunk)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "fell back to CPU"
        got = _chunked_cross_entropy(N, reduction, torch.float32, batch_chunk_size=chunk)
    assert ae.metrics().cpu_fallbacks == {}
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_cross_entropy_chunked_path_in_half_precision_as_cpu(mode, dtype, reduction):
    """The chunked path picks its accumulation (policy, chunks, float32 accumulation) by the
    input's device type, float32 on `cpu` only: on neuron a float16 / bfloat16 loss and its
    gradients were 1-2 ulps off CPU's. The device takes CPU's picks (registration.py
    `_cpu_picks_for_chunked_cross_entropy`)."""
    with _disable_current_modes():
        want = _chunked_cross_entropy("cpu", reduction, dtype)
    got = _chunked_cross_entropy(N, reduction, dtype)
    assert ae.metrics().cpu_fallbacks == {}
    assert all(torch.equal(a, b) for a, b in zip(got, want))
