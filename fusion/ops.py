"""The one table of op classes: which ATen ops the simulated device implements, and how.

Classes: view (free), pointwise, reduction, contraction, indexing (gather/scatter/data
movement), random, barrier (data-dependent output shapes: they force a sync). An op with no
class has no device implementation and runs on CPU (see adaptive_eager's fallback).
"""
from __future__ import annotations

import functools
import math

import torch

from .kernels import body, is_kernel

aten = torch.ops.aten

VIEW, POINTWISE, REDUCTION, CONTRACTION, INDEXING, RANDOM, BARRIER = (
    "view", "pointwise", "reduction", "contraction", "indexing", "random", "barrier")
KERNEL = "kernel"  # a user's custom op with a neuron kernel (Note [Custom kernels])
INPLACE_VIEW = "inplace_view"  # squeeze_, t_, as_strided_, resize_...: metadata only

_CONTRACTION = {
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "addr",
    "convolution", "convolution_backward", "_convolution", "matmul", "linear", "outer",
    "_addmm_activation", "tensordot", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "mkldnn_rnn_layer_backward", "_trilinear", "_native_multi_head_attention",
    "_transformer_encoder_layer_fwd", "conv_tbc", "affine_grid_generator",
    "_grouped_mm",  # MoE experts (Transformers' default `grouped_mm` experts): CPU's kernel
    "_int_mm", "_weight_int8pack_mm",  # int8 matmuls (torchao's quantized linear layers)
    "_scaled_mm", "_scaled_mm_v2",  # float8 matmuls
}
# Note [Linear algebra on the device]: LAPACK's factorizations and solves and the FFTs run
# CPU's kernels on the device, so CPU's values bit for bit; they are contractions (a group
# holds a few, with their pointwise epilogues, in queue order: fusion changes no value).
# Three things CPU does that a queued op would not:
# - errors on values: `linalg.inv`, `solve`, `cholesky`, `lu_factor`, `ldl_factor` return an
#   `info` tensor that `_linalg_check_errors` reads, raising `torch.linalg.LinAlgError` in
#   CPU's words (a singular matrix); eigh, svd, eig, pinv raise inside their kernels (no
#   convergence on a NaN). Those ops (`_LINALG_CHECKED`) run at once, as barriers: CPU's
#   error raises at the call in eager and adaptive mode alike (a `try` around the call catches
#   it, as on CPU), as CUDA's checks synchronize the host. A queued op's error would surface
#   at a later sync as a NeuronRuntimeError.
# - layouts: LAPACK's results are column-major, and for structured kernels (inv, solve,
#   cholesky, lu, qr, det...) the meta kernel is CPU's own; the FFTs' CPU kernel lays its
#   output out by its plan (MKL's, batch dims ordered by the input's strides), unlike their
#   meta kernels, and `_linalg_svd` / `linalg_eig`'s meta kernels lay out some results unlike
#   CPU's (these two are barriers anyway: a barrier's results keep CPU's layouts). So every op
#   here is checked by the CPU probe (Note [CPU probe]), which mm's kind skips; an FFT too big
#   to probe takes CPU's fake kernel's layout (Note [Layouts of unprobed signatures]).
# - complex results (eig, the FFTs) are plain complex buffers: nothing special.
_LINALG = {
    "linalg_inv_ex", "_linalg_solve_ex", "linalg_cholesky_ex", "linalg_lu_factor_ex",
    "linalg_lu", "linalg_lu_solve", "lu_unpack", "_linalg_det", "_linalg_slogdet", "linalg_qr",
    "geqrf", "ormqr", "linalg_householder_product", "triangular_solve", "linalg_solve_triangular",
    "cholesky_solve", "_cholesky_solve_helper", "linalg_matrix_exp", "linalg_ldl_factor_ex",
    "linalg_ldl_solve",
}
_FFT = {"_fft_c2c", "_fft_r2c", "_fft_c2r"}


