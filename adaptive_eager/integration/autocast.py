"""torch.autocast(device_type="neuron"): CUDA's policy, op for op.

PyTorch registers no kernel for the AutocastPrivateUse1 key (C++ backends use the lists and
macros of ATen/autocast_mode.h), so without ours every op would fall through and run in its
input dtype. The lists below are CUDA's (`AT_FORALL_*` in torch 2.13's autocast_mode.h): a
user porting GPU code gets the dtypes CUDA gives. Lower-precision ops run in the autocast
dtype (BF16 by default: Neuron's native low precision), the fp32 list (losses, norms,
softmax, exp, ...) in float32, the promote list in the widest input dtype, and
binary_cross_entropy is refused as on CUDA. A tensor is cast only if it is a floating neuron
tensor other than float64 (C++'s `is_eligible`, torch.amp's `_cast`).

Note [Autocast cast cache]: as C++'s `cached_cast`, the low-precision copy of a float32 leaf
that requires grad (a weight) is made once and reused until the outermost autocast region
exits (`torch.clear_autocast_cache`), unless `cache_enabled=False`. This is a semantic, not
only a saving: an optimizer step inside the region leaves later forwards on the cached copy,
as on CPU and CUDA (a training loop written inside one region trained differently before).
"""
from __future__ import annotations

import collections.abc
import weakref

import torch
from torch.amp.autocast_mode import _cast  # C++'s eligibility: device, floating, not float64
from torch.utils._pytree import tree_flatten

from .. import patches
from ..config import DEVICE_TYPE as DEVICE

_KEYSET = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

# (op, overload) as AT_FORALL_LOWER_PRECISION_FP (CUDA adds its cudnn_* ops).
LOW = ["_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
       "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
       "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot",
       "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
       "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
       "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention",
       "scaled_dot_product_attention"]
FP32 = ["acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
        "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
        "pow.Scalar", "softplus", "layer_norm", "native_layer_norm", "rms_norm", "group_norm",
        "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
        "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
        "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
        "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
        "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
        "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d",
        "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
        "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d",
        "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d",
        "upsample_bicubic2d", "_upsample_bicubic2d_aa"]
FP32_SET_OPT_DTYPE = ["prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod",
                      "cumsum", "linalg_vector_norm", "linalg_matrix_norm",
                      "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList"]
FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype",
                     "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
PROMOTE = ["addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
           "index_put", "tensordot", "scatter_add"]


def _overload(qualname):
    name, _, ov = qualname.partition(".")
    return getattr(getattr(torch.ops.aten, name), ov or "default")


def _eligible(t):
    return (isinstance(t, torch.Tensor) and t.device.type == DEVICE
            and t.is_floating_point() and t.dtype is not torch.float64)


# Note [Autocast cast cache]: id(leaf) -> (weakref to the leaf, its low-precision copy)
_CACHE: dict[int, tuple] = {}


def _cast_low(value, dt):
    """torch.amp's `_cast` to the low-precision dtype `dt`, through the cast cache."""
    if isinstance(value, torch.Tensor):
        if not _eligible(value) or value.dtype is dt:
            return value
        if (value.dtype is torch.float32 and value.requires_grad and value.is_leaf
                and not value._is_view() and torch.is_autocast_cache_enabled()):
            hit = _CACHE.get(id(value))
            if hit is not None and hit[0]() is value:
                return hit[1]
            out = value.to(dt)
            _CACHE[id(value)] = (weakref.ref(value), out)
            return out
        return value.to(dt)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_low(v, dt) for v in value)
    if isinstance(value, collections.abc.Mapping):
        return {k: _cast_low(v, dt) for k, v in value.items()}
    return value


def _clearing(clear):
    def clear_autocast_cache():
        _CACHE.clear()
        return clear()
    clear_autocast_cache.__doc__ = clear.__doc__
    return clear_autocast_cache


def _low(op):
    def k(*args, **kwargs):
        dt = torch.get_autocast_dtype(DEVICE)
        with torch._C._ExcludeDispatchKeyGuard(_KEYSET):
            return op(*_cast_low(args, dt), **_cast_low(kwargs, dt))
    return k


def _fp32(op):
    def k(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_KEYSET):
            return op(*_cast(args, DEVICE, torch.float32), **_cast(kwargs, DEVICE, torch.float32))
    return k


def _fp32_set_opt_dtype(op):
    idx = [a.name for a in op._schema.arguments].index("dtype")
    def k(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_KEYSET):
            if _eligible(args[0]):  # respect an explicit dtype, else compute/return in fp32
                if len(args) > idx:
                    if args[idx] is None:
                        args = args[:idx] + (torch.float32,) + args[idx + 1:]
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)
    return k


def _fp32_append_dtype(target):
    def k(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_KEYSET):
            out = torch.float32 if _eligible(args[0]) else args[0].dtype
            return target(*args, dtype=out, **kwargs)
    return k


def _promote(op):
    def k(*args, **kwargs):
        low = dt = torch.get_autocast_dtype(DEVICE)
        for t in tree_flatten((args, kwargs))[0]:  # CUDA's prioritize
            if not _eligible(t) or t.dtype == torch.float64:
                continue
            if dt == torch.float32 or t.dtype == torch.float32:
                dt = torch.float32
            elif t.dtype != low:  # float16 under bfloat16 autocast, or the other way
                raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
        with torch._C._ExcludeDispatchKeyGuard(_KEYSET):
            if dt == low:  # C++ caches casts to the low-precision dtype only
                return op(*_cast_low(args, dt), **_cast_low(kwargs, dt))
            return op(*_cast(args, DEVICE, dt), **_cast(kwargs, DEVICE, dt))
    return k


def _banned(*a, **k):
    raise RuntimeError(  # CUDA's words
        "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to "
        "autocast.\nMany models use a sigmoid layer right before the binary cross entropy "
        "layer.\nIn this case, combine the two layers using "
        "torch.nn.functional.binary_cross_entropy_with_logits\nor torch.nn.BCEWithLogitsLoss."
        "  binary_cross_entropy_with_logits and BCEWithLogits are\nsafe to autocast.")


def register(libs: list) -> None:
    """The kernels (kept alive in `libs`) and the default dtype, BF16."""
    key = "AutocastPrivateUse1"
    fallthrough = torch.library.Library("_", "IMPL")  # torch registers none for this key
    fallthrough.fallback(torch.library.fallthrough_kernel, key)
    lib = torch.library.Library("aten", "IMPL")
    for names, wrap in ((LOW, _low), (FP32, _fp32), (FP32_SET_OPT_DTYPE, _fp32_set_opt_dtype),
                        (PROMOTE, _promote)):
        for q in names:
            lib.impl(q, wrap(_overload(q)), key)
    for q, target in FP32_APPEND_DTYPE.items():
        lib.impl(q, _fp32_append_dtype(_overload(target)), key)
    lib.impl("binary_cross_entropy", _banned, key)
    libs.extend([fallthrough, lib])
    torch.set_autocast_dtype(DEVICE, torch.bfloat16)
    patches.patch(torch, "clear_autocast_cache", wrap=_clearing,
                  rests_on="autocast's exit calling torch.clear_autocast_cache: our cast "
                           "cache is cleared with PyTorch's")
