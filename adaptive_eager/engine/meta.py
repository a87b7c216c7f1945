"""Meta inference: what an op returns (shapes, strides, dtypes, aliasing, FLOPs), computed once
per op signature by meta execution checked against CPU (Note [CPU probe]), so shape and dtype
errors raise at the call as in eager mode."""
from __future__ import annotations

import contextlib
import functools
import math
import warnings

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._pytree import tree_map, tree_flatten

from device import with_generator
from fusion.ir import OpSig, extent_bytes
from fusion.kernels import cost_of
from fusion.ops import (CONTRACTION, KERNEL, LAID_OUT_BY_DEVICE_TYPE, PROBED, RANDOM, VIEW,
                        device_kernel, linalg_flops, op_class)
from fusion.host import QUIET_OPS, cpp_warnings_scope, cpu_kernels

from ..errors import _quantized_error, user_error
from ..config import DEVICE_TYPE
from .source import _user_stacklevel

_RUN_NOW = object()  # meta cache entry: shape inference cannot answer, the op runs at once



class MetaResult:
    """What an op signature produces, computed once by meta execution (see Engine.infer)."""

    __slots__ = ("leaves", "spec", "single", "f64", "op", "resize", "checks", "gstate",
                 "replay", "warns", "handled")

    def __init__(self, leaves, spec, op, resize=(), checks=(), warns=()):
        self.warns = warns  # (text, category) CPU warns with at every call of this signature
        self.resize = resize  # out= tensors to resize first: (arg index, list index, size,
        # stride, CPU's resize warnings)
        self.checks = checks  # (runtime input index, dtype) per Note [Scalar conversion]
        self.single = spec.is_leaf()  # one output: no pytree rebuild per call
        self.op = op  # the node signature to queue, or None (views, metadata: nothing runs)
        self.f64 = op is not None and any(o is not None and o[4] == "float64" for o in op.outs)
        self.leaves = leaves  # per leaf: ("new", k, size, stride, dtype, info) |
        # ("view", li, size, stride, off, dtype, info) | ("arg", schema index, list index) |
        # ("value", v); info: what a NeuronTensor caches as `_info` (NeuronTensor._set_layout)
        self.spec = spec
        self.gstate = None  # the global state it was computed under (the engine sets it)
        self.replay = None  # Note [Replay]: how its calls' arguments look (replay.spec)
        self.handled = None  # Note [Handled replay]: the same, for its handler's replay



def _info(size, stride, offset, t) -> tuple:
    """(layout, view bytes, extent bytes) a NeuronTensor caches, from its meta twin."""
    return ((size, stride, offset, str(t.dtype)[6:]), t.numel() * t.element_size(),
            extent_bytes(size, stride, offset, t.element_size()))




_BN = {"native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
       "_native_batch_norm_legit_functional"}



def _refuse_reshaping_self(func, m_args, m_kwargs, name, t, want):
    """An in-place op whose meta kernel gives argument `name` (template `t`) another shape
    (`x.addr_(u, v)` of a 0-d x): CPU's kernel refuses it (only out= tensors are resized).
    Raise CPU's own error, from CPU's kernel on zeros of the same layouts (the meta kernel
    already reshaped its meta twin), instead of resizing the tensor (it held garbage)."""
    def zeros(v):
        if isinstance(v, torch.Tensor) and v.device.type == "meta":
            return torch.zeros_like(v, device="cpu")
        return v
    args, kwargs = tree_map(zeros, list(m_args)), tree_map(zeros, dict(m_kwargs))
    own = torch.zeros(t[2], dtype=getattr(torch, t[5]))
    names = [a.name for a in func._schema.arguments]
    if name in kwargs:
        kwargs[name] = own
    else:
        args[names.index(name)] = own
    try:
        func(*args, **kwargs)
    except Exception as e:
        raise user_error(e).with_traceback(None) from None
    # CPU's kernel resized it (addbmm_ of a (1,) self, deprecated): resized here too


def argument(func, args, kwargs, name, default=None):
    """Argument `name` of a call of `func`, given by keyword or at its place in the schema
    (never at a hard-coded position: a schema change must not make us read another
    argument); `default` when the call leaves it out or the schema has none of that name."""
    if name in kwargs:
        return kwargs[name]
    i = _places(func).get(name, len(args))
    return args[i] if i < len(args) else default


@functools.lru_cache(maxsize=None)
def _places(func) -> dict[str, int]:
    return {a.name: i for i, a in enumerate(func._schema.arguments) if not a.kwarg_only}


