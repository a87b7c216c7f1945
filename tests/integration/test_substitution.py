"""Note [Substitution] (fusion/substitute.py): adaptive mode with ADAPTIVE_EAGER_SUBSTITUTE=1
launches flash_attention / rms_norm for hand-written attention and RMSNorm whose
intermediates nothing else needs, and for scaled_dot_product_attention's math path.
Differential: against CPU and against the setting off."""
import torch
import torch.nn.functional as F

import adaptive_eager as ae
from adaptive_eager.tools.models import RMSNorm

TOL = dict(rtol=1e-5, atol=1e-5)


def attention(q, k, v, mask, scale=0.125):
    att = (q @ k.transpose(-2, -1)) * scale + mask
    return att.softmax(-1) @ v


def rms(x, w, eps=1e-6):
    h = x.to(torch.float32)
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


def _inputs(seq=1024, d=64, rows=2048, n=2048):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, seq, d, generator=g) for _ in range(3))
    mask = torch.triu(torch.full((seq, seq), float("-inf")), 1)
    x, w = torch.randn(rows, n, generator=g), torch.randn(n, generator=g)
    return q, k, v, mask, x, w


def _run(fn, cpu_args, substitute, keep=False):
    args = [t.to("neuron") for t in cpu_args]
    with ae.override(substitute=substitute, queue_low_threshold=0), ae.adaptive(), \
            torch.no_grad():
        torch.neuron.synchronize()
        ae.reset_metrics()
        out = fn(*args)
        torch.neuron.synchronize()
        return [o.cpu() for o in out], ae.metrics(), ae.explain()


def _both(q, k, v, mask, x, w):
    return attention(q, k, v, mask), rms(x, w)


def test_setting_is_off_by_default():
    assert ae.config.substitute is False
    cpu = _inputs(seq=256, rows=64, n=64)
    _, m, _ = _run(_both, cpu, False)
    assert m.substitutions == {} and m.kernel_launches == 0


def test_inference_patterns_substituted_match_cpu_and_setting_off():
    cpu = _inputs()
    ref = _both(*cpu)
    off, m_off, _ = _run(_both, cpu, False)
    on, m_on, ex = _run(_both, cpu, True)
    assert m_on.substitutions == {"aelib::flash_attention_fwd": 1, "aelib::rms_norm_fwd": 1}
    assert m_on.kernels == {"aelib::flash_attention_fwd": 1, "aelib::rms_norm_fwd": 1}
    for a, b, c in zip(on, off, ref):
        torch.testing.assert_close(a, c, **TOL)
        torch.testing.assert_close(a, b, **TOL)
    # it pays: less modeled device time and HBM traffic than the same flush without
    assert m_on.device_time_us < m_off.device_time_us
    assert m_on.hbm_bytes < m_off.hbm_bytes / 2
    rows = ex.substitutions
    assert [r["kernel"] for r in rows] == ["aelib::flash_attention_fwd", "aelib::rms_norm_fwd"]
    assert all(r["replaced"] and r["device_us_saved"] > 0 for r in rows)
    assert rows[0]["ops"] == ["bmm", "mul.Tensor", "add.Tensor", "_softmax", "bmm"]
    text = str(ex)
    assert "2 pattern(s) replaced" in text and "with no pattern replaced" in text


def test_no_substitution_where_an_intermediate_escapes():
    cpu = _inputs(rows=64, n=64)
    kept = []

    def leaky(q, k, v, mask, x, w):
        att = (q @ k.transpose(-2, -1)) * 0.125 + mask
        p = att.softmax(-1)
        kept.append(p)  # the softmax output stays user-visible
        return p @ v, rms(x, w)

    on, m_on, ex = _run(leaky, cpu, True)
    off, _, _ = _run(leaky, cpu, False)
    assert "aelib::flash_attention_fwd" not in m_on.substitutions
    assert all(r["kernel"] != "aelib::flash_attention_fwd" for r in ex.substitutions)
    torch.testing.assert_close(on[0], off[0], rtol=0, atol=0)  # the ATen ops ran
    torch.testing.assert_close(kept[-1].cpu(), kept[0].cpu(), rtol=0, atol=0)