def linalg_flops(func, args, kwargs) -> float | None:
    """The FLOPs of a linear algebra or FFT op for the cost model (torch's flop counter has
    no formula for them), or None for other ops. Assumption: the textbook operation counts
    (LAPACK Working Note 41; 5 N log2 n for an FFT), per matrix of the batch, four times
    over for complex; they depend on the inputs' shapes only (a barrier's are not known
    before it runs)."""
    name = func.overloadpacket.__name__
    form = _LINALG_FLOPS.get(name)
    if form is None:
        return None
    a = args[0] if args else next(iter(kwargs.values()), None)
    if not isinstance(a, torch.Tensor) or a.dim() == 0:
        return None
    if name in _FFT:
        dims = args[1] if len(args) > 1 else kwargs.get("dim", ())
        n = [a.shape[d] for d in dims] or [1]
        return form * a.numel() * sum(math.log2(max(k, 2)) for k in n)
    m, n = (a.shape[-2], a.shape[-1]) if a.dim() > 1 else (a.shape[-1], 1)
    b = next((x for x in args[1:] if isinstance(x, torch.Tensor) and x.dim() > 1), None)
    k = b.shape[-1] if b is not None else n
    lo, hi = min(m, n), max(m, n)
    batch = a.numel() // max(m * n, 1)
    return batch * form(hi, lo, k) * (4 if a.is_complex() else 1)


# FLOPs per matrix, of (the larger dim, the smaller, the right-hand side's columns); the FFTs'
# factor of N log2 n (a real transform is half a complex one).
_LINALG_FLOPS = {
    "linalg_inv_ex": lambda m, n, k: 2 * n ** 3,
    "_linalg_solve_ex": lambda m, n, k: 2 * n ** 3 / 3 + 2 * n * n * k,
    "linalg_cholesky_ex": lambda m, n, k: n ** 3 / 3, "cholesky": lambda m, n, k: n ** 3 / 3,
    "linalg_ldl_factor_ex": lambda m, n, k: n ** 3 / 3,
    "linalg_lu_factor_ex": lambda m, n, k: m * n * n - n ** 3 / 3,
    "linalg_lu": lambda m, n, k: m * n * n - n ** 3 / 3,
    "_linalg_det": lambda m, n, k: 2 * n ** 3 / 3, "_linalg_slogdet": lambda m, n, k: 2 * n ** 3 / 3,
    "linalg_lu_solve": lambda m, n, k: 2 * n * n * k, "lu_unpack": lambda m, n, k: m * n,
    "linalg_ldl_solve": lambda m, n, k: 2 * n * n * k,
    "cholesky_solve": lambda m, n, k: 2 * n * n * k,
    "_cholesky_solve_helper": lambda m, n, k: 2 * n * n * k,
    "triangular_solve": lambda m, n, k: n * n * k,
    "linalg_solve_triangular": lambda m, n, k: n * n * k,
    "cholesky_inverse": lambda m, n, k: n ** 3,
    "geqrf": lambda m, n, k: 2 * m * n * n - 2 * n ** 3 / 3,
    "linalg_qr": lambda m, n, k: 4 * m * n * n - 4 * n ** 3 / 3,
    "linalg_householder_product": lambda m, n, k: 4 * m * n * n - 4 * n ** 3 / 3,
    "ormqr": lambda m, n, k: 4 * m * n * k,
    "linalg_matrix_exp": lambda m, n, k: 16 * n ** 3,  # ~8 products (Pade, squaring)
    "_linalg_eigh": lambda m, n, k: 9 * n ** 3,  # (4/3 n^3 without vectors)
    "_linalg_svd": lambda m, n, k: 4 * m * n * n + 8 * n ** 3,
    "linalg_pinv": lambda m, n, k: 4 * m * n * n + 8 * n ** 3,
    "linalg_eig": lambda m, n, k: 25 * n ** 3, "_linalg_eigvals": lambda m, n, k: 10 * n ** 3,
    "_fft_c2c": 5.0, "_fft_r2c": 2.5, "_fft_c2r": 2.5,
}
_CONTRACTION |= _LINALG | _FFT
# Contractions whose meta layout is not CPU's, so probed whatever their dtypes (the probe,
# Note [CPU probe] in adaptive_eager/engine/meta.py, skips other contractions of one dtype,
# mm's kind, whose layouts meta gets right): convolutions keep their input's memory format
# (channels_last) on CPU, which meta does not; the transformer fast path's layer on a
# non-contiguous input (norm_first) is contiguous on CPU, while its meta output follows the
# input's strides; LAPACK's and the FFTs' CPU kernels lay out unlike some meta kernels
# (Note [Linear algebra on the device]); `_grouped_mm`'s meta kernel is CUDA's
# (adaptive_eager/engine/meta.py `_META_AS_CPU`).
PROBED = frozenset(f"aten::{n}" for n in (
    "convolution", "_convolution", "convolution_backward", "conv_tbc",
    "_transformer_encoder_layer_fwd", "_grouped_mm", *_LINALG, *_FFT))
