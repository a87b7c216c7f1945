"""scaled_dot_product_attention on neuron, computed as CPU computes it.

scaled_dot_product_attention picks its kernel per device type (a C++ dispatch stub a Python
backend cannot fill): CPU runs `_scaled_dot_product_flash_attention_for_cpu` when its checks
pass, any other device the composed math path, whose rounding differs (bf16 greedy decoding
changed tokens). So on neuron the choice is CPU's, asked of CPU tensors of the same layout
that are never written, and the chosen op runs on the device with CPU's kernel, backward
included. What CPU computes by the math path (dropout, a mask that needs grad, 3-D inputs,
or `sdpa_kernel(SDPBackend.MATH)`) is composed here too, as before; so are inputs CPU's
checks refuse, which then raise CPU's errors.
"""
from __future__ import annotations

import torch

from ._tensor import NeuronTensor

_FLASH = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)


def _stand_in(t):
    """A CPU tensor with `t`'s layout, dtype and requires_grad, never read or written."""
    s = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    return s.requires_grad_() if t.requires_grad else s


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
         enable_gqa=False):
    args = (query, key, value, attn_mask, dropout_p, is_causal)
    kwargs = {"scale": scale, "enable_gqa": enable_gqa}
    tensors = (query, key, value) if attn_mask is None else (query, key, value, attn_mask)
    if any(type(t) is not NeuronTensor or t.device != query.device for t in tensors) or (
            attn_mask is not None
            and attn_mask.dtype not in (torch.bool, torch.float32, query.dtype)) or (
            torch.ops.aten._fused_sdp_choice(*[None if t is None else _stand_in(t)
                                               for t in args[:4]], *args[4:], **kwargs)
            != _FLASH):
        return torch.ops.aten.scaled_dot_product_attention.default.decompose(*args, **kwargs)
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # CPU's conversion
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(
            attn_mask.logical_not(), float("-inf"))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