def _cpu_shaped(func, m_args, m_kwargs, out):
    """Where CPU kernels shape outputs unlike the meta kernels: eval-mode batch norm returns
    empty saved statistics on CPU (meta says (C,)); a backward leaves the gradients its
    `output_mask` turns off undefined (batch norm's meta kernel makes them: the device then
    read a gradient CPU never computed, and crashed); `nansum(x, dim=[])` reduces every dim
    on CPU, none in meta. Our device follows CPU."""
    names = [a.name for a in func._schema.arguments]
    if "output_mask" in names and isinstance(out, tuple):
        mask = argument(func, m_args, m_kwargs, "output_mask")
        if mask is not None and len(mask) == len(out):
            out = tuple(o if keep else None for o, keep in zip(out, mask))
    name = func.overloadpacket.__name__
    if name == "nansum":
        dim = argument(func, m_args, m_kwargs, "dim")
        if dim is not None and len(dim) == 0:
            # (CPU's kernel reduces every dim for `dim=[]`, as `sum` does; the meta kernel
            # reduces none: for inputs too big to probe, Note [CPU probe])
            return func(*m_args, **dict(m_kwargs, dim=None)) if "dim" in m_kwargs else \
                func(m_args[0], None, *m_args[2:], **m_kwargs)
    if name not in _BN or argument(func, m_args, m_kwargs, "training", False):
        return out
    return (out[0],) + tuple(o.new_empty(0) for o in out[1:3]) + tuple(out[3:])



def _global_state() -> tuple:
    """The global state that meta execution (and so a cached MetaResult) depends on. (The C
    functions themselves: this runs per op.)"""
    return (
        _default_dtype(),  # `int_tensor / 2`, factories without dtype=
        _grad_enabled(),  # ops that branch on grad mode (batch norm stats, ...)
        _inference_mode(),  # inference tensors behave differently
        _deterministic(),  # kernels that refuse or change
        _any_autocast() and torch.is_autocast_enabled("neuron"),  # seen by composite ops
    )


_default_dtype, _grad_enabled = torch.get_default_dtype, torch.is_grad_enabled
_inference_mode = torch.is_inference_mode_enabled
_deterministic = torch._C._get_deterministic_algorithms  # torch.are_deterministic_algorithms_enabled
_any_autocast = torch._C._is_any_autocast_enabled


# Note [CPU probe]: meta kernels are not CPU's kernels. Some lay out or type outputs unlike
# CPU (floor_divide on a transposed input, `bool ** False`), some accept what CPU refuses
# (`float & float`, mm of float32 by float64), some refuse what CPU accepts (empty inputs).
# On a new signature the op also runs on CPU over blank host buffers shaped and aliased like
# the device buffers; CPU's answer wins. The probe is skipped where it would cost real time
# (big input buffers or outputs: a broadcast of two small inputs may be too big for the host;
# contractions of one dtype, whose layouts meta gets right, save `fusion.ops.PROBED`); a
# random op's probe draws from a copy of the generator, so the real draws are untouched. A
# probe error counts only if CPU raises it, word for word, for two different fillings (zeros
# and ones), so value checks (a zero divisor, index 1 of a size-1 dim) and data-dependent
# shapes (a boolean mask's count) are not mistaken for user errors; those are found at run
# time as on the device.

_PROBE_MAX_BYTES = 16 * 2**20


def _unchecked(func):
    """`func` with `unsafe=True`: its checks of the values of its arguments (not of their
    shapes) left to the run."""
    def kernel(*args, **kwargs):
        return func(*args, **dict(kwargs, unsafe=True))
    return kernel


# Ops whose CPU kernel checks values that no filling of the probe's blank buffers passes:
# segment_reduce's lengths must sum to the data's size (both fillings failed alike, so the
# check was taken for a user error). The probe runs them without those checks, which run with
# the op on the device (an error at the next sync, as an index out of range).
_PROBE_KERNELS = {f: _unchecked(f) for f in (torch.ops.aten.segment_reduce.default,
                                             torch.ops.aten.segment_reduce.out)}

# Note [Layouts of unprobed signatures]: where the probe is skipped (big buffers), the meta
# kernel's layout stands, and some meta kernels lay out by device: given meta tensors their
# rules answer as for CUDA (`device_hint` defaults to "cuda"), and the convolution's meta
# kernel is always contiguous (FakeTensor's convolution asks `_select_conv_backend`). For the
# ops below the layout is CPU's fake kernel's instead: the meta twins wrapped as CPU
# FakeTensors (metadata only, nothing allocated) and the op run in a fake mode, so a 20 MB
# channels_last convolution stays channels_last as on CPU. The same rules answer for graphs
# traced on the device (Note [Fake layouts of the device] in integration/fake_layouts.py):
# without this, a graph's layout and the device's disagreed above 16 MiB. The ops: those of
# `fusion.ops.LAID_OUT_BY_DEVICE_TYPE` (the graphs' too), and those whose rules single out
# "cuda", which answer as CPU's for a neuron FakeTensor but not for a meta tensor.
UNPROBED_AS_CPU = frozenset(LAID_OUT_BY_DEVICE_TYPE).union(
    getattr(getattr(torch.ops.aten, op), overload) for op, overload in (
        ("_fft_r2c", "default"), ("_fft_c2r", "default"),
        ("linalg_eig", "default"), ("_linalg_svd", "default"),
        ("reflection_pad2d", "default"), ("replication_pad2d", "default"))
    if hasattr(getattr(torch.ops.aten, op, None), overload))