_REDUCTION = {
    "sum", "mean", "amax", "amin", "max", "min", "aminmax", "var", "std", "var_mean",
    "std_mean", "prod", "norm", "linalg_vector_norm", "argmax", "argmin", "logsumexp",
    "_softmax", "_log_softmax", "_safe_softmax", "_softmax_backward_data",
    "_log_softmax_backward_data",
    "softmax", "log_softmax",  # (their `int_out` overloads: the rest is decomposed above us)
    "native_layer_norm", "native_layer_norm_backward", "native_batch_norm",
    "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit_functional", "native_batch_norm_backward", "native_group_norm",
    "_batch_norm_with_update", "_batch_norm_with_update_functional", "_batch_norm_no_update",
    "batch_norm_backward",
    "native_group_norm_backward", "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward",
    "nll_loss2d_backward", "cumsum", "cumprod", "all", "any", "_foreach_norm", "mse_loss",
    "mse_loss_backward", "binary_cross_entropy", "binary_cross_entropy_backward",
    "count_nonzero", "nansum", "logcumsumexp", "cummax", "cummin", "_cdist_forward",
    "smooth_l1_loss", "huber_loss", "l1_loss", "kl_div", "soft_margin_loss", "renorm",
    "_weight_norm_interface", "rms_norm", "_fused_rms_norm", "_fused_rms_norm_backward",
    "_masked_softmax", "_masked_softmax_backward", "_cdist_backward", "_pdist_backward",
    "_ctc_loss_backward", "_is_all_true", "_is_any_true",
    "median", "nanmedian", "mode", "kthvalue", "topk", "sort", "msort", "argsort",
    "_foreach_max", "trace", "_euclidean_dist", "dist", "binary_cross_entropy_with_logits",
    "multi_margin_loss", "multilabel_margin_loss", "multilabel_margin_loss_forward",
    "hash_tensor", "segment_reduce", "_segment_reduce_backward",
}  # (the Inductor executors compile these with corrected decompositions: fusion/decomps.py)
_INDEXING = {
    "index", "index_select", "gather", "scatter", "scatter_add", "scatter_reduce", "index_put",
    "_index_put_impl", "index_add", "index_copy", "index_fill", "embedding",
    "embedding_dense_backward", "cat", "stack", "constant_pad_nd", "repeat", "flip", "roll",
    "tril", "triu", "max_pool2d_with_indices", "max_pool2d_with_indices_backward",
    "avg_pool2d", "avg_pool2d_backward", "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward",
    "reflection_pad1d", "reflection_pad2d", "replication_pad1d", "replication_pad2d",
    "upsample_nearest2d", "upsample_bilinear2d", "im2col", "col2im", "take", "take_along_dim",
    "masked_scatter", "diag_embed", "diagonal_backward", "select_backward", "slice_backward",
    "grid_sampler_2d", "grid_sampler_2d_backward", "grid_sampler_3d", "grid_sampler_3d_backward",
    "as_strided_scatter", "select_scatter", "slice_scatter", "diagonal_scatter", "new_zeros",
    "new_empty", "new_empty_strided", "new_full", "new_ones", "empty_like", "zeros_like",
    "ones_like", "full_like", "fill", "unfold_backward", "_to_copy", "copy", "copy_",
    "index_reduce", "searchsorted", "bucketize", "isin", "max_pool1d", "max_pool3d_with_indices",
    "avg_pool1d", "avg_pool3d", "pixel_shuffle", "pixel_unshuffle", "channel_shuffle",
    "_unsafe_index", "_unsafe_index_put", "glu", "glu_backward", "_pdist_forward",
    "histc", "histogram", "_histogramdd_bin_edges", "_histogramdd_from_bin_cts",
    "_histogramdd_from_bin_tensors",  # (no meta kernel in PyTorch: meta.py `_META_AS_CPU`)
    "bincount", "eye", "tril_indices", "triu_indices", "linspace", "logspace",
    "arange", "range", "zeros", "ones", "full", "scalar_tensor", "_foreach_copy",
    "_embedding_bag_backward", "_embedding_bag_dense_backward",
    "_embedding_bag_per_sample_weights_backward",
    # FSDP2's copy-out of an all-gather and copy-in of a reduce-scatter:
    "split_with_sizes_copy", "_chunk_cat",
    # (each fell back to the CPU: found by a scan of every aten op with a CPU kernel)
    "block_diag", "put", "nonzero_static", "native_channel_shuffle", "embedding_renorm",
    "_unsafe_masked_index", "_unsafe_masked_index_put_accumulate",
}
# torch.optim's fused steps (`fused=True`; Trainer's default `adamw_torch_fused`): one op
# updating every parameter, gradient and state list in place, elementwise, run with CPU's
# kernel (its values bit for bit).
_FUSED_OPTIMIZERS = {"_fused_adam", "_fused_adamw", "_fused_sgd", "_fused_adagrad"}
FUSED_OPTIMIZER_PREFIXES = tuple(f"aten::{n}_" for n in sorted(_FUSED_OPTIMIZERS))
# GradScaler's steps (`unscale_`, `update`): a check of every gradient for inf/NaN with their
# unscaling in place, and the scale's update, both run with CPU's kernel.
_AMP = {"_amp_foreach_non_finite_check_and_unscale", "_amp_update_scale"}
# Ops the schema marks as views but that need to touch data on our device, or are not
# views in the schema but are views on CPU (so must share the buffer to keep CPU semantics).
_VIEW_EXTRA = {"_unsafe_view", "unsafe_split", "unsafe_split_with_sizes"}
_RANDOM_EXTRA = {"native_dropout", "rand_like", "randn_like", "randint_like", "randperm"}
# Ops whose CPU kernel raises on the values it is given, run at once so at the call
# (Note [Linear algebra on the device]); `cholesky` and `cholesky_inverse` check inside too.
_LINALG_CHECKED = {"_linalg_check_errors", "_linalg_eigh", "_linalg_svd", "linalg_eig",
                   "_linalg_eigvals", "linalg_eigvals", "linalg_pinv", "cholesky",
                   "cholesky_inverse"}