def test_training_is_not_substituted_below_autograd_and_grads_match_cpu():
    """Autograd saves the softmax output (and rsqrt's): they escape, so nothing is replaced."""
    q, k, v, mask, x, w = _inputs()  # sizes where substitution would pay
    cpu = [t.clone().requires_grad_() for t in (q, k, v, x, w)]
    (attention(cpu[0], cpu[1], cpu[2], mask).sum() + rms(cpu[3], cpu[4]).sum()).backward()
    dev = [t.detach().to("neuron").requires_grad_() for t in (q, k, v, x, w)]
    with ae.override(substitute=True, queue_low_threshold=0), ae.adaptive():
        ae.reset_metrics()
        loss = attention(dev[0], dev[1], dev[2], mask.to("neuron")).sum() + rms(dev[3],
                                                                                 dev[4]).sum()
        loss.item()  # the forward's flush alone: only the saved tensors' liveness protects
        loss.backward()
        torch.neuron.synchronize()
        assert ae.metrics().substitutions == {}
    for a, b in zip(dev, cpu):
        torch.testing.assert_close(a.grad.cpu(), b.grad, rtol=1e-4, atol=1e-4)


def test_declined_when_the_flush_costs_less_without():
    """Small: the ATen ops fuse into one launch; a kernel would be a launch of its own."""
    cpu = _inputs(seq=64, rows=64, n=64)
    on, m_on, ex = _run(_both, cpu, True)
    off, m_off, _ = _run(_both, cpu, False)
    assert m_on.substitutions == {} and m_on.launches == m_off.launches
    assert [r["replaced"] for r in ex.substitutions] == [False, False]
    assert all(r["device_us_saved"] < 0 for r in ex.substitutions)
    for a, b in zip(on, off):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_llama_rms_norm_module_form_is_recognized():
    norm = RMSNorm(2048)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(2048))
    x = torch.randn(2048, 2048)
    ref = norm(x)
    dev = RMSNorm(2048).to("neuron")
    dev.load_state_dict(norm.state_dict())
    (out,), m, _ = _run(lambda t: (dev(t),), [x], True)
    assert m.substitutions == {"aelib::rms_norm_fwd": 1}
    torch.testing.assert_close(out, ref, **TOL)


def test_sdpa_math_path_becomes_flash_with_gradients():
    """3-D inputs: CPU (and so the device) would take SDPA's math path; substituted above
    autograd, the flash kernel's backward gives the gradients."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(4, 128, 32, generator=g) for _ in range(3))
    mask = torch.randn(128, 128, generator=g)
    cpu = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*cpu, attn_mask=mask)
    ref.sum().backward()
    for substitute in (False, True):
        dev = [t.detach().to("neuron").requires_grad_() for t in (q, k, v)]
        with ae.override(substitute=substitute), ae.adaptive():
            ae.reset_metrics()
            out = F.scaled_dot_product_attention(*dev, attn_mask=mask.to("neuron"))
            out.sum().backward()
            torch.neuron.synchronize()
            m = ae.metrics()
        assert bool(m.kernels) == substitute
        if substitute:
            assert m.kernels == {"aelib::flash_attention_fwd": 1, "aelib::flash_attention_bwd": 1}
        torch.testing.assert_close(out.detach().cpu(), ref.detach(), **TOL)
        for a, b in zip(dev, cpu):
            torch.testing.assert_close(a.grad.cpu(), b.grad, rtol=1e-4, atol=1e-4)


def test_sdpa_flash_path_is_left_alone():
    """4-D inputs: the device already runs CPU's fused flash op; no kernel replaces it."""
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    with ae.override(substitute=True), ae.adaptive():
        ae.reset_metrics()
        out = F.scaled_dot_product_attention(*(t.to("neuron") for t in (q, k, v)),
                                             is_causal=True)
        torch.neuron.synchronize()
        assert ae.metrics().kernels == {}
    torch.testing.assert_close(out.cpu(), F.scaled_dot_product_attention(q, k, v,
                                                                         is_causal=True), **TOL)


def test_no_substitution_when_an_input_changes_inside_the_pattern_or_alpha_is_given():
    """The kernel runs at the pattern's last op: a write to q in between forbids it; so does
    add's alpha (the pattern's add is a plain one)."""
    cpu = _inputs(rows=64, n=64)

    def written(q, k, v, mask, x, w):
        s = (q @ k.transpose(-2, -1)) * 0.125 + mask
        q.mul_(2)  # after the scores are made, before the pattern's last op
        p = s.softmax(-1)
        del s
        return p @ v, q

    def alpha(q, k, v, mask, x, w):
        return torch.add((q @ k.transpose(-2, -1)) * 0.125, mask, alpha=0.5).softmax(-1) @ v,

    for fn in (written, alpha):
        on, m_on, _ = _run(fn, cpu, True)
        off, _, _ = _run(fn, cpu, False)
        assert m_on.substitutions == {}, fn.__name__
        for a, b, c in zip(on, off, fn(*[t.clone() for t in cpu])):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
            torch.testing.assert_close(a, c, **TOL)