def _cpu_fake(func, m_args, m_kwargs, out):
    """Note [Layouts of unprobed signatures]: `out` (meta's) laid out as CPU's fake kernel lays
    it out."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    cpu = torch.device("cpu")
    with unset_fake_temporarily():
        mode = FakeTensorMode()
        wrap = (lambda v: FakeTensor(mode, v, cpu) if isinstance(v, torch.Tensor) else v)
        try:
            with mode:
                fake = func(*tree_map(wrap, m_args), **tree_map(wrap, m_kwargs))
        except Exception:  # (CPU's kernel refuses too: the error surfaces at the sync, as
            return out  # any unprobed signature's)
        leaves, spec = tree_flatten(out)
        cpu_leaves = tree_flatten(fake)[0]
        if len(cpu_leaves) != len(leaves):
            return out
        return spec.unflatten([
            torch.empty_strided(c.shape, c.stride(), dtype=c.dtype, device="meta")
            if isinstance(c, torch.Tensor) and isinstance(o, torch.Tensor) else o
            for c, o in zip(cpu_leaves, leaves)])



def _grouped_mm_meta(a, b, offs=None, bias=None, out_dtype=None):
    """CPU's `_grouped_mm` (MoE experts): float32, float16 and bfloat16, each result row
    padded to 16 bytes. Torch's meta kernel is CUDA's: bfloat16 only (a float32 call ran at
    once, a sync in adaptive mode), padded only in a CUDA build. Checks: the probe's
    (CPU's kernel), as for any contraction."""
    if a.dim() == 2 and b.dim() == 2:  # the groups split K: one (M, N) result per group
        size = [offs.shape[0], a.shape[0], b.shape[1]]
    elif a.dim() == 2:  # rows of a by group, one (K, N) matrix of b each
        size = [a.shape[0], b.shape[-1]]
    elif b.dim() == 2:  # columns of b by group
        size = [a.shape[1], b.shape[1]]
    else:  # a batch
        size = [a.shape[0], a.shape[1], b.shape[-1]]
    dtype = out_dtype or a.dtype
    align = 16 // dtype.itemsize
    n = -(-size[-1] // align) * align
    stride = [size[1] * n, n, 1] if len(size) == 3 else [n, 1]
    return torch.empty_strided(size, stride, dtype=dtype, device="meta")


def _histogram_meta(self, bins=100, *, range=None, weight=None, density=False):
    """torch.histogram's hist and bin edges: `bins` of them (`bins` + 1 edges), or one fewer
    than the edges given, in the input's dtype (CPU's `histogramdd_prepare_out`). Checks: the
    probe's (CPU's kernel)."""
    n = bins if isinstance(bins, int) else bins.shape[0] - 1
    return (self.new_empty((n,)), self.new_empty((n + 1,)))


def _histogramdd_bin_edges_meta(self, bins, *, range=None, weight=None, density=False):
    return [self.new_empty((b + 1,)) for b in bins]


def _histogramdd_from_bin_cts_meta(self, bins, *, range=None, weight=None, density=False):
    return self.new_empty(tuple(bins))


def _histogramdd_from_bin_tensors_meta(self, bins, *, weight=None, density=False):
    return self.new_empty(tuple(b.shape[0] - 1 for b in bins))


# Ops whose meta kernel is another device's, or missing, answered by CPU's rule (the device
# runs CPU's kernel). The histograms' shapes follow from their bins (they ran at the call, a
# sync in adaptive mode); a range taken from non-finite values raises at the next sync, as any
# error only execution finds.
_META_AS_CPU = {getattr(getattr(torch.ops.aten, op), overload): rule
                for op, overload, rule in (
                    ("_grouped_mm", "default", _grouped_mm_meta),
                    ("histogram", "bin_ct", _histogram_meta),
                    ("histogram", "bins_tensor", _histogram_meta),
                    ("_histogramdd_bin_edges", "default", _histogramdd_bin_edges_meta),
                    ("_histogramdd_from_bin_cts", "default", _histogramdd_from_bin_cts_meta),
                    ("_histogramdd_from_bin_tensors", "default",
                     _histogramdd_from_bin_tensors_meta))
                if hasattr(getattr(torch.ops.aten, op, None), overload)}


def _worth_probing(func, cls, handles, args_t, kwargs_t, out) -> bool:
    if sum(h.nbytes for h in handles) > _PROBE_MAX_BYTES or sum(
            t.numel() * t.element_size() for t in tree_flatten(out)[0]
            if isinstance(t, torch.Tensor)) > _PROBE_MAX_BYTES:  # (a broadcast's output)
        return False
    if cls == CONTRACTION and func._schema.name not in PROBED:  # (fusion/ops.py: those whose
        # meta layout is not CPU's)
        return len({t[5] for t in _tensor_templates(args_t + tuple(v for _, v in kwargs_t))}) > 1
    return True



def _tensor_templates(ts):
    for t in ts:
        if type(t) is tuple and t:
            if t[0] == "T":
                yield t
            elif t[0] == "L":
                yield from _tensor_templates(t[1:])



def _host_zeros(n: int) -> torch.Tensor:
    """n zero bytes on the host, from calloc'd memory: torch.zeros of 32 KiB or more fills in
    parallel, which cost ~20 ms a call on a busy 2-core host (a row assignment loop probes
    one new signature per row)."""
    # (a storage copied from a zeroed bytearray: resizable, as a kernel may resize an out=
    # twin past its buffer, which torch.frombuffer's storage refuses)
    # (from_buffer makes a meta storage while a FakeTensorMode is set, even below dispatch:
    # `torch.tensor(3, device="neuron")` traced by torch.compile runs its host -> device
    # copy for real, and its first probe came here with Dynamo's mode set)
    t = torch.empty(0, dtype=torch.uint8, device="cpu")  # (whatever the default device)
    if not n:
        return t
    with unset_fake_temporarily():
        return t.set_(torch.UntypedStorage.from_buffer(bytearray(n), dtype=torch.uint8))


def _probe(func, args, kwargs, args_t, kwargs_t, handles, random: bool):
    """CPU's result (or the exception CPU raises) for this op over blank host buffers, and the
    warnings CPU gave."""
    first = None
    # A random op's probe draws from a throwaway generator (the op's overload that takes
    # one), or else from a throwaway copy of the process's (fork_rng: restoring it would undo
    # another thread's CPU draws meanwhile, so only where unavoidable).
    kernel = _PROBE_KERNELS.get(func) or device_kernel(func)
    gen_op = with_generator(func) if random and kernel is func else None
    for fill in (0, 1):
        bufs = [_host_zeros(h.nbytes) for h in handles]
        cpu = torch.device("cpu")

        seen = {}  # the same tensor passed twice is one twin (CPU's `is_same` overlap checks)

        def twin(v, t):
            if isinstance(v, torch.Tensor):
                if id(v) not in seen:
                    seen[id(v)] = _twin(v, t, bufs, cpu, fill)
                return seen[id(v)]
            return _twin(v, t, bufs, cpu, fill)

        rng = torch.random.fork_rng(devices=[]) if random and gen_op is None \
            else contextlib.nullcontext()
        with torch._C._DisableTorchDispatch(), cpu_kernels(), \
                warnings.catch_warnings(record=True) as caught, rng:
            warnings.simplefilter("always")  # (CPU's warnings, C++ ones too: Note [C++ warnings])
            try:
                c_args = [twin(v, t) for v, t in zip(args, args_t)]
                c_kwargs = {k: twin(v, t) for (k, v), (_, t) in zip(kwargs.items(), kwargs_t)}
                if gen_op is not None:
                    return cpp_warnings_scope(lambda: gen_op(
                        *c_args, **dict(c_kwargs, generator=torch.Generator()))), caught
                return cpp_warnings_scope(lambda: kernel(*c_args, **c_kwargs)), caught
            except Exception as e:
                if first is not None and type(e) is type(first) and str(e) == str(first):
                    return first.with_traceback(None), ()
                if first is not None:  # a value check or a data-dependent shape (a mask's
                    return None, ()  # count), not a user error: let the device find it
                first = e.with_traceback(None)  # (no traceback: no cycle through this frame)
    return None, ()



def _meta_buffers(handles) -> list:
    """One meta byte buffer per device buffer: meta twins of views share them, so aliasing
    and storage offsets behave in shape inference as on the device."""
    return [torch.empty(0, dtype=torch.uint8, device="meta").set_(
        torch.UntypedStorage(h.nbytes, device="meta"), 0, (h.nbytes,), (1,)) for h in handles]



def _to_meta(v, t, metas):
    """The meta twin of argument v (template t): same sizes, strides, offsets, aliasing."""
    return _twin(v, t, metas, torch.device("meta"))


def _twin(v, t, bufs, device, fill=None):
    """Argument v (template t) over `bufs`, one byte buffer per device buffer (meta twins for
    shape inference, host twins for the CPU probe): same sizes, strides, offsets, aliasing.
    A device= argument becomes `device`, so nothing is allocated (or drawn) for real."""
    if type(t) is tuple and t and t[0] == "T":
        li, size, stride, off, dt = t[1:6]  # (t[6:]: an instance number)
        x = torch.empty(0, dtype=getattr(torch, dt), device=device).set_(
            bufs[li].untyped_storage(), off, size, stride)
        if fill:
            x.fill_(fill)
        return x
    if type(t) is tuple and t and t[0] == "L":
        return [_twin(x, tt, bufs, device, fill) for x, tt in zip(v, t[1:])]
    if isinstance(v, torch.device) and v.type == DEVICE_TYPE:
        return device
    return v



# Ops torch's flop counter has no formula for, counted by a sibling's (same arguments first):
# CPU's flash attention (what scaled_dot_product_attention runs on neuron) as CUDA's.
_FLOPS_AS = {"_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_flash_attention_for_cpu_backward":
             "_scaled_dot_product_flash_attention_backward"}


def _grouped_mm_flops(a, b, *args, out_val=None, **kwargs) -> float:
    """`_grouped_mm` (MoE experts: Transformers' `grouped_mm` experts): 2 K per output
    element, K the contracted size; with two 2-D operands the groups split K instead, so
    each of the (M, N) products sums over all of it once (the (G, M, N) output holds G
    partial ones)."""
    if a.dim() == 2 and b.dim() == 2:
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2.0 * out_val.numel() * a.shape[-1]


# Ops torch's flop counter has no formula for, with a formula of ours (its arguments).
_FLOPS_OF = {"_grouped_mm": _grouped_mm_flops}


def _flops(func, args, kwargs, out) -> float:
    from torch.utils.flop_counter import flop_registry
    flops = linalg_flops(func, args, kwargs)
    if flops is not None:
        return float(flops)
    own = _FLOPS_OF.get(func.overloadpacket.__name__)
    if own is not None:
        return float(own(*args, **kwargs, out_val=out))
    name = _FLOPS_AS.get(func.overloadpacket.__name__)
    f = flop_registry.get(func.overloadpacket if name is None
                          else getattr(torch.ops.aten, name))
    if f is not None:
        try:
            return float(f(*args, **kwargs, out_val=out))
        except Exception:  # a formula that does not take these args: count elements
            pass
    return float(sum(t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)))




# Note [View inference]: a view op (select, slice, view, as_strided...) makes no value, only a
# layout over its input's buffer, and its meta kernel is CPU's own code (views are computed
# the same on every backend). Each new index or offset is a new signature (`a[i]` for every
# row i), so the full inference (a CPU probe twice, FLOPs, aliasing per schema) cost ~0.3 ms
# per row of a row loop. A view whose meta run succeeds with no warning and returns only
# views of its arguments' buffers is answered from that run alone; anything else (an error:
# CPU's probe decides it; a warning; a non-view leaf) takes the full inference. And
# `select(dim, i)` (`a[i]`) and `slice(dim, i, j, step)` (`a[i:j]`, `narrow`) take their index
# as a runtime value: the view at index 0 (one signature per layout and length) shifted by i
# strides (results.view_at); an index out of range, a bad dim or step, or an empty result
# takes the op path, which raises CPU's error.
def infer_view(func, args, kwargs, args_t, kwargs_t, handles) -> MetaResult | None:
    """Note [View inference]: the meta result of view op `func`, or None (use `infer`)."""
    with torch._C._DisableTorchDispatch(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metas = [torch.UntypedStorage(h.nbytes, device="meta") for h in handles]
        try:
            m_args = [_view_twin(v, t, metas) for v, t in zip(args, args_t)]
            m_kwargs = {k: _view_twin(v, t, metas) for (k, v), (_, t) in zip(kwargs.items(),
                                                                              kwargs_t)}
            meta = _META_AS_CPU.get(func, func)
            out = cpp_warnings_scope(lambda: meta(*m_args, **m_kwargs))
        except Exception:
            return None
    if caught:
        return None
    storage_li = {m._cdata: li for li, m in enumerate(metas)}
    leaves, spec = tree_flatten(out)
    out_leaves = []
    for leaf in leaves:
        li = storage_li.get(leaf.untyped_storage()._cdata) \
            if isinstance(leaf, torch.Tensor) else None
        if li is None or leaf.dtype in _QUANTIZED:
            return None
        size, stride, off = tuple(leaf.shape), leaf.stride(), leaf.storage_offset()
        out_leaves.append(("view", li, size, stride, off, leaf.dtype,
                           _info(size, stride, off, leaf)))
    return MetaResult(tuple(out_leaves), spec, None)


def _view_twin(v, t, storages):
    """_to_meta for infer_view: a tensor's meta twin straight over its buffer's meta storage;
    a tensor list raises (the full inference takes it)."""
    if type(t) is tuple and t:
        if t[0] == "T":
            return torch.empty(0, dtype=getattr(torch, t[5]), device="meta").set_(
                storages[t[1]], t[4], t[2], t[3])
        if t[0] == "L":
            raise TypeError("a list argument")
    if isinstance(v, torch.device) and v.type == DEVICE_TYPE:
        return torch.device("meta")
    return v


def infer(func, args, kwargs, args_t, kwargs_t, handles) -> MetaResult:
    """Meta execution: output shapes/dtypes/strides, aliasing, FLOPs. User errors
    (shapes, dtypes) propagate with PyTorch's own message."""
    # Below any dispatch mode still on the stack (make_fx's under torch.func.linearize
    # would trace these meta twins, and refuse their storages).
    with torch._C._DisableTorchDispatch(), warnings.catch_warnings(record=True) as meta_warnings:
        metas = _meta_buffers(handles)
        m_args = [_to_meta(v, t, metas) for v, t in zip(args, args_t)]
        m_kwargs = {k: _to_meta(v, t, metas) for (k, v), (_, t) in zip(kwargs.items(),
                                                                       kwargs_t)}
        warnings.simplefilter("always")
        # (flags, not the exceptions: a local holding one whose traceback holds this frame
        # is a cycle keeping the caller's frames, and their tensors' device memory, alive
        # until the garbage collector runs)
        cls = op_class(func)
        try:  # (Note [C++ warnings]: a C++ meta kernel's warnings are recorded here too)
            meta = _META_AS_CPU.get(func, func)
            out = cpp_warnings_scope(lambda: meta(*m_args, **m_kwargs))
        except Exception as e:  # no meta kernel, data-dependent shapes, or a user error
            if cls == KERNEL:  # Note [Custom kernels]: its fake impl is the contract: its
                raise user_error(e)  # error (or its absence) is the user's, at the call
            meta_failed = True
        else:
            meta_failed = False
    probe = None
    if cls != KERNEL and (meta_failed or _worth_probing(func, cls, handles, args_t, kwargs_t,
                                                        out)):
        probe, probe_warnings = _probe(func, args, kwargs, args_t, kwargs_t, handles,
                                       cls == RANDOM)
        if not isinstance(probe, BaseException):
            meta_warnings = probe_warnings  # CPU's own warnings win (Note [CPU probe])
            if probe_warnings:  # given at each call; the device's run drops its own
                QUIET_OPS.add(func)
        if isinstance(probe, BaseException):  # CPU refuses it too: CPU's error, at the call
            user_error(probe)
            try:
                raise probe
            finally:
                probe = None
    if meta_failed:
        return _RUN_NOW
    out = _cpu_shaped(func, m_args, m_kwargs, out)
    if probe is None and func in UNPROBED_AS_CPU:  # Note [Layouts of unprobed signatures]
        out = _cpu_fake(func, m_args, m_kwargs, out)
    if any(isinstance(x, torch.Tensor) and x.dtype in _QUANTIZED for x in tree_flatten(out)[0]):
        e = _quantized_error(func._schema.name)  # (a strided tensor of qint8 lost its scale)
        e._ae_user_error = True
        raise e
    storage_li = {m.untyped_storage()._cdata: li for li, m in enumerate(metas)}
    leaves, spec = tree_flatten(out)
    rets = func._schema.returns
    schema_args = func._schema.arguments
    ret_alias = []
    for r in rets:
        ai = r.alias_info
        if ai is None or not ai.before_set:  # lists keep it on the element type
            ret_alias.append(None)
            continue
        j = next(j for j, a in enumerate(schema_args)
                 if a.alias_info is not None and a.alias_info.before_set & ai.before_set)
        ret_alias.append((j, ai.is_write))
    per_ret = out if len(rets) > 1 else (out,)
    leaf_alias = []
    for r, o in zip(ret_alias, per_ret):
        n = len(tree_flatten(o)[0])
        leaf_alias += [(r, k) for k in range(n)]
    cpu_leaves = tree_flatten(probe)[0] if probe is not None else ()
    out_leaves, outs, new_bytes, resize = [], [], [], []
    nh = len(handles)
    for i, leaf in enumerate(leaves):
        alias = leaf_alias[i][0] if i < len(leaf_alias) else None
        if not isinstance(leaf, torch.Tensor):
            out_leaves.append(("value", leaf))
            outs.append(None)
            continue
        size, stride, off = tuple(leaf.shape), leaf.stride(), leaf.storage_offset()
        dt = str(leaf.dtype)[6:]
        li = storage_li.get(leaf.untyped_storage()._cdata)
        if alias is not None and alias[1]:  # in-place or out=: hand back the argument
            j, k = alias[0], leaf_alias[i][1]
            out_leaves.append(("arg", j, k))
            outs.append(None)
            t = _arg_template(j, schema_args[j].name, args_t, kwargs_t)
            t = t[1 + k] if t[0] == "L" else t
            if (size, stride) != (t[2], t[3]):  # the meta kernel resized an out= tensor
                cpu = cpu_leaves[i] if i < len(cpu_leaves) else None
                if isinstance(cpu, torch.Tensor):  # CPU's kernel resizes (and restrides) an
                    # out unlike meta's: arange into a (2, 2) keeps it (Note [CPU layouts])
                    size, stride = tuple(cpu.shape), cpu.stride()
                elif (func.overloadpacket.__name__ in _RESIZE_BY_NUMEL
                      and math.prod(size) == math.prod(t[2])):
                    size, stride = tuple(t[2]), tuple(t[3])  # (no probe: a big out)
                if (size, stride) != (t[2], t[3]):  # (CPU may keep it: sort into a strided out)
                    if tuple(size) != tuple(t[2]) and not schema_args[j].is_out:
                        _refuse_reshaping_self(func, m_args, m_kwargs, schema_args[j].name,
                                               t, size)
                    warn = tuple(str(w.message) for w in meta_warnings  # (CPU's own
                                 if _is_resize_warning(w))  # words, as often: twice where
                    # an out of another dtype is resized, then copied into)
                    if warn and probe is None:  # a Python meta kernel's words are not CPU's
                        warn = (_cpu_resize_text(t[2], size),)
                    resize.append((j, k, size, stride, warn))
        elif (alias is not None or cls == VIEW) and li is not None:
            out_leaves.append(("view", li, size, stride, off, leaf.dtype,
                               _info(size, stride, off, leaf)))
            outs.append(None)
        else:
            cpu = cpu_leaves[i] if i < len(cpu_leaves) else None
            if isinstance(cpu, torch.Tensor) and (tuple(cpu.shape) != size
                                                  or cpu.stride() != stride
                                                  or cpu.dtype != leaf.dtype):
                # Note [CPU layouts]: where a meta kernel shapes, lays out or types an output
                # unlike CPU's kernel, CPU wins (view-vs-copy semantics depend on it; a wrong
                # shape is a wrong value: `nansum(x, dim=[])`, the unreduced multi_margin_loss
                # of one sample, 0-d on CPU and (1,) in meta)
                size, stride, dt = tuple(cpu.shape), cpu.stride(), str(cpu.dtype)[6:]
                leaf = torch.empty_strided(size, stride, dtype=cpu.dtype, device="meta")
            k = len(new_bytes)
            out_leaves.append(("new", k, size, stride, leaf.dtype,
                               _info(size, stride, 0, leaf)))
            outs.append(("N", nh + k, size, stride, dt))
            # (at offset 0, as its tensor is made and a kernel's result stored: a meta
            # kernel handing back its input, `native_dropout(x[6:], p, False)`'s, keeps x's)
            new_bytes.append(extent_bytes(size, stride, 0, leaf.element_size()))
    if not rets:  # out= tensor lists an op does not return (`unbind_copy(x, out=[...])`,
        resize += _unreturned_resizes(schema_args, m_args, m_kwargs, args_t, kwargs_t,
                                      meta_warnings)  # `-> ()`): read off the meta twins
    writes = []
    for j, a in enumerate(schema_args):
        if a.alias_info is not None and a.alias_info.is_write:
            t = _arg_template(j, a.name, args_t, kwargs_t)
            if t is None:
                continue
            for x in (t[1:] if t[0] == "L" else (t,)):
                if type(x) is tuple and x[0] == "T" and x[1] not in writes:
                    writes.append(x[1])
    flops = _flops(func, m_args, m_kwargs, out) if cls != KERNEL else 0.0
    cost = cost_of(func, m_args, m_kwargs, out) if cls == KERNEL else None
    outs = tuple(outs) if new_bytes else None
    op = None
    if outs is not None or writes:
        op = OpSig(func, cls, args_t, kwargs_t, outs or (), len(handles), writes, flops,
                   tuple(new_bytes), cost)
    warns = tuple((str(w.message), w.category) for w in meta_warnings
                  if not _is_resize_warning(w))  # (a resize's is given by resize_outs)
    return MetaResult(tuple(out_leaves), spec, op, tuple(resize),
                      _conversion_checks(func, args_t, kwargs_t, leaves), warns)


# Factories whose CPU kernel resizes an out= only when its number of elements is wrong (with
# resize_, no warning): `arange(4, out=x[:, 1:3])` fills the (2, 2) view in place, where their
# meta kernels resize it to (4,) (which wrote the values over the wrong elements).
_RESIZE_BY_NUMEL = {"arange", "linspace", "logspace", "range"}


_QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2,
                        torch.quint2x4})


