"""The ops the engine handles itself, and how `Engine.dispatch` routes every op.

Most ops take the engine's one path (templates, meta, a queued node). Some are answered or
prepared here first (`HANDLERS`): metadata questions answered from the metadata, host
indices moved to the device, copies between devices (transfer.py), conjugate and negative
views computed as new tensors, in-place foreach and fused optimizer ops that must bump
versions, `set_`, factorizations asked to check their errors. Integration modules add
theirs (collectives, `record_stream`) with `handle`. `find_route(func)` says, once per op
overload, which handler, composite kernel, op class and scalar positions an op has.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from fusion.ir import scalar_positions, written_values
from fusion.ops import VIEW, composite_key, op_class

from .. import errors
from . import transfer
from .meta import _global_state, argument
from .tensor import NeuronTensor

aten = torch.ops.aten


# Note [Composite ops in inference mode]: PyTorch decomposes a CompositeImplicitAutograd op
# (`to`, `softmax`, `layer_norm`, `scaled_dot_product_attention`...) at the Autograd key. In
# inference mode, and for inference tensors, that key is skipped and the op reaches Python
# dispatch whole: run as one device op it fell back to the CPU, or, for ops whose schema says
# they may alias (`to`), was taken for a view (`.cpu()` of an inference tensor stayed on
# neuron). It runs here as autograd's key would run it: our kernel where we registered one
# (attention.sdpa, one_hot), PyTorch's decomposition otherwise, as CPU decomposes it
# (fusion.ops.composite_key). On CPU the decomposition's own calls pass the ADInplaceOrView
# key of an ordinary tensor (inference mode skips autograd's keys, not that one), so
# `y.reshape(-1)` is a view of `y` sharing its version counter; inside __torch_dispatch__
# every key above Python is excluded, so here it runs with that one key let through: a
# composite view of an ordinary tensor is an autograd view, and an in-place change of it
# makes a backward through `y` raise, as on CPU (it gave a wrong gradient).
# PyTorch's own custom ops written in torch ops for any device (F.linear_cross_entropy's
# chunked path: fusion.ops `_COMPOSITE_CUSTOM_OPS`) always reach the device whole, and run
# their CompositeExplicitAutograd kernel here the same way, their ops the device's.


_INFERENCE_WRITE = ("Inplace update to inference tensor outside InferenceMode is not allowed."
                    "You can make a clone to get a normal tensor before doing inplace update."
                    "See https://github.com/pytorch/rfcs/pull/17 for more details.")


def run_composite(func, key, args, kwargs):
    """Note [Composite ops in inference mode]: the decomposition runs below PyTorch's version
    bookkeeping, so what an in-place or out= composite writes (`square_`, `clip_`) gets CPU's
    checks and bumps here: an inference tensor refused outside inference mode, an ordinary
    one's version bumped once if the decomposition did not (a backward through it raises
    "modified by an inplace operation" as on CPU, instead of a wrong gradient)."""
    if _tracks_views(func):  # (the op's own ADInplaceOrView kernel, above us, makes it one)
        return _decomposed(func, key, args, kwargs)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                         torch._C._dispatch_tls_local_exclude_set()
                                         .remove(_AD_INPLACE_OR_VIEW)):
        return _decomposed(func, key, args, kwargs)


_AD_INPLACE_OR_VIEW = torch._C.DispatchKey.ADInplaceOrView


@functools.lru_cache(maxsize=None)
def _tracks_views(func) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _AD_INPLACE_OR_VIEW)


def _decomposed(func, key, args, kwargs):
    written = [t for t in written_values(func, args, kwargs) if isinstance(t, torch.Tensor)]
    if not written:
        return func._op_dk(key, *args, **kwargs)
    if not torch.is_inference_mode_enabled() and any(t.is_inference() for t in written):
        raise RuntimeError(_INFERENCE_WRITE)
    ordinary = [t for t in written if not t.is_inference()]
    before = [t._version for t in ordinary]
    out = func._op_dk(key, *args, **kwargs)
    stale = [t for t, v in zip(ordinary, before) if t._version == v]
    if stale:
        torch.autograd.graph.increment_version(stale)
    return out



def _materialized(op):
    """Conjugate and negative views carry a bit our wrapper tensors cannot honour: computed
    as a new tensor instead (`z.conj()` equals CPU's values; `is_conj()` is False)."""
    def run(eng, func, args, kwargs):
        # Note [Copied views] in errors.py
        return errors.copied_view(eng.dispatch_plain(op, args, kwargs))
    return run


def _unsafe_view(eng, func, args, kwargs):
    return eng.dispatch(aten.view.default, args, kwargs)


def _new_zeros_with_same_feature_meta(eng, func, args, kwargs):
    """Forward AD's tangent of a dual written into a non-dual tensor (`w[0] = dual`,
    torch.func.linearize): zeros over a buffer of `other`'s size, viewed as `other` (`self`'s
    batch dims in front, laid out contiguously), as PyTorch's composite kernel makes it; that
    kernel reads the size of the wrapper's C++ storage, which the device does not keep, so it
    runs here as device ops (it fell back to the CPU)."""
    self, other = args[0], args[1]
    n_batch = args[2] if len(args) > 2 else kwargs.get("self_num_batch_dims", 0)
    numel = other.untyped_storage().nbytes() // other.element_size()
    strides = []
    for size in reversed(self.shape[:n_batch]):
        strides.insert(0, numel)
        numel *= size
    zeros = torch.zeros(numel, dtype=other.dtype, device=other.device)
    return zeros.as_strided([*self.shape[:n_batch], *other.shape], [*strides, *other.stride()],
                            other.storage_offset())


def _set_(eng, func, args, kwargs):
    """`t.set_(other)`, `t.set_(other, offset, size, stride)`, `t.set_()`: t becomes a view
    of other's buffer (Note [set_] in storage.py)."""
    from .storage import set_storage
    t, rest = args[0], list(args[1:])
    source = rest.pop(0) if rest else kwargs.get("source")
    if not isinstance(t, NeuronTensor):  # a host tensor set to a neuron one
        raise RuntimeError(
            f"Attempted to set the storage of a tensor on device \"{t.device}\" to a storage "
            f"on different device \"{source.device}\".  This is no longer allowed; the "
            f"devices must match.")
    if source is None:
        return set_storage(t, None, 0, (0,), (1,))
    if not isinstance(source, NeuronTensor):  # a host tensor or storage: CPU's device error
        return set_storage(t, source.untyped_storage() if isinstance(source, torch.Tensor)
                           else source, 0)
    if source.dtype != t.dtype:
        raise RuntimeError(f"Could not set tensor of type {source.dtype} to a tensor of "
                           f"type {t.dtype}")
    names = ("storage_offset", "size", "stride")
    given = dict(zip(names, rest), **{k: v for k, v in kwargs.items() if k in names})
    return set_storage(t, source.untyped_storage(),
                       given.get("storage_offset", source.storage_offset()),
                       given.get("size", source.shape), given.get("stride", source.stride()))


def _block_diag(eng, func, args, kwargs):
    """block_diag checks its inputs' devices itself, before anything else, in its own words
    (PyTorch's tests match them); then it is an ordinary op."""
    tensors = args[0] if args else kwargs["tensors"]
    first = tensors[0].device if tensors else None
    for i, t in enumerate(tensors):
        if t.device != first:
            e = RuntimeError(f"torch.block_diag: input tensors must all be on the same device. "
                             f"Input 0 is on device {first} and input {i} is on device "
                             f"{t.device}")
            e._ae_user_error = True
            raise e
    return eng.dispatch_plain(func, args, kwargs)


def _bumps_versions(eng, func, args, kwargs):
    """In-place foreach ops have no ADInplaceOrView kernel to bump the version of what they
    write: CUDA's kernels bump it themselves (CPU's per-tensor fallback gets it from each op),
    and so does neuron. Without it autograd misses the write: a view of a written tensor keeps
    a stale grad_fn (its backward dropped the gradient), and a tensor saved for backward can
    be overwritten (optimizer.step() before backward()) with no error."""
    written = [args[0]] if isinstance(args[0], torch.Tensor) else list(args[0])
    if not torch.is_inference_mode_enabled() and any(t.is_inference() for t in written):
        raise RuntimeError(_INFERENCE_WRITE)  # CPU's words (its per-tensor fallback checks)
    out = eng.handled(func, args, kwargs)
    torch.autograd.graph.increment_version(written)
    return out


def _bumps_fused_versions(eng, func, args, kwargs):
    """torch.optim's fused steps (`fused=True`) write parameters, gradients and state in
    place, with no ADInplaceOrView kernel either: the versions of what they write are bumped,
    as the foreach steps' are (`_bumps_versions`), so a backward through a graph that saved a
    parameter before `step()` raises instead of using the new values. (CPU's fused kernels
    bump none, a silently wrong gradient there; foreach=True, CPU's default, raises.)"""
    written = [t for t in written_values(func, args, kwargs) if isinstance(t, torch.Tensor)]
    if not torch.is_inference_mode_enabled() and any(t.is_inference() for t in written):
        raise RuntimeError(_INFERENCE_WRITE)
    out = eng.handled(func, args, kwargs)
    torch.autograd.graph.increment_version(written)
    return out


def _lift_fresh(eng, func, args, kwargs):
    """`torch.tensor(data, device="neuron")` makes a device tensor, then lifts it. While
    torch.compile traces (a FakeTensorMode is active) the modes decline a tensor subclass
    and hand the lift to us. It is then done as PyTorch does where no device is present
    (NOTE [torch.tensor, lift_fresh, and device movement] in fake_tensor.py): the value is
    lifted on the host, where the modes make it a graph constant, and copied into a new
    device tensor (a traced `empty` and `copy_`: FakeTensorMode would propagate a constant
    through `.to`, making a real device tensor its constant). So the graph holds a CPU
    constant and an H2D copy, never a fake tensor."""
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None:
        return eng.dispatch_plain(func, args, kwargs)
    from torch.utils._python_dispatch import _disable_current_modes
    t = args[0]
    with _disable_current_modes():  # the real value, read with no mode watching
        host = eng.read(t, "compile constant")
    lifted = func(host)  # through the modes from here on: traced
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(lifted)


def _host_indices(eng, func, args, kwargs):
    """`x[i]` and `x[i] = v` with a CPU index tensor `i` (index, index_put_ and their kin):
    CUDA's kernels accept host indices and copy them to the device; so does neuron."""
    def to_device(t):
        if type(t) is NeuronTensor or not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return t
        return transfer.upload(eng, t)
    if "indices" in kwargs:
        kwargs = {**kwargs, "indices": [to_device(t) for t in kwargs["indices"]]}
    else:
        args = (args[0], [to_device(t) for t in args[1]]) + tuple(args[2:])
    return eng.dispatch_plain(func, args, kwargs)


def _attention_fast_path(eng, func, args, kwargs):
    """nn.MultiheadAttention's inference fast path runs on the device, but with
    need_weights=False CPU's kernel returns no weights (None) where the meta kernel makes an
    empty tensor: that call stays a CPU fallback, which returns CPU's None."""
    need_weights = argument(func, args, kwargs, "need_weights", True)  # (the schema's default)
    if need_weights:
        return eng.dispatch_plain(func, args, kwargs)
    return eng.run_now(func, args, kwargs, True)


def _checks_errors(eng, func, args, kwargs):
    """An `_ex` factorization asked to check its errors (`inv_ex(A, check_errors=True)`) raises
    in its kernel on a singular matrix: it runs at once, so CPU's error raises at the call
    (Note [Linear algebra on the device] in fusion/ops.py); without the check it is queued."""
    if not kwargs.get("check_errors"):  # (keyword-only in every schema)
        return eng.dispatch_plain(func, args, kwargs)
    eng.count_op()
    return eng.run_now(func, args, kwargs, False)


def _is_pinned(eng, func, args, kwargs):
    return False  # device memory is never pinned host memory (CUDA's answer; no sync)


# Questions about metadata are answered from it, as CPU's kernels answer them (a CPU fallback
# would copy both tensors out, warn, and compare the copies); forward AD (torch.func.jvp,
# jacfwd) asks the first two of every tangent.
def _is_same_size(eng, func, args, kwargs):
    return args[0].shape == args[1].shape


def _has_same_storage_numel(eng, func, args, kwargs):
    a, b = args
    return a.untyped_storage().nbytes() // a.element_size() \
        == b.untyped_storage().nbytes() // b.element_size()


def _is_set_to(eng, func, args, kwargs):
    a, b = args
    return type(b) is NeuronTensor and a._handle is b._handle \
        and a.storage_offset() == b.storage_offset() and a.shape == b.shape \
        and a.stride() == b.stride()


def _strided_dims(eng, func, args, kwargs):
    """`sparse_dim()` / `dense_dim()` of a strided tensor: metadata, CPU's answer (0 and
    `dim()`), with no CPU fallback (the device holds strided tensors only)."""
    return 0 if func is aten.sparse_dim.default else args[0].dim()


def _pin_memory(eng, func, args, kwargs):
    raise RuntimeError(f"cannot pin '{args[0].type()}' only dense CPU tensors can be pinned")


HANDLERS = {
    aten.is_pinned.default: _is_pinned,
    aten._pin_memory.default: _pin_memory,
    aten.is_same_size.default: _is_same_size,
    aten._has_same_storage_numel.default: _has_same_storage_numel,
    aten.is_set_to.default: _is_set_to,
    aten.sparse_dim.default: _strided_dims,
    aten.dense_dim.default: _strided_dims,
    aten.index.Tensor: _host_indices,
    aten._unsafe_index.Tensor: _host_indices,
    aten.index_put_.default: _host_indices,
    aten.index_put.default: _host_indices,
    aten._index_put_impl_.default: _host_indices,
    aten._unsafe_index_put.default: _host_indices,
    aten._native_multi_head_attention.default: _attention_fast_path,
    aten.lift_fresh.default: _lift_fresh,
    aten.lift_fresh_copy.default: _lift_fresh,
    aten.copy_.default: transfer.copy_,
    aten.copy.default: transfer.copy,
    aten._to_copy.default: transfer.to_copy,
    aten._local_scalar_dense.default: transfer.local_scalar_dense,
    aten._unsafe_view.default: _unsafe_view,
    aten._new_zeros_with_same_feature_meta.default: _new_zeros_with_same_feature_meta,
    aten._conj.default: _materialized(aten.conj_physical.default),
    aten._neg_view.default: _materialized(aten.neg.default),
}
for _op in transfer.LIKE:
    HANDLERS[_op] = transfer.like
HANDLERS[aten.block_diag.default] = _block_diag
for _packet in (aten.linalg_inv_ex, aten._linalg_solve_ex, aten.linalg_cholesky_ex,
                aten.linalg_lu_factor_ex, aten.linalg_ldl_factor_ex):
    for _op in _packet.overloads():
        HANDLERS[getattr(_packet, _op)] = _checks_errors
for _op in aten.set_.overloads():
    HANDLERS[getattr(aten.set_, _op)] = _set_
for _name in {n.split(".")[0] for n in torch._C._dispatch_get_all_op_names()}:
    if _name.startswith("aten::_foreach_") and _name.endswith("_"):  # writes its first list
        _packet = getattr(aten, _name[6:])
        for _op in _packet.overloads():
            _op = getattr(_packet, _op)
            assert _op._schema.arguments[0].alias_info.is_write, _op
            HANDLERS[_op] = _bumps_versions
for _name in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"):
    for _op in getattr(aten, _name).overloads():
        HANDLERS[getattr(getattr(aten, _name), _op)] = _bumps_fused_versions
# (by the C++ op: an OpOverload hashes in Python, and writes_foreach runs per op)
_FOREACH_WRITES = frozenset(f._op for f, h in HANDLERS.items() if h is _bumps_versions)


def writes_foreach(func) -> bool:
    """Is `func` an in-place foreach op (writes the tensors of its first list)?"""
    return func._op in _FOREACH_WRITES


class Route(NamedTuple):
    """How `Engine.dispatch` routes one op, looked up once per op overload."""

    special: Callable | None  # the engine's own handler (`HANDLERS`)
    composite: object  # Note [Composite ops in inference mode]: the kernel's key, or None
    cls: str | None  # fusion.ops.op_class
    scalars: tuple  # fusion.ir.scalar_positions
    view: bool  # Note [Replayed views]: a view op, no composite kernel, no handler but as view


SELECT, SLICE = aten.select.int._op, aten.slice.Tensor._op


# keyed by `func._op`, the C++ operator behind an OpOverload: an OpOverload hashes through a
# Python __hash__, and this lookup runs per op
ROUTES: dict = {}


# Note [View keys]: a view op's template (Note [Templates] in fusion/ir.py) is its tensor's
# layout and its other arguments' static encodings, so a call whose only tensor is its first
# argument, on this core and within its buffer, and whose other arguments are ints or lists
# or tuples of ints, is keyed by (op, that layout, those values with their types): the meta
# cache keeps the meta result under that key too (for views that check, warn and resize
# nothing and queue no op), with the global state it was made under in the key, as the
# template way's key has it: a layout viewed under two states (a weight's `t()` in forward
# and, grad mode off, in backward) has an entry per state, not one that the other state
# misses (44 of a GPT step's views took the templates so, every step). A view then skips the
# templates (about 40% of its host time: a GPT step makes ~230 views). Anything else goes
# the template way, which raises the errors (another core, a freed storage).
# Note [Replayed views]: a view op (no composite kernel, no handler of ours but
# `_unsafe_view`'s, which is `view`: `Route.view`) bypasses the replay (Note [Replay] in
# replay.py) and goes straight to its view key, or the template way. It queues nothing, so
# no trace holds it: `follow` could only find that it is not the expected op (each of a
# GPT step's ~230 views paid that check, then the route), and `step` that no trace begins
# with it. The replay stays on across it, as before. A view op that does queue an op (the
# template way inferred one) takes the slow path, and the replay resumes after its node
# when it is the trace's (`resumes`).
def view_key(eng, func, args):
    """Note [View keys]: the key of view call `func(*args)`, or None."""
    a = args[0] if args else None
    if type(a) is not NeuronTensor or a._engine is not eng or a._info[2] > a._handle.nbytes:
        return None
    rest = []
    for v in args[1:]:
        t = type(v)
        if t is int:
            rest.append(v)
        elif (t is list or t is tuple) and all(type(x) is int for x in v):
            rest.append((t, tuple(v)))
        else:
            return None
    return ("view", func._op, a._info[0], tuple(rest), _global_state())


def find_route(func) -> Route:
    special, composite, cls = HANDLERS.get(func), composite_key(func), op_class(func)
    r = Route(special, composite, cls, scalar_positions(func),
               cls == VIEW and special in (None, _unsafe_view) and composite is None)
    if r.cls is not None or func.namespace == "aten":  # (a custom op's neuron kernel may be
        ROUTES[func._op] = r  # registered after its first call: Note [Custom kernels])
    return r


def handle(op, handler: Callable) -> None:
    """`handler(eng, func, args, kwargs)` takes op overload `op` (an integration module's: a
    collective, `record_stream`), before anything else the engine does with it. Added before
    the op first runs: its route, its meta results and the replay's traces of it are made
    once, without a handler (refused afterwards rather than silently not taken)."""
    if op._op in ROUTES:
        raise RuntimeError(f"{op} already ran on the neuron device: add its handler before")
    HANDLERS[op] = handler
