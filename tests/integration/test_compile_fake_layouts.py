"""torch.compile(backend="neuron") where FakeTensor laid out an output unlike the device.

Found by the s17 compile-scan (FakeTensor on neuron:0 against the device's outputs, OpInfo
samples with channels_last / transposed inputs): convolution's fake kernel asks
`torch._C._select_conv_backend`, which for a PrivateUse1 device answers "Overrideable", so the
graph believed the output contiguous; the device runs CPU's kernel, which keeps the input's
channels_last. A `reshape` the graph turned into `view` then failed at run time (CPU under
backend="aot_eager" is right). pixel_shuffle's meta kernel keeps channels_last only for
device type "cpu", the same mismatch. Fixed by Note [Fake layouts of the device]
(integration/fake_layouts.py) and, above the probe's 16 MiB, Note [Layouts of unprobed
signatures] (engine/meta.py).
"""
import contextlib
import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adaptive_eager as ae

CL = torch.channels_last
pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/integration/conftest.py


@pytest.mark.parametrize("fn, args", [
    (lambda x, w: F.conv2d(x, w).reshape(-1),
     lambda: [torch.randn(1, 4, 5, 5).contiguous(memory_format=CL), torch.randn(3, 4, 3, 3)]),
    (lambda x, w: F.conv_transpose2d(x, w).reshape(-1),
     lambda: [torch.randn(1, 4, 3, 3).contiguous(memory_format=CL), torch.randn(4, 3, 2, 2)]),
    (lambda x: F.pixel_shuffle(x, 2).reshape(-1),
     lambda: [torch.randn(1, 8, 2, 3).contiguous(memory_format=CL)]),
], ids=["conv2d", "conv_transpose2d", "pixel_shuffle"])
def test_reshape_of_a_channels_last_result_matches_cpu(fn, args):
    torch.manual_seed(0)
    cpu_args = args()
    ref = fn(*cpu_args)
    got = torch.compile(fn, backend="neuron")(*[a.to("neuron") for a in cpu_args])
    torch.testing.assert_close(got.cpu(), ref)


def test_channels_last_cnn_training_step_matches_cpu():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                        nn.Linear(8 * 3 * 3, 4)).to(memory_format=CL)
    x = torch.randn(2, 3, 8, 8).contiguous(memory_format=CL)
    dev_net = copy.deepcopy(net).to("neuron")
    net(x).square().sum().backward()
    out = torch.compile(dev_net, backend="neuron")(x.to("neuron"))
    out.square().sum().backward()
    for p, q in zip(net.parameters(), dev_net.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-5, atol=1e-5)


# -- Note [Fake layouts of the device]: every op whose fake rule now answers as CPU's ---------

def _meta(o):
    if isinstance(o, torch.Tensor):
        return tuple(o.shape), o.stride(), o.dtype
    if isinstance(o, (tuple, list)):
        return tuple(_meta(x) for x in o)
    return o


def _on(mode, t, device):
    """A FakeTensor on `device` shaped and strided like host tensor t."""
    from torch._subclasses.fake_tensor import FakeTensor
    with torch._C._DisableTorchDispatch():
        m = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return FakeTensor(mode, m, torch.device(device))


aten = torch.ops.aten
_W = torch.randn(3, 8, 3, 3)
_X = torch.randn(2, 8, 5, 6)
_CONV = [None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1]
_BAG = [torch.randn(10, 3), torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 4])]
# (op, sample) per op of fake_layouts._ops(), channels_last and contiguous where layout matters
FAKE_SAMPLES = [
    (aten.convolution.default, lambda x, w: aten.convolution(x, w, *_CONV), [_X, _W]),
    (aten.convolution.default, lambda x, w: aten.convolution(x, w, *_CONV),
     [_X.contiguous(memory_format=CL), _W]),
    (aten.convolution.default, lambda x, w: aten.convolution(x, w, *_CONV),
     [_X, _W.contiguous(memory_format=CL)]),
    (aten.convolution.default, lambda x, w: aten.convolution(
        x, w, None, [1, 1], [0, 0], [1, 1], True, [0, 0], 1),
     [_X.contiguous(memory_format=CL), torch.randn(8, 3, 2, 2)]),
    (aten._convolution.default, lambda x, w: aten._convolution(
        x, w, *_CONV, False, False, True, True), [_X.contiguous(memory_format=CL), _W]),
    (aten._convolution.deprecated, lambda x, w: aten._convolution.deprecated(
        x, w, *_CONV, False, False, True), [_X.contiguous(memory_format=CL), _W]),
    (aten.convolution_backward.default, lambda g, x, w: aten.convolution_backward(
        g, x, w, [3], *_CONV[1:], [True, True, True]),
     [torch.randn(2, 3, 3, 4).contiguous(memory_format=CL), _X.contiguous(memory_format=CL),
      _W]),
    (aten.convolution_backward.default, lambda g, x, w: aten.convolution_backward(
        g, x, w, [3], *_CONV[1:], [True, True, True]), [torch.randn(2, 3, 3, 4), _X, _W]),
    (aten.pixel_shuffle.default, lambda x: aten.pixel_shuffle(x, 2),
     [_X.contiguous(memory_format=CL)]),
    (aten.pixel_shuffle.default, lambda x: aten.pixel_shuffle(x, 2), [_X]),
    (aten.nonzero_static.default, lambda x: aten.nonzero_static(x, size=4),
     [torch.tensor([[0.0, 1.0], [2.0, 0.0]])]),
    (aten._embedding_bag.default, lambda w, i, o: aten._embedding_bag(w, i, o, False, 0), _BAG),
    (aten._embedding_bag.default, lambda w, i, o: aten._embedding_bag(w, i, o, False, 1), _BAG),
    (aten._embedding_bag.default, lambda w, i, o: aten._embedding_bag(w, i, o, False, 2), _BAG),
    (aten._embedding_bag_forward_only.default, lambda w, i, o: aten._embedding_bag_forward_only(
        w, i, o, False, 0), _BAG),
    (aten._fft_c2c.default, lambda x: aten._fft_c2c(x, [1, 2], 0, True),
     [torch.randn(2, 3, 4, dtype=torch.complex64).transpose(0, 2)]),
]