_RESIZE_SUFFIX: list = []  # where CPU's build says the warning was triggered


def _unreturned_resizes(schema_args, m_args, m_kwargs, args_t, kwargs_t, meta_warnings):
    """`resize` entries of out= tensors no return hands back, as the meta kernel resized
    them (CompositeExplicitAutograd ops: CPU's code on meta tensors), each with its warning
    (given in the order of the outs, for those that had elements)."""
    texts = [str(w.message) for w in meta_warnings if _is_resize_warning(w)]
    resize = []
    for j, a in enumerate(schema_args):
        if not a.is_out:
            continue
        v = m_args[j] if j < len(m_args) else m_kwargs.get(a.name)
        t = _arg_template(j, a.name, args_t, kwargs_t)
        if v is None or t is None:
            continue
        pairs = zip(v, t[1:]) if t[0] == "L" else ((v, t),)
        for k, (m, tk) in enumerate(pairs):
            size, stride = tuple(m.shape), m.stride()
            if (size, stride) != (tk[2], tk[3]):
                warn = (texts.pop(0),) if texts and math.prod(tk[2]) else ()
                resize.append((j, k, size, stride, warn))
    return resize


def _cpu_resize_text(old, new) -> str:
    """CPU's resize warning for an out of shape `old` resized to `new` (where no CPU probe
    ran: a Python meta kernel words it otherwise)."""
    if not _RESIZE_SUFFIX:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            cpp_warnings_scope(lambda: torch.ops.aten.neg.out(
                torch.zeros(1, device="cpu"), out=torch.empty(2, device="cpu")))
        text = next((str(x.message) for x in w if _is_resize_warning(x)), "")
        _RESIZE_SUFFIX.append(text[text.index(" (Triggered"):] if " (Triggered" in text else "")
    return (f"An output with one or more elements was resized since it had shape {list(old)}, "
            f"which does not match the required output shape {list(new)}. This behavior is "
            f"deprecated, and in a future PyTorch release outputs will not be resized unless "
            f"they have zero elements. You can explicitly reuse an out tensor t by resizing "
            f"it, inplace, to zero elements with t.resize_(0).{_RESIZE_SUFFIX[0]}")


