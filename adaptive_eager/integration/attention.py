"""scaled_dot_product_attention on neuron, computed as CPU computes it.

scaled_dot_product_attention picks its kernel per device type (a C++ dispatch stub a Python
backend cannot fill): CPU runs `_scaled_dot_product_flash_attention_for_cpu` when its checks
pass, any other device the composed math path, whose rounding differs (bf16 greedy decoding
changed tokens). So on neuron the choice is CPU's, asked of CPU tensors of the same layout
that are never written, and the chosen op runs on the device with CPU's kernel, backward
included. What CPU computes by the math path (dropout, a mask that needs grad, 3-D inputs,
or `sdpa_kernel(SDPBackend.MATH)`) is composed here too, as before; so are inputs CPU's
checks refuse, which then raise CPU's errors, and empty ones: sdpa answers those itself, before
any kernel (zeros, kept in the graph through its inputs' sums), where CPU's flash kernel, which
`_fused_sdp_choice` still picks for them, divides by zero heads (SIGFPE, seed 5571). Under
torch.compile the same choice is made for its fake neuron tensors of static shape
(functionalization decomposes the op through `decompose()`, so that is ours too), and the
graph holds CPU's op; with dynamic shapes the graph keeps the math path
(adaptive_eager/LIMITS.md).
"""
from __future__ import annotations

import torch

from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.utils._python_dispatch import _disable_current_modes

from device import COUNTERS

from ..config import config
from ..engine.tensor import NeuronTensor
from ..config import DEVICE_TYPE

_FLASH = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)


_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd


def _math(*args, **kwargs):
    """PyTorch's own decomposition (for a neuron tensor: the math path)."""
    return _SDPA._op_dk(_COMPOSITE, *args, **kwargs)


def _ours(t) -> bool:
    """A neuron tensor, or torch.compile's stand-in for one (fake, functional) of static
    shape: its graph then holds CPU's op, not the math path's."""
    if type(t) is NeuronTensor:
        return True
    return (type(t) in (FakeTensor, FunctionalTensor) and t.device.type == DEVICE_TYPE
            and not any(isinstance(n, torch.SymInt) for n in (*t.shape, *t.stride())))


def _decompose(*args, **kwargs):
    """What `decompose()` runs for sdpa (torch.compile's functionalization and tracing
    decompose it where autograd's key is skipped, as in an inference graph): for neuron
    tensors our kernel, PyTorch's otherwise."""
    return (sdpa if _ours(args[0]) else _math)(*args, **kwargs)


def register() -> None:
    if _COMPOSITE not in _SDPA.py_kernels:
        _SDPA.py_impl(_COMPOSITE)(_decompose)


def _cpu_choice(args, kwargs) -> int:
    """CPU's kernel choice for these inputs, asked of real CPU stand-ins outside any mode
    (under torch.compile's fake mode CPU's check answers the math path)."""
    with _disable_current_modes():
        return torch.ops.aten._fused_sdp_choice(
            *[None if t is None else _stand_in(t) for t in args[:4]], *args[4:], **kwargs)


def _stand_in(t):
    """A CPU tensor with `t`'s layout, dtype and requires_grad, never read or written."""
    s = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    return s.requires_grad_() if t.requires_grad else s


def _substitutable(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> bool:
    """Note [Substitution] in fusion/substitute.py, above autograd: in adaptive mode with
    ADAPTIVE_EAGER_SUBSTITUTE=1, sdpa runs as the kernel library's flash_attention (its own
    backward) where CPU would take the math path (composed ATen ops; where it takes its flash
    kernel the device already runs one fused op of the same modeled traffic, and a kernel's
    launch of its own would only cost) and the kernel computes the same: neuron tensors (not torch.compile's), float32,
    no dropout, no GQA, the same leading dims, a mask (float or bool) needing no grad and not
    combined with is_causal (SDPA refuses that)."""
    if not config.substitute or type(query) is not NeuronTensor:
        return False
    tensors = (query, key, value) if attn_mask is None else (query, key, value, attn_mask)
    return (query._engine.is_lazy() and all(type(t) is NeuronTensor for t in tensors)
            and dropout_p == 0.0 and not enable_gqa and query.dim() >= 2
            and all(t.dtype == torch.float32 and t.device == query.device
                    for t in (query, key, value))
            and query.dim() == key.dim() == value.dim()
            and query.shape[:-2] == key.shape[:-2] == value.shape[:-2]
            and query.shape[-1] == key.shape[-1] and key.shape[-2] == value.shape[-2]
            and (attn_mask is None or (not is_causal and not attn_mask.requires_grad
                                       and attn_mask.dtype in (torch.bool, torch.float32)
                                       and attn_mask.device == query.device)))


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
         enable_gqa=False):
    args = (query, key, value, attn_mask, dropout_p, is_causal)
    kwargs = {"scale": scale, "enable_gqa": enable_gqa}
    if _substitutable(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) and (
            _cpu_choice(args, kwargs) != _FLASH):
        from . import kernels
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # CPU's conversion
            attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(
                attn_mask.logical_not(), float("-inf"))
        COUNTERS.substitutions["aelib::flash_attention_fwd (sdpa)"] += 1
        return kernels.flash_attention(query, key, value, causal=is_causal, scale=scale,
                                       attn_mask=attn_mask)
    args = (query, key, value, attn_mask, dropout_p, is_causal)
    kwargs = {"scale": scale, "enable_gqa": enable_gqa}
    tensors = (query, key, value) if attn_mask is None else (query, key, value, attn_mask)
    if any(not _ours(t) or t.device != query.device for t in tensors) or any(
            t.numel() == 0 for t in (query, key, value)) or (
            attn_mask is not None
            and attn_mask.dtype not in (torch.bool, torch.float32, query.dtype)) or (
            _cpu_choice(args, kwargs) != _FLASH):
        return _math(*args, **kwargs)
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # CPU's conversion
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(
            attn_mask.logical_not(), float("-inf"))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