def test_every_op_with_a_device_rule_is_answered_as_cpu():
    """Note [Fake layouts of the device]: the ops whose fake rule is CPU's on the device, in
    PyTorch's table (private: fake_impls.op_implementations_dict)."""
    from adaptive_eager.integration import fake_layouts
    assert fake_layouts.registered() == fake_layouts._ops()
    names = {str(op) for op in fake_layouts._ops()}
    assert {"aten.convolution.default", "aten.convolution_backward.default",
            "aten.pixel_shuffle.default", "aten.nonzero_static.default",
            "aten._embedding_bag.default"} <= names
    sampled = {op for op, _, _ in FAKE_SAMPLES}
    assert names - {str(op) for op in sampled} <= {"aten._scaled_mm.default",
                                                   "aten._scaled_mm_v2.default"}


@pytest.mark.parametrize("k", range(len(FAKE_SAMPLES)))
def test_fake_result_on_the_device_is_cpus_and_the_devices(k):
    """FakeTensors on neuron:0 (as Dynamo makes them) are given the metadata of CPU's real
    kernel, which is also what the device makes; on neuron:1 too."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    _, fn, args = FAKE_SAMPLES[k]
    want = _meta(fn(*args))
    assert _meta(fn(*[a.to("neuron") for a in args])) == want  # the device, eager
    for device in ("neuron:0", "neuron:1"):
        mode = FakeTensorMode()
        fake = [_on(mode, a, device) for a in args]
        with mode:
            got = fn(*fake)
        assert _meta(got) == want
        for t in (got if isinstance(got, tuple) else (got,)):
            assert t is None or (t.device == torch.device(device)
                                 and torch._C._dispatch_keys(t).has(
                                     torch._C.DispatchKey.AutogradPrivateUse1))


_CPU_AND_META = r"""
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
aten, CL = torch.ops.aten, torch.channels_last
if IMPORT:
    import adaptive_eager
    from adaptive_eager.integration import fake_layouts
    assert fake_layouts.registered()
