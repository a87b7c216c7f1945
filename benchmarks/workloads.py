"""Workloads of the launch-overhead suite. Each maker builds, on `device`, the inputs and
model of one step and returns a callable running that step (no host sync inside).

`compile` is `neuron_benchmark.compile` (torch.compile(backend="neuron") in the compile mode,
nothing in the others): it wraps the whole step of the inference workloads; for training
steps it wraps the model (forward and backward graphs), and the optimizer runs in the
surrounding mode, since Dynamo's capture of a foreach AdamW step costs seconds per compile."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptive_eager.tools.models import CNN, GPT, batches


def _same(fn):
    return fn


def pointwise_chain(device, compile=_same):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g).to(device)
    b = torch.randn(256, generator=g).to(device)
    return compile(lambda: F.gelu(x + b) * 0.5 + x)  # bias, GELU, scale, res


def mlp_block(device, compile=_same):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128)).to(device)
    x = torch.randn(32, 128).to(device)

    @torch.no_grad()
    def step():
        return mlp(x) + x
    return compile(step)


def layernorm_softmax(device, compile=_same):
    torch.manual_seed(0)
    x = torch.randn(32, 128).to(device)
    w, b = torch.ones(128).to(device), torch.zeros(128).to(device)
    return compile(lambda: F.layer_norm(x, (128,), w, b).softmax(-1))


def encoder_block(device, compile=_same):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=256, dropout=0.0,
                                       batch_first=True).to(device)
    x = torch.randn(4, 32, 64).to(device)

    @torch.no_grad()
    def step():
        return layer(x)
    return compile(step)


def _train_step(model, opt, x, y, compile=_same):
    forward = compile(model)

    def step():
        out = forward(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def gpt_train(device, compile=_same):
    torch.manual_seed(0)
    model = GPT(vocab=64, d=64, heads=4, layers=2, seq=32).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x, y = batches("gpt", 1)[0]
    return _train_step(model, opt, x.to(device), y.to(device), compile)


def cnn_train(device, compile=_same):
    torch.manual_seed(0)
    model = CNN().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x, y = batches("cnn", 1)[0]
    return _train_step(model, opt, x.to(device), y.to(device), compile)


# -- PyTorch's lazy tensors (the peer: benchmarks/README.md, "The peer") --------------------
_LTC = []


def lazy_device() -> str:
    """PyTorch's lazy tensors with the TorchScript backend (ships in the torch wheel)."""
    if not _LTC:
        import torch._lazy
        import torch._lazy.ts_backend
        torch._lazy.ts_backend.init()
        _LTC.append(True)
    return "lazy"


def ltc_sync():
    """The end of an LTC step: trace cut, graph run, wait (`xm.mark_step()` in PyTorch/XLA)."""
    import torch._lazy
    torch._lazy.mark_step()
    torch._lazy.wait_device_ops()


def ltc_counters() -> dict:
    """LTC's counters: `CachedCompile` + `UncachedCompile` is the number of graphs it ran
    (each graph execution looks its computation up first), `aten::*` its CPU fallbacks."""
    import torch._lazy.metrics as m
    return {n: m.counter_value(n) for n in m.counter_names()}


WORKLOADS = {f.__name__: f for f in (pointwise_chain, mlp_block, layernorm_softmax,
                                     encoder_block, gpt_train, cnn_train)}