# Output shapes only execution tells, untagged: oneDNN's LSTM layer sizes its workspace itself
# (the meta kernel says 0 bytes); CPU's embedding_bag sizes its bookkeeping outputs (offset2bag,
# bag_size, max_indices) by the path its kernel takes, not as the meta kernel does.
_BARRIER_EXTRA = {"mkldnn_rnn_layer", "_embedding_bag", "_embedding_bag_forward_only",
                  *_LINALG_CHECKED}
# Ops that read only their first argument's layout, never its values (Note [Poison] in
# program.py: a poisoned input does not poison what they make).
LAYOUT_ONLY = frozenset(f"aten::{n}" for n in (
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
    "randint_like", "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full"))

# Ops whose meta or fake kernel lays out or shapes its results by the device's type, and gives
# a device other than the CPU (or a meta tensor: `device_hint` defaults to "cuda") an answer
# unlike CPU's kernel's, which is what the device runs. The device takes CPU's fake kernel's
# answer for them in two places, each adding ops of its own: graphs traced on the device
# (Note [Fake layouts of the device] in adaptive_eager/integration/fake_layouts.py) and
# signatures too big for the CPU probe (Note [Layouts of unprobed signatures] in
# adaptive_eager/engine/meta.py).
LAID_OUT_BY_DEVICE_TYPE = tuple(
    getattr(getattr(aten, op), overload) for op, overload in (
        ("convolution", "default"), ("_convolution", "default"),
        ("_convolution", "deprecated"), ("convolution_backward", "default"),
        ("pixel_shuffle", "default"), ("nonzero_static", "default"),
        ("_embedding_bag", "default"), ("_embedding_bag_forward_only", "default"),
        ("_fft_c2c", "default"))
    if hasattr(getattr(aten, op, None), overload))


def op_class(func: torch._ops.OpOverload) -> str | None:
    """The class of an ATen op on our device, or None when the device lacks it (CPU fallback).
    Ops of other namespaces (custom ops, prims) are not the device's, whatever their tags,
    unless they have a kernel for the device (Note [Custom kernels] in fusion/kernels.py):
    asked each time, not cached, since a neuron kernel may be registered after a first call."""
    if func.namespace != "aten":
        return KERNEL if is_kernel(func) else None
    return _aten_class(func)