def _is_resize_warning(w) -> bool:
    return str(w.message).startswith("An output with one or more elements was resized")


# Note [Scalar conversion]: the fill family converts its Scalar to the tensor's dtype with no
# type promotion, and CPU checks the conversion (c10::checked_convert): nan into an integer,
# -1.0 into uint8, 1e10 into float16 raise "value cannot be converted to type int64_t without
# overflow" at the call. That depends on the runtime value, so it cannot be a property of the
# cached signature (the CPU probe sees the first call's value only): it is checked per call.
_FILLS = {"fill_", "fill", "masked_fill_", "masked_fill", "index_fill_", "index_fill",
          "scatter_", "scatter", "full", "full_like", "new_full"}
_CTYPES = {torch.int64: "int64_t", torch.int32: "int", torch.int16: "int16_t",
           torch.int8: "int8_t", torch.uint8: "uint8_t", torch.float16: "c10::Half",
           torch.bfloat16: "c10::BFloat16", torch.float32: "float"}


def _arg_template(j, name, args_t, kwargs_t):
    """The template of schema argument j (`name`): positional or keyword, None if absent."""
    return args_t[j] if j < len(args_t) else dict(kwargs_t).get(name)


def _conversion_checks(func, args_t, kwargs_t, leaves) -> tuple:
    if func.overloadpacket.__name__ not in _FILLS or not leaves:
        return ()
    dtype = leaves[0].dtype if isinstance(leaves[0], torch.Tensor) else None
    if dtype not in _CTYPES:
        return ()
    names = [a.name for a in func._schema.arguments]
    if func.overloadpacket.__name__.startswith("scatter"):  # with nothing to write, scatter
        # returns before converting (index_fill, full and the others convert first)
        j = names.index("index")
        t = _arg_template(j, "index", args_t, kwargs_t)
        if type(t) is tuple and t and t[0] == "T" and 0 in t[2]:
            return ()
    for name in ("value", "fill_value"):
        if name in names:
            j = names.index(name)
            t = _arg_template(j, name, args_t, kwargs_t)
            if type(t) is tuple and t and t[0] == "S":
                return ((t[1], dtype),)
    return ()


def give_warnings(warns) -> None:
    """The warnings CPU gives at every call of a signature (its kernel's, found once by the
    probe or the meta kernel), at the user's line."""
    for text, category in warns:
        warnings.warn(text, category, stacklevel=_user_stacklevel())


def check_conversions(checks, inputs) -> None:
    """Note [Scalar conversion]: CPU's error for a Scalar its tensor's dtype cannot hold."""
    for i, dtype in checks:
        v = inputs[i]
        if isinstance(v, bool) or isinstance(v, complex):
            continue
        if dtype.is_floating_point:  # inf and nan convert; finite values past max do not
            bad = math.isfinite(v) and abs(float(v)) > torch.finfo(dtype).max
        else:
            info = torch.iinfo(dtype)
            if isinstance(v, float):  # compared as C++ compares doubles
                bad = v != v or v < float(info.min) or v > float(info.max)
            elif info.min == 0:  # an unsigned type: negative ints wrap, as in C++
                bad = v > info.max or -v > info.max
            else:
                bad = v < info.min or v > info.max
        if bad:
            e = RuntimeError(f"value cannot be converted to type {_CTYPES[dtype]} without "
                             f"overflow")
            raise user_error(e)