x, w = torch.randn(2, 8, 5, 6).contiguous(memory_format=CL), torch.randn(3, 8, 3, 3)
conv = lambda x, w: aten.convolution(x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
cases = [(conv, [x, w]), (conv, [x.contiguous(), w]), (lambda x: aten.pixel_shuffle(x, 2), [x]),
         (lambda x: aten.nonzero_static(x, size=3), [torch.randn(4, 2)]),
         (lambda g, x, w: aten.convolution_backward(g, x, w, [3], [1, 1], [0, 0], [1, 1], False,
                                                    [0, 0], 1, [True, True, True]),
          [torch.randn(2, 3, 3, 4).contiguous(memory_format=CL), x, w]),
         (lambda w, i, o: aten._embedding_bag(w, i, o, False, 0),
          [torch.randn(5, 3), torch.tensor([0, 1, 4]), torch.tensor([0, 2])])]
def meta(o):
    if isinstance(o, torch.Tensor):
        return (tuple(o.shape), o.stride(), str(o.dtype), str(o.device))
    return tuple(meta(v) for v in o) if isinstance(o, (tuple, list)) else o
for fn, args in cases:
    for device in ("cpu", "meta", "cuda"):
        mode = FakeTensorMode()
        with torch._C._DisableTorchDispatch():
            fake = [FakeTensor(mode, torch.empty_strided(a.shape, a.stride(), dtype=a.dtype,
                                                         device="meta"), torch.device(device))
                    for a in args]
        with mode:
            print(device, "fake", meta(fn(*fake)))
    print("meta", meta(fn(*[a.to("meta") for a in args])))
"""


def test_other_devices_fake_and_meta_layouts_are_pytorchs():
    """Note [Fake layouts of the device]: FakeTensors on CPU, meta and CUDA and plain meta
    tensors get exactly what they get without this package (a fresh interpreter each, the
    package's autoload off in one)."""
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    outs = [subprocess.run([sys.executable, "-c", f"IMPORT = {imp}\n" + _CPU_AND_META],
                           capture_output=True, text=True, env=env, timeout=300)
            for imp in (False, True)]
    for o in outs:
        assert o.returncode == 0, o.stderr[-2000:]
    assert outs[0].stdout == outs[1].stdout and outs[0].stdout.count("\n") == 6 * 4


# -- differential: CPU against compile on neuron, forward and backward -----------------------

_FWD = {
    "conv2d": (lambda x, w: F.conv2d(x, w, padding=1), (2, 4, 6, 5), (3, 4, 3, 3)),
    "conv2d_stride": (lambda x, w: F.conv2d(x, w, stride=2), (2, 4, 7, 6), (6, 4, 3, 3)),
    "conv_transpose2d": (lambda x, w: F.conv_transpose2d(x, w, stride=2), (2, 4, 3, 3),
                         (4, 3, 2, 2)),
    "conv3d": (lambda x, w: F.conv3d(x, w), (1, 4, 3, 4, 5), (2, 4, 2, 2, 2)),
    "conv1d": (lambda x, w: F.conv1d(x, w), (2, 4, 9), (3, 4, 3)),
    "pixel_shuffle": (lambda x, w: F.pixel_shuffle(x * w, 2), (2, 8, 3, 4), (1, 8, 1, 1)),
}


def _layout(shape, fmt):
    t = torch.randn(*shape)
    if fmt == "channels_last" and t.dim() in (4, 5):
        return t.contiguous(memory_format=CL if t.dim() == 4 else torch.channels_last_3d)
    return t


@pytest.mark.parametrize("fmt", ["channels_last", "contiguous"])
@pytest.mark.parametrize("name", sorted(_FWD))
def test_compiled_op_forward_and_backward_match_cpu(name, fmt):
    """Values, result strides and gradients (and theirs) of compile on neuron equal CPU's; a
    reshape and a permute-then-view of the result run (they failed where the graph believed
    another layout), with no graph break; the device's eager and adaptive runs are CPU's too."""
    op, xs, ws = _FWD[name]
    torch.manual_seed(0)
    x, w = _layout(xs, fmt), _layout(ws, fmt)

    def fn(x, w):
        y = op(x, w)
        return y, y.reshape(-1) * 2, y.transpose(1, -1).reshape(y.shape[0], -1)

    def run(f, device):
        xd, wd = x.detach().to(device).requires_grad_(), w.detach().to(device).requires_grad_()
        outs = f(xd, wd)
        sum(o.square().sum() for o in outs).backward()
        return [o.detach().cpu() for o in outs] + [xd.grad.cpu(), wd.grad.cpu()], \
            [o.stride() for o in outs] + [xd.grad.stride(), wd.grad.stride()]

    want, want_strides = run(fn, "cpu")
    for label, f, scope in (("eager", fn, contextlib.nullcontext()),
                            ("adaptive", fn, ae.adaptive()),
                            ("compile", torch.compile(fn, backend="neuron", fullgraph=True),
                             contextlib.nullcontext())):
        with scope:
            got, strides = run(f, "neuron")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{label}: {m}")
        assert strides == want_strides, label
    explain = torch._dynamo.explain(fn)(x.to("neuron"), w.to("neuron"))
    assert explain.graph_break_count == 0 and explain.graph_count == 1


def test_dynamic_shapes_keep_cpus_layout():
    """Symbolic sizes (dynamic=True) are relabelled as they are (a channels_last conv)."""
    fn = torch.compile(lambda x, w: F.conv2d(x, w).reshape(-1), backend="neuron", dynamic=True)
    w = torch.randn(3, 4, 3, 3)
    for n in (2, 3):
        x = torch.randn(n, 4, 6, 5).contiguous(memory_format=CL)
        torch.testing.assert_close(fn(x.to("neuron"), w.to("neuron")).cpu(),
                                   F.conv2d(x, w).reshape(-1))


def test_nonzero_static_and_embedding_bag_match_cpu_compiled():
    """nonzero_static's row-major result (CUDA's fake is column-major) and embedding_bag's
    CPU-shaped offset2bag / bag_size / max_indices, forward and backward."""
    torch.manual_seed(0)
    x = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 3.0]])
    f = lambda x: torch.nonzero_static(x, size=4).t().reshape(-1)
    torch.testing.assert_close(torch.compile(f, backend="neuron")(x.to("neuron")).cpu(), f(x))
    idx, off = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 4])
    for mode in ("sum", "mean", "max"):
        bag = nn.EmbeddingBag(10, 3, mode=mode)
        dev = copy.deepcopy(bag).to("neuron")
        bag(idx, off).square().sum().backward()
        out = torch.compile(dev, backend="neuron")(idx.to("neuron"), off.to("neuron"))
        out.square().sum().backward()
        torch.testing.assert_close(out.detach().cpu(), bag(idx, off).detach())
        torch.testing.assert_close(dev.weight.grad.cpu(), bag.weight.grad)
        torch._dynamo.reset()