@functools.lru_cache(maxsize=None)
def _aten_class(func: torch._ops.OpOverload) -> str | None:
    name = func.overloadpacket.__name__
    base = name.rstrip("_") if not name.startswith("_") else "_" + name[1:].rstrip("_")
    tags = func.tags
    if torch.Tag.inplace_view in tags or name == "resize_":
        return INPLACE_VIEW
    if func.is_view or name in _VIEW_EXTRA:
        return VIEW
    if base == "index":  # tagged dynamic for a boolean mask's count; with integer indices
        return INDEXING  # the shape is static: the meta cache decides per signature
    if (torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags
            or base in _BARRIER_EXTRA):
        return BARRIER
    if torch.Tag.nondeterministic_seeded in tags or base in _RANDOM_EXTRA or any(
            a.type.kind() == "OptionalType" and "Generator" in str(a.type)
            for a in func._schema.arguments):
        return RANDOM
    if base in _CONTRACTION:
        return CONTRACTION
    if torch.Tag.reduction in tags or base in _REDUCTION:
        return REDUCTION
    if base in _FUSED_OPTIMIZERS or base in _AMP:  # elementwise over lists, as the foreach ops
        return POINTWISE
    if torch.Tag.pointwise in tags or base.startswith("_foreach_") or base in {
            "clone", "fill", "zero", "masked_fill", "where", "lerp", "clamp", "clamp_min",
            "clamp_max", "addcmul", "addcdiv", "_foreach_copy", "sign", "logical_not",
            "rsub", "hardswish", "log_sigmoid_forward", "_prelu_kernel", "floor_divide",
            "polar", "complex", "log_sigmoid_backward", "rrelu_with_noise_backward",
            "_add_relu"}:
        return POINTWISE
    if base in _INDEXING or base.startswith(_INDEXING_PREFIXES):
        return INDEXING
    if base.endswith("_copy") and not base.startswith("_nested") \
            and _aten_forward(base[:-len("_copy")]) == VIEW:
        return INDEXING  # a view's value as a new tensor (`diagonal_copy`: torch.diag's backward)
    if base.endswith("_backward"):  # a pointwise op's backward is pointwise, an indexing op's
        forward = _aten_forward(base[:-len("_backward")])  # indexing, a reduction's reduction
        if forward is not None and forward in (POINTWISE, INDEXING, REDUCTION):
            return forward
    # An in-place or out= overload PyTorch left untagged (`gelu_`, `gelu.out`, `mish_`,
    # `softshrink.out`, `threshold_`, `eq_.Scalar`, `copysign_.Tensor`, `__irshift__.Scalar`):
    # the class of its functional form (the same kernel)
    functional = _functional_form(name, base, func._overloadname)
    if functional is not None and functional is not func:
        cls = _aten_class(functional)
        if cls in (POINTWISE, REDUCTION):
            return cls
    return None


def _functional_form(name: str, base: str, overload: str):
    """The functional overload of the in-place or out= overload `name.overload`, or None:
    the overload of the same name (`eq_.Scalar` -> `eq.Scalar`, `add.Scalar_out` ->
    `add.Scalar`), else the default one (`gelu_.default`, `gelu.out` -> `gelu.default`)."""
    if name.startswith("__i") and name.endswith("__"):  # `x >>= 1`: __irshift__ -> __rshift__
        base = "__" + name[3:]
    elif name == base and not overload.endswith("out"):
        return None  # a functional overload itself
    packet = getattr(torch.ops.aten, base, None)
    if packet is None:
        return None
    names = packet.overloads()
    for ov in (overload, overload.removesuffix("_out").removesuffix("out"), "default"):
        if ov in names and (ov != overload or base != name):
            return getattr(packet, ov)
    return None


# Sampling, pooling and padding families whose every member (1-3d, backward, `_aa`) is CPU's
# kernel over indices: interpolate's modes, adaptive max pooling, reflection and replication.
_INDEXING_PREFIXES = ("upsample_", "_upsample_", "reflection_pad", "replication_pad",
                      "adaptive_max_pool", "_adaptive_avg_pool", "fractional_max_pool",
                      "max_unpool", "max_pool3d_with_indices", "avg_pool3d", "rot90",
                      "linalg_cross")


def _aten_forward(name: str) -> str | None:
    """The class of forward op `name` (its default overload, else its first), if it exists."""
    packet = getattr(torch.ops.aten, name, None)
    if packet is None or not packet.overloads():
        return None
    ov = "default" if "default" in packet.overloads() else packet.overloads()[0]
    return _aten_class(getattr(packet, ov))


