"""The kernel library (NKI-lib's counterpart): flash attention, RMSNorm and a blockwise MoE MLP,
each a PyTorch custom op with a neuron kernel (Note [Custom kernels] in fusion/kernels.py), a
backward kernel, and a cost model of its tiling (fusion/kernels.py, Note [Kernel tiling]).

    from adaptive_eager import kernels as K
    out = K.flash_attention(q, k, v, causal=True)      # q, k, v: (..., seq, head_dim)
    y = K.rms_norm(x, weight, eps=1e-6)
    y = K.moe_mlp(x, router_logits, w_gate, w_up, w_down, top_k=2)

The ops are `torch.ops.aelib.*`; their bodies run on any device (on CPU too, as the default
kernel), and on neuron as one launch each. Values: those of the ATen ops they replace within
float32 tolerance (tests/integration/test_kernels.py); bodies compute in float32 and return
the input's dtype. Importing this module (`ae.kernels` does, on first use) registers the ops.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fusion import substitute
from fusion.kernels import (FLASH_BLOCK, flash_attention_cost, moe_cost, register_cost,
                            rms_norm_cost)

from .. import _load

_load()  # the neuron kernels below need the device registered (Note [Lazy package]: imported
# first, this module is half made at torch's import, so the API would wait for it)

__all__ = ["flash_attention", "rms_norm", "moe_mlp"]

_NS = "aelib"


def _kernel(name, mutates_args=()):
    """A custom op whose one body is the default kernel and the neuron kernel."""
    def wrap(fn):
        op = torch.library.custom_op(f"{_NS}::{name}", mutates_args=mutates_args)(fn)
        op.register_kernel("neuron")(fn)
        return op
    return wrap


# -- flash attention ----------------------------------------------------------------------
def _causal_block(i0: int, rows: int, s_k: int, device) -> torch.Tensor:
    """The causal mask of query rows [i0, i0 + rows) (top-left aligned, as SDPA's)."""
    q = torch.arange(i0, i0 + rows, device=device)[:, None]
    return torch.arange(s_k, device=device)[None, :] > q


def _mask_block(mask, q, s_k, sl):
    """Rows `sl` of an additive mask broadcast to the scores' shape (..., s_q, s_k), float32."""
    return mask.expand(q.shape[:-1] + (s_k,))[..., sl, :].float()


@_kernel("flash_attention_fwd")
def _flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
               scale: float, mask: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of FLASH_BLOCK query rows: scores against every key (plus the additive
    `mask`'s rows, broadcast), softmax, times V; the row log-sum-exp is kept for the
    backward. Nothing of size seq x seq is written."""
    s_q, s_k = q.shape[-2], k.shape[-2]
    out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    kf, vf = k.float(), v.float()
    for i0 in range(0, s_q, FLASH_BLOCK):
        qb = q[..., i0:i0 + FLASH_BLOCK, :].float()
        s = torch.matmul(qb, kf.transpose(-2, -1)) * scale
        if mask is not None:
            s = s + _mask_block(mask, q, s_k, slice(i0, i0 + FLASH_BLOCK))
        if causal:
            s = s.masked_fill(_causal_block(i0, qb.shape[-2], s_k, q.device), float("-inf"))
        m = s.amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
        p = torch.exp(s - m)
        denom = p.sum(-1, keepdim=True)
        out[..., i0:i0 + FLASH_BLOCK, :] = torch.matmul(p, vf) / denom
        lse[..., i0:i0 + FLASH_BLOCK] = (m + torch.log(denom)).squeeze(-1)
    return out.to(q.dtype), lse


@_flash_fwd.register_fake
def _(q, k, v, causal, scale, mask=None):
    torch._check(q.dim() >= 2 and q.dim() == k.dim() == v.dim(),
                 lambda: "flash_attention: q, k and v must have the same number of dims (>= 2)")
    torch._check(q.shape[:-2] == k.shape[:-2] == v.shape[:-2],
                 lambda: f"flash_attention: batch dims differ: q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    torch._check(q.shape[-1] == k.shape[-1] and k.shape[-2] == v.shape[-2],
                 lambda: f"flash_attention: q {tuple(q.shape)}, k {tuple(k.shape)} and "
                         f"v {tuple(v.shape)} do not fit (q·kᵀ·v)")
    scores = q.shape[:-1] + (k.shape[-2],)
    torch._check(mask is None or torch.broadcast_shapes(mask.shape, scores) == scores,
                 lambda: f"flash_attention: mask of shape {tuple(mask.shape)} does not "
                         f"broadcast to the scores' shape {tuple(scores)}")
    return (q.new_empty(q.shape[:-1] + (v.shape[-1],)),
            q.new_empty(q.shape[:-1], dtype=torch.float32))


@_kernel("flash_attention_bwd")
def _flash_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
               mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query block: P recomputed from the saved log-sum-exp, dV and dK accumulated,
    dQ written (FlashAttention-2's backward, blocked over queries)."""
    s_q, s_k = q.shape[-2], k.shape[-2]
    kf, vf = k.float(), v.float()
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    delta = (dout.float() * out.float()).sum(-1)  # rowsum(dO * O)
    for i0 in range(0, s_q, FLASH_BLOCK):
        sl = slice(i0, i0 + FLASH_BLOCK)
        qb, dob = q[..., sl, :].float(), dout[..., sl, :].float()
        s = torch.matmul(qb, kf.transpose(-2, -1)) * scale
        if mask is not None:
            s = s + _mask_block(mask, q, s_k, sl)
        if causal:
            s = s.masked_fill(_causal_block(i0, qb.shape[-2], s_k, q.device), float("-inf"))
        p = torch.exp(s - lse[..., sl, None])
        dv += torch.matmul(p.transpose(-2, -1), dob)
        dp = torch.matmul(dob, vf.transpose(-2, -1))
        ds = p * (dp - delta[..., sl, None]) * scale
        dq[..., sl, :] = torch.matmul(ds, kf)
        dk += torch.matmul(ds.transpose(-2, -1), qb)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@_flash_bwd.register_fake
def _(dout, q, k, v, out, lse, causal, scale, mask=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _flash_setup(ctx, inputs, output):
    q, k, v, causal, scale, mask = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask)
    ctx.causal, ctx.scale = causal, scale


def _flash_backward(ctx, dout, dlse):
    """The mask gets no gradient: callers pass one that does not require it."""
    q, k, v, out, lse, mask = ctx.saved_tensors
    dq, dk, dv = _flash_bwd(dout.contiguous(), q, k, v, out, lse, ctx.causal, ctx.scale, mask)
    return dq, dk, dv, None, None, None


_flash_fwd.register_autograd(_flash_backward, setup_context=_flash_setup)


def _attn_shape(q, k, v):
    b = math.prod(q.shape[:-3]) if q.dim() > 3 else 1
    h = q.shape[-3] if q.dim() > 2 else 1
    return b, h, q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]


def _mask_bytes(mask, q) -> tuple[int, int]:
    """(bytes of the mask as stored, how many (batch, head) pairs share it)."""
    if mask is None:
        return 0, 1
    lead = mask.shape[:-2] if mask.dim() > 2 else ()
    own = math.prod(lead) if lead else 1
    return mask.numel() * mask.element_size(), max(1, math.prod(q.shape[:-2]) // max(own, 1))


@register_cost(_flash_fwd)
def _(q, k, v, causal, scale, mask=None):
    return flash_attention_cost(*_attn_shape(q, k, v), q.element_size(), causal,
                                mask=_mask_bytes(mask, q))


@register_cost(_flash_bwd)
def _(dout, q, k, v, out, lse, causal, scale, mask=None):
    return flash_attention_cost(*_attn_shape(q, k, v), q.element_size(), causal,
                                backward=True, mask=_mask_bytes(mask, q))


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: float | None = None, attn_mask: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """softmax(q·kᵀ·scale [+ attn_mask] [+ causal mask])·v, as
    `F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=causal, scale=scale)`,
    tiled (Note [Kernel tiling]): one launch forward, one backward, HBM traffic O(seq·d)
    (plus the mask's bytes, if one is given). q, k, v: (..., seq, head_dim), the same
    leading dims; `attn_mask`: additive (float), broadcast to (..., seq_q, seq_k), no
    gradient (one that requires grad is refused)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if attn_mask is not None and attn_mask.requires_grad:
        raise ValueError("flash_attention: attn_mask must not require grad (the kernel "
                         "computes no gradient for it)")
    return _flash_fwd(q.contiguous(), k.contiguous(), v.contiguous(), bool(causal),
                      float(scale), attn_mask)[0]


# -- RMSNorm --------------------------------------------------------------------------------
@_kernel("rms_norm_fwd")
def _rms_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass per row: mean square, reciprocal root, scale by the weight."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.float()).to(x.dtype), rstd.squeeze(-1)


@_rms_fwd.register_fake
def _(x, weight, eps):
    torch._check(weight.dim() == 1 and weight.shape[0] == x.shape[-1],
                 lambda: f"rms_norm: weight of shape {tuple(weight.shape)} does not fit input "
                         f"of shape {tuple(x.shape)} (expected ({x.shape[-1]},))")
    return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)


@_kernel("rms_norm_bwd")
def _rms_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    xf, dyf, w = x.float(), dy.float(), weight.float()
    r = rstd[..., None]
    xhat = xf * r
    g = dyf * w
    dx = r * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dyf * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


@_rms_bwd.register_fake
def _(dy, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


def _rms_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_backward(ctx, dy, drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_bwd(dy.contiguous(), x, weight, rstd)
    return dx, dw, None


_rms_fwd.register_autograd(_rms_backward, setup_context=_rms_setup)


@register_cost(_rms_fwd)
def _(x, weight, eps):
    return rms_norm_cost(x.numel() // max(x.shape[-1], 1), x.shape[-1], x.element_size(),
                         weight.element_size())


@register_cost(_rms_bwd)
def _(dy, x, weight, rstd):
    return rms_norm_cost(x.numel() // max(x.shape[-1], 1), x.shape[-1], x.element_size(),
                         weight.element_size(), backward=True)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(mean(x², -1) + eps) · weight, as `F.rms_norm(x, (n,), weight, eps)`: one
    launch, each row read and written once."""
    return _rms_fwd(x.contiguous(), weight, float(eps))[0]


# -- blockwise MoE MLP ----------------------------------------------------------------------
def _route(logits: torch.Tensor, top_k: int):
    """Mixtral's routing: softmax over experts (float32), top-k, renormalized."""
    p = torch.softmax(logits.float(), -1)
    w, idx = torch.topk(p, top_k, -1)
    return w / w.sum(-1, keepdim=True), idx


def _moe_forward(x, logits, w_gate, w_up, w_down, top_k):
    """Blockwise: per expert, the block of tokens routed to it, its gated MLP, scattered back
    with its routing weight."""
    w, idx = _route(logits, top_k)
    xf = x.float()
    out = torch.zeros_like(xf)
    for e in range(w_gate.shape[0]):
        tok, slot = torch.nonzero(idx == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        xb = xf[tok]
        h = F.silu(xb @ w_gate[e].float().t()) * (xb @ w_up[e].float().t())
        out.index_add_(0, tok, (h @ w_down[e].float().t()) * w[tok, slot, None])
    return out


@_kernel("moe_mlp_fwd")
def _moe_fwd(x: torch.Tensor, router_logits: torch.Tensor, w_gate: torch.Tensor,
             w_up: torch.Tensor, w_down: torch.Tensor, top_k: int) -> torch.Tensor:
    return _moe_forward(x, router_logits, w_gate, w_up, w_down, top_k).to(x.dtype)


@_moe_fwd.register_fake
def _(x, router_logits, w_gate, w_up, w_down, top_k):
    t, d = x.shape
    e, f, d2 = w_gate.shape
    torch._check(x.dim() == 2 and router_logits.shape == (t, e),
                 lambda: f"moe_mlp: router_logits of shape {tuple(router_logits.shape)} does "
                         f"not fit x {tuple(x.shape)} and {e} experts")
    torch._check(d2 == d and w_up.shape == (e, f, d) and w_down.shape == (e, d, f),
                 lambda: f"moe_mlp: expert weights w_gate {tuple(w_gate.shape)}, w_up "
                         f"{tuple(w_up.shape)}, w_down {tuple(w_down.shape)} do not fit "
                         f"d={d} (expected (E, f, d), (E, f, d), (E, d, f))")
    torch._check(0 < top_k <= e, lambda: f"moe_mlp: top_k={top_k} with {e} experts")
    return torch.empty_like(x)


@_kernel("moe_mlp_bwd")
def _moe_bwd(dy: torch.Tensor, x: torch.Tensor, router_logits: torch.Tensor,
             w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, top_k: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward recomputed block by block on the host with its gradients (the routing
    indices are not differentiable; the routing weights are)."""
    with torch.inference_mode(False), torch.enable_grad():
        ins = [t.detach().float().requires_grad_() for t in
               (x, router_logits, w_gate, w_up, w_down)]
        out = _moe_forward(*ins, top_k)
        grads = torch.autograd.grad(out, ins, dy.float(), allow_unused=True)
    return tuple((g if g is not None else torch.zeros_like(t)).to(t.dtype).detach()
                 for g, t in zip(grads, (x, router_logits, w_gate, w_up, w_down)))


@_moe_bwd.register_fake
def _(dy, x, router_logits, w_gate, w_up, w_down, top_k):
    return tuple(torch.empty_like(t) for t in (x, router_logits, w_gate, w_up, w_down))


def _moe_setup(ctx, inputs, output):
    *tensors, top_k = inputs
    ctx.save_for_backward(*tensors)
    ctx.top_k = top_k


def _moe_backward(ctx, dy):
    return _moe_bwd(dy.contiguous(), *ctx.saved_tensors, ctx.top_k) + (None,)


_moe_fwd.register_autograd(_moe_backward, setup_context=_moe_setup)


def _moe_shape(x, w_gate, top_k):
    e, f, d = w_gate.shape
    return x.shape[0], d, f, e, top_k, x.element_size(), w_gate.element_size()


@register_cost(_moe_fwd)
def _(x, router_logits, w_gate, w_up, w_down, top_k):
    return moe_cost(*_moe_shape(x, w_gate, top_k))


@register_cost(_moe_bwd)
def _(dy, x, router_logits, w_gate, w_up, w_down, top_k):
    return moe_cost(*_moe_shape(x, w_gate, top_k), backward=True)


def moe_mlp(x: torch.Tensor, router_logits: torch.Tensor, w_gate: torch.Tensor,
            w_up: torch.Tensor, w_down: torch.Tensor, top_k: int = 2) -> torch.Tensor:
    """A Mixtral-style sparse MoE MLP: each token goes to its `top_k` experts (softmax of
    `router_logits`, top-k, renormalized), each expert `down(silu(gate(x)) * up(x))`, outputs
    summed by routing weight. x: (tokens, d) (or (..., d)); router_logits: (tokens, E);
    w_gate, w_up: (E, f, d); w_down: (E, d, f) (nn.Linear's layout). One launch, routing
    tokens to experts in blocks; each expert's weights read once."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    out = _moe_fwd(x2, router_logits.reshape(x2.shape[0], -1).contiguous(),
                   w_gate.contiguous(), w_up.contiguous(), w_down.contiguous(), int(top_k))
    return out.reshape(shape)


# -- the ATen ops each kernel replaces (tests and benchmarks compare against them) ----------
def attention_reference(q, k, v, causal=False, scale=None):
    """Attention written out in ATen ops: matmul, scale, mask, softmax, matmul."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, -1), v)


def rms_norm_reference(x, weight, eps=1e-6):
    """RMSNorm written out in ATen ops (LLaMA's)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def moe_reference(x, router_logits, w_gate, w_up, w_down, top_k=2):
    """The MoE MLP written out in ATen ops, dense over experts (every expert computes every
    token, weighted by a routing matrix that is zero off the top-k): no data-dependent
    shapes, so it stays on the device in every mode."""
    w, idx = _route(router_logits, top_k)
    dense = torch.zeros(router_logits.shape, dtype=w.dtype, device=x.device).scatter(-1, idx, w)
    h = F.silu(torch.einsum("td,efd->etf", x, w_gate)) * torch.einsum("td,efd->etf", x, w_up)
    y = torch.einsum("etf,edf->etd", h, w_down)
    return torch.einsum("etd,te->td", y, dense.to(x.dtype))


# Note [Substitution] (fusion/substitute.py): the kernels adaptive mode may launch in place of
# the ATen ops they replace
substitute.LIBRARY.update(flash_attention=_flash_fwd._opoverload,
                          flash_attention_bwd=_flash_bwd._opoverload,
                          rms_norm=_rms_fwd._opoverload)