def test_channels_last_cnn_sgd_steps_match_cpu_in_every_mode():
    """A channels_last CNN (conv, batch norm, pixel_shuffle, conv_transpose, pooling, linear)
    trained 3 SGD steps: compile on neuron, eager and adaptive give CPU's losses and
    parameters, no graph break."""
    def make():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.PixelShuffle(2),
            nn.ConvTranspose2d(4, 8, 2, stride=2), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 4, 3),
            nn.Flatten(), nn.Linear(4 * 6 * 6, 5)).to(memory_format=CL)

    torch.manual_seed(1)
    xs = [torch.randn(4, 3, 4, 4).contiguous(memory_format=CL) for _ in range(3)]
    ys = [torch.randint(0, 5, (4,)) for _ in range(3)]

    def train(device, wrap=lambda m: m, scope=contextlib.nullcontext):
        net = make().to(device)
        step_fn, opt = wrap(net), torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        losses = []
        with scope():
            for x, y in zip(xs, ys):
                loss = F.cross_entropy(step_fn(x.to(device)), y.to(device))
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        return losses, [p.detach().cpu() for p in net.parameters()]

    want = train("cpu")
    for label, got in (("eager", train("neuron")), ("adaptive", train("neuron", scope=ae.adaptive)),
                       ("compile", train("neuron", lambda m: torch.compile(m, backend="neuron")))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{label}: {m}")
    torch._dynamo.reset()
    net = make().to("neuron")
    explain = torch._dynamo.explain(net)(xs[0].to("neuron"))
    assert explain.graph_break_count == 0


def test_a_channels_last_convolution_above_the_probe_bound_keeps_cpus_layout():
    """Note [Layouts of unprobed signatures]: above 16 MiB of buffers the CPU probe is skipped;
    the device's layout is still CPU's (it was meta's, contiguous), so a graph (which believes
    CPU's) and the device agree: a permute-then-view of the result ran before the fix of the
    graph's layouts and must still run."""
    torch.manual_seed(0)
    x = torch.randn(8, 16, 200, 200).contiguous(memory_format=CL)  # 19.5 MiB
    w = torch.randn(16, 16, 3, 3)
    y = F.conv2d(x.to("neuron"), w.to("neuron"))
    assert y.stride() == F.conv2d(x, w).stride()
    fn = lambda x, w: F.conv2d(x, w).permute(0, 2, 3, 1).reshape(8, -1)
    got = torch.compile(fn, backend="neuron")(x.to("neuron"), w.to("neuron"))
    torch.testing.assert_close(got.cpu(), fn(x, w))


@pytest.mark.parametrize("fn", [
    lambda x: F.pixel_shuffle(x, 2),
    lambda x: F.pad(x, (1, 1, 1, 1), mode="reflect"),
    lambda x: F.pad(x, (1, 1, 1, 1), mode="replicate"),
], ids=["pixel_shuffle", "reflection_pad2d", "replication_pad2d"])
def test_device_rules_above_the_probe_bound_are_cpus(fn):
    """Note [Layouts of unprobed signatures]: meta kernels that lay out by device answered as
    for CUDA above 16 MiB (a contiguous result for CPU's channels_last), in eager mode too."""
    x = torch.randn(4, 16, 300, 300).contiguous(memory_format=CL)  # 22 MiB
    y = fn(x.to("neuron"))
    assert y.stride() == fn(x).stride()
    g = torch.compile(lambda x: fn(x).permute(0, 2, 3, 1).reshape(4, -1), backend="neuron")
    torch.testing.assert_close(g(x.to("neuron")).cpu(), fn(x).permute(0, 2, 3, 1).reshape(4, -1))