# PyTorch's own custom ops (torch.library.custom_op) whose one kernel, CompositeExplicitAutograd,
# is written in torch ops for any device, as CUDA runs it: F.linear_cross_entropy's chunked
# path (`options=`). Their ops are the device's (a custom op without a neuron kernel falls back
# to the CPU otherwise: a user's may do anything in Python).
_COMPOSITE_CUSTOM_OPS = frozenset({
    "torch_nn::_linear_cross_entropy_batch_chunked",
    "torch_nn::_linear_cross_entropy_batch_chunked_no_reduction"})


@functools.lru_cache(maxsize=None)
def composite_key(func: torch._ops.OpOverload):
    """PyTorch decomposes `func` above the backend (CompositeImplicitAutograd) unless the
    backend has its own kernel: such an op reaches the device whole only where autograd's key
    is skipped (inference mode, inference tensors). The key of the kernel that runs it then:
    the backend's own autograd kernel where one is registered, else the decomposition. For
    `_COMPOSITE_CUSTOM_OPS`, which always reach the device whole, their composite kernel's
    key. None for every other op."""
    name, has = func.name(), torch._C._dispatch_has_kernel_for_dispatch_key
    if name in _COMPOSITE_CUSTOM_OPS and not has(name, "PrivateUse1"):
        return torch._C.DispatchKey.CompositeExplicitAutograd
    if not has(name, "CompositeImplicitAutograd") or has(name, "PrivateUse1"):
        return None
    if has(name, "AutogradPrivateUse1"):
        return torch._C.DispatchKey.AutogradPrivateUse1
    return torch._C.DispatchKey.CompositeImplicitAutograd


def _histc(self, bins=100, min=0, max=0):
    """CUDA's histc counts integer tensors too (bounds truncated to integers, bins by
    integer division); CPU's kernel takes floating point only. Integers through float64
    fall in the same bins (exact below 2**53)."""
    if self.is_floating_point() or self.dtype is torch.bool:
        return aten.histc.default(self, bins, min, max)
    return aten.histc.default(self.double(), bins, int(min), int(max)).to(self.dtype)


def _div_mode(func):
    """CPU's integer division with a rounding mode traps (SIGFPE: the process dies) on
    INT_MIN / -1; CUDA's returns INT_MIN, the quotient wrapped as -INT_MIN wraps. The device
    follows CUDA: divisors of -1 give the negated dividend, every other one CPU's kernel."""
    def kernel(a, b, *args, **kwargs):
        if torch.result_type(a, b).is_floating_point or torch.result_type(a, b).is_complex:
            return func(a, b, *args, **kwargs)
        minus1 = b == -1
        if not isinstance(b, torch.Tensor):  # a Scalar divisor
            if not minus1:
                return func(a, b, *args, **kwargs)
            negated = a.neg()  # before an in-place division overwrites a
            return func(a, 1, *args, **kwargs).copy_(negated)
        if not bool(minus1.any()):
            return func(a, b, *args, **kwargs)
        negated = a.neg()
        out = func(a, torch.where(minus1, 1, b), *args, **kwargs)
        return out.copy_(torch.where(minus1, negated, out))
    return kernel


def _onednn_lstm_layer(*args, **kwargs):
    """oneDNN's LSTM layer keeps a workspace (its backward's input) only under grad mode, and
    the device runs ops with grad mode off: on, so a backward always finds it (the values
    are the same either way; the op runs at once, so its outputs need no meta shapes)."""
    with torch.enable_grad():
        return aten.mkldnn_rnn_layer.default(*args, **kwargs)


_DIV_MODES = [aten.div.Tensor_mode, aten.div.Scalar_mode, aten.div_.Tensor_mode,
              aten.div_.Scalar_mode, aten.div.out_mode]
# The device's kernel where CPU's refuses what CUDA's takes, or traps (the device follows CUDA).
_KERNELS = {aten.histc.default: _histc, **{f: _div_mode(f) for f in _DIV_MODES},
            aten.mkldnn_rnn_layer.default: _onednn_lstm_layer}


def device_kernel(func):
    """What the device runs for `func`: CPU's kernel, or CUDA's semantics (`_KERNELS`), or
    a custom kernel's neuron body (Note [Custom kernels])."""
    if func.namespace != "aten" and op_class(func) == KERNEL:
        return body(func)
    return _KERNELS.get(func, func)
