"""Models train the same on CPU, neuron eager and neuron adaptive (both strategies)."""
import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.models import train

KINDS = ["mlp", "cnn", "encoder", "gpt"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
def test_losses_match_cpu_and_eager(kind, foreach):
    cpu, m_cpu = train(kind, "cpu", foreach=foreach)
    eager, m_eager = train(kind, "neuron", foreach=foreach)
    assert eager == cpu  # bit for bit (attention takes CPU's kernel: attention.py)
    for p, q in zip(m_cpu.parameters(), m_eager.parameters()):
        assert torch.equal(p, q.cpu())
    for strategy in ("graph", "matmul"):
        with ae.adaptive(strategy=strategy):
            lazy, m_lazy = train(kind, "neuron", foreach=foreach)
        assert lazy == eager, f"adaptive {strategy} differs from eager"  # bit for bit
        for p, q in zip(m_eager.parameters(), m_lazy.parameters()):
            assert torch.equal(p.cpu(), q.cpu())


@pytest.mark.parametrize("kind", ["encoder", "gpt"])
def test_dropout_same_seed_is_bit_exact(kind):
    eager, _ = train(kind, "neuron", dropout=0.1)
    with ae.adaptive():
        lazy, _ = train(kind, "neuron", dropout=0.1)
    assert lazy == eager


def test_dropout_matches_cpu_under_same_seed():
    cpu, _ = train("gpt", "cpu", dropout=0.1)
    neuron, _ = train("gpt", "neuron", dropout=0.1)
    assert neuron == cpu


def test_training_leaves_no_device_memory_behind(mode):
    import gc
    torch.neuron.synchronize()
    base = torch.neuron.memory_allocated()
    losses, model = train("gpt", "neuron", steps=2)
    assert torch.neuron.memory_allocated() > base
    del model
    gc.collect()
    torch.neuron.synchronize()
    assert torch.neuron.memory_allocated() == base


@pytest.mark.parametrize("kwargs", [{}, {"bidirectional": True, "batch_first": True},
                                    {"bias": False}, {"proj_size": 4}], ids=str)
def test_lstm_matches_cpu_bit_for_bit(kwargs, mode):
    """CPU runs nn.LSTM through oneDNN, one `mkldnn_rnn_layer` per layer and direction; any
    other device composed time steps, a few ulps off. Neuron takes CPU's path (rnn.py)."""
    outs = []
    for dev in ("cpu", "neuron"):
        torch.manual_seed(0)
        net = torch.nn.LSTM(6, 8, num_layers=2, **kwargs).to(dev)
        x = torch.randn(5, 3, 6, generator=torch.Generator().manual_seed(1)).to(dev)
        x.requires_grad_()
        out, (h, c) = net(x)
        (out.square().sum() + h.sum() + c.sum()).backward()
        outs.append([t.detach().cpu() for t in (out, h, c, x.grad,
                                                *[p.grad for p in net.parameters()])])
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert not ae.metrics().cpu_fallbacks


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU])
def test_recurrent_layers_match_cpu(cls, mode):
    """PyTorch picks the fused RNN cells for accelerators; neuron composes them (GRU: a few
    ulps off CPU's, README Known gaps; LSTM: exact, above)."""
    torch.manual_seed(0)
    net = cls(4, 8, num_layers=2, batch_first=True)
    x = torch.randn(2, 5, 4, requires_grad=True)
    out, _ = net(x)
    out.pow(2).sum().backward()
    ref_x, ref_w = x.grad.clone(), net.weight_hh_l0.grad.clone()
    net.zero_grad()
    net = net.to("neuron")
    xn = x.detach().to("neuron").requires_grad_()
    outn, _ = net(xn)
    outn.pow(2).sum().backward()
    torch.testing.assert_close(outn.cpu(), out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xn.grad.cpu(), ref_x, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(net.weight_hh_l0.grad.cpu(), ref_w, rtol=1e-4, atol=1e-5)
    assert not ae.metrics().cpu_fallbacks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sdpa_matches_cpu_bit_for_bit(dtype, mode):
    """CPU runs scaled_dot_product_attention as its flash kernel when its checks pass; PyTorch
    gave any other device the composed math path, a few ulps off (bf16 greedy decoding changed
    tokens). Neuron makes CPU's choice, forward and backward; a mask with is_causal, which only
    the flash kernel takes, works as on CPU."""
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 16, generator=g).to(dtype) for _ in range(3))
    mask = torch.rand(8, 8, generator=g) > 0.3
    for kwargs in ({}, {"is_causal": True}, {"attn_mask": mask},
                   {"attn_mask": mask, "is_causal": True}, {"attn_mask": mask.float()},
                   {"scale": 0.3}):
        outs = []
        for dev in ("cpu", "neuron"):
            ts = [t.to(dev).detach().requires_grad_() for t in (q, k, v)]
            kw = {n: (a.to(dev) if isinstance(a, torch.Tensor) else a) for n, a in kwargs.items()}
            o = F.scaled_dot_product_attention(*ts, **kw)
            o.float().square().sum().backward()
            outs.append([t.detach().cpu() for t in (o, *[t.grad for t in ts])])
        for a, b in zip(*outs):
            assert torch.equal(a, b), kwargs
    assert not ae.metrics().cpu_fallbacks


# Under the Inductor executor (README, "Executors"): float32 tolerance, not bit for bit. CI
# trains the MLP and the GPT; `--inductor-all` adds the CNN and the encoder (slow compiles).
@pytest.mark.parametrize("kind", KINDS)
def test_losses_match_cpu_under_inductor(kind, request):
    if kind in ("cnn", "encoder") and not request.config.getoption("--inductor-all"):
        pytest.skip("slow Inductor compiles: run with --inductor-all")
    cpu, m_cpu = train(kind, "cpu", foreach=True)
    with ae.override(executor="inductor"), ae.adaptive():
        ae.reset_metrics()
        got, m = train(kind, "neuron", foreach=True)
        compiled = ae.metrics().compiled_launches
    assert compiled > 0
    torch.testing.assert_close(got, cpu, rtol=1e-4, atol=1e-5)
    # atol 1e-3: the key bias of attention has an exactly-zero gradient in exact arithmetic
    # (softmax ignores a per-row constant), so both sides hold round-off noise there, and
    # AdamW turns noise into steps of about lr; everywhere else it is within 2e-6.
    for p, q in zip(m_cpu.parameters(), m.parameters()):
        torch.testing.assert_close(q.cpu(), p, rtol=1e-4, atol=1e-3)
