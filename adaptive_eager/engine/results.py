"""Results and views: the tensors an op returns (new buffers, views of its inputs' buffers,
its arguments back), in-place view ops that restride a tensor, and out= tensors resized as
CPU resizes them. Every view is checked against its real buffer (CPU's out-of-bounds error)."""
from __future__ import annotations

import warnings

import torch
from torch.utils._pytree import tree_unflatten

from device import Launch
from fusion.ir import extent_bytes

from .tensor import NeuronTensor, fresh
from ..errors import _out_of_bounds, user_error
from .meta import _global_state, _meta_buffers, _to_meta
from .source import _user_stacklevel
from .templates import template

aten = torch.ops.aten
_SELECT, _SLICE = aten.select.int._op, aten.slice.Tensor._op
_INT64_MAX = 2 ** 63 - 1
_PYTHON_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.Python)
                | torch._C.DispatchKeySet(torch._C.DispatchKey.PythonTLSSnapshot))


def results(eng, func, args, kwargs, handles, meta, new):
    """What op `func` returns, from its cached meta result: tensors over the new buffers it
    makes (`new`), views of its arguments' buffers (`handles`), or arguments handed back
    (in place, out=), in the op's own output structure."""
    if meta.single:  # one output (most ops): no list, no pytree
        leaf = meta.leaves[0]
        if leaf[0] == "new":
            _, k, size, stride, dtype, info = leaf
            return fresh(eng, new[k], size, stride, dtype, info)
        if leaf[0] == "view":
            return _view(eng, leaf, handles, args)
    out = []
    for leaf in meta.leaves:
        kind = leaf[0]
        if kind == "new":
            _, k, size, stride, dtype, info = leaf
            out.append(fresh(eng, new[k], size, stride, dtype, info))
        elif kind == "view":
            out.append(_view(eng, leaf, handles, args))
        elif kind == "arg":
            _, j, k = leaf
            a = func._schema.arguments[j]
            v = args[j] if j < len(args) and not a.kwarg_only else kwargs[a.name]
            out.append(v[k] if isinstance(v, (list, tuple)) else v)
        else:
            out.append(leaf[1])
    return out[0] if meta.single else tree_unflatten(out, meta.spec)


def _view(eng, leaf, handles, args):
    """A view of an argument's buffer. As on CPU, it is an inference tensor exactly when its
    base is one, in inference mode or not (a tensor made in inference mode otherwise is one:
    a view of an ordinary tensor made there failed PyTorch's view bookkeeping)."""
    _, li, size, stride, off, dtype, info = leaf
    if info[2] > handles[li].nbytes:
        _out_of_bounds(size, stride, off, dtype, handles[li].nbytes)
    base = args[0] if isinstance(args[0], torch.Tensor) else args[0][0]
    inference = base.is_inference()
    if inference == torch.is_inference_mode_enabled():
        if not off:  # (what NeuronTensor makes at offset 0, without its type call: ~1 us
            return fresh(eng, handles[li], size, stride, dtype, info)  # of ~10 per view)
        return NeuronTensor(eng, handles[li], size, stride, off, dtype, info=info)
    with torch.inference_mode(inference):
        return NeuronTensor(eng, handles[li], size, stride, off, dtype, info=info)


def view_at(eng, func, args, route, view_key):
    """Note [View inference]: `x.select(dim, i)` (`a[i]`) and `x.slice(dim, i, j, step)`
    (`a[i:j]`, `narrow`) are the view at index 0 shifted by i strides: the index is a runtime
    value, as an op's runtime scalars are, not a new signature per offset. The view at 0 comes
    from the meta cache (inferred once per layout and length), found by its view key
    (`view_key`: Note [View keys]) or its template; None where the op path decides (CPU's
    errors, empty views)."""
    at = _at_zero(func, args)
    if at is None:
        return None
    x, zero, step = at
    vkey = view_key(eng, func, zero)
    meta = eng.meta_cache.get(vkey) if vkey else None
    if meta is None or meta.gstate != _global_state():
        args_t, kwargs_t = template(eng, func, zero, {}, route.scalars)[:2]
        meta = eng.meta_cache.get((func._op, args_t, kwargs_t, _global_state()))
    if meta is not None and meta.single and not meta.warns and meta.leaves[0][0] == "view":
        _, li, size, stride, off, dtype, ((_, _, _, dt), nbytes, extent) = meta.leaves[0]
    else:  # the view at 0 through the op path, which infers and caches it
        first = eng.dispatch_plain(func, zero, {}, route, counted=True)
        if type(first) is not NeuronTensor or first._handle is not x._handle:
            return None
        (size, stride, off, dt), nbytes, extent = first._info
        dtype = first.dtype
    info = ((size, stride, off + step, dt), nbytes, extent + step * x.element_size())
    return _view(eng, ("view", 0, size, stride, off + step, dtype, info), [x._handle], args)


def _at_zero(func, args):
    """(x, the arguments of the same view at index 0, the shift in elements) of a `select` or
    `slice` call with a non-empty result at an index in range (ATen's wrapping and clamping of
    `slice`'s bounds); None otherwise (index 0 itself, bad arguments: the op path)."""
    x = args[0] if args else None
    if type(x) is not NeuronTensor:
        return None
    shape, strides = x._info[0][:2]  # (`x.shape`, `x.stride()`: slower)
    n = len(shape)
    if 0 in shape:  # an empty view's offset may lie past its buffer: the op path makes it
        return None
    if func._op is _SELECT:
        if len(args) != 3 or type(args[1]) is not int or type(args[2]) is not int:
            return None
        dim, index = args[1] + n if args[1] < 0 else args[1], args[2]
        if not 0 <= dim < n or not -shape[dim] <= index < shape[dim]:
            return None
        index = index + shape[dim] if index < 0 else index
        return (x, (x, dim, 0), index * strides[dim]) if index else None
    rest = args[1:]
    if len(rest) > 4:
        return None
    dim, start, end, step = (*rest, *(0, None, None, 1)[len(rest):])
    if type(dim) is not int or type(step) is not int or step <= 0 or start == _INT64_MAX \
            or any(v is not None and type(v) is not int for v in (start, end)):
        return None  # (a start of INT64_MAX: ATen reads it as 0)
    dim = dim + n if dim < 0 else dim
    if not 0 <= dim < n:
        return None
    size = shape[dim]
    start = 0 if start is None else start + size if start < 0 else start
    end = size if end is None else end + size if end < 0 else end
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    if start == 0 or end == start:
        return None
    return x, (x, dim, 0, end - start, step), start * strides[dim]


def inplace_view(eng, func, args, kwargs):
    """squeeze_, t_, as_strided_, resize_...: change the tensor's own sizes and strides
    over the same buffer; resize_ (or resize_as_) past the buffer moves the tensor to a
    larger one."""
    t = args[0]
    args_t, kwargs_t, handles, _, _ = template(eng, func, args, kwargs)
    metas = _meta_buffers(handles)
    m = _to_meta(t, args_t[0], metas)
    try:
        func(m, *[_to_meta(v, a, metas) for v, a in zip(args[1:], args_t[1:])],
             **{k: _to_meta(v, a, metas) for (k, v), (_, a) in zip(kwargs.items(), kwargs_t)})
    except Exception:
        _cpu_refusal(func, t, args, kwargs)
        raise
    need = extent_bytes(m.shape, m.stride(), m.storage_offset(), m.element_size())
    old = t._handle.nbytes
    if need > old:
        if func.overloadpacket not in (aten.resize_, aten.resize_as_):
            _out_of_bounds(m.shape, m.stride(), m.storage_offset(), m.dtype, old)
        grow(eng, t, need)
    with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS):
        aten.as_strided_.default(t, m.shape, m.stride(), m.storage_offset())
    t._set_layout()
    if need > old:
        fill_uninitialized(t, old // t.element_size())
    return t


def _cpu_refusal(func, t, args, kwargs) -> None:
    """A meta kernel refused an in-place view op (`t_` of a 3-d tensor raises AssertionError
    there): raise CPU's own error, from the op on a host tensor of the same layout, when CPU
    refuses it too (fuzzer seed 72019429)."""
    host = torch.zeros(t._info[2] // t.element_size() + 1, dtype=t.dtype).as_strided(
        t.shape, t.stride(), t.storage_offset())
    try:
        func(host, *args[1:], **kwargs)
    except Exception as e:
        raise user_error(e).with_traceback(None) from None


def fill_uninitialized(t, start: int = 0) -> None:
    """CPU's fill of new memory under `torch.use_deterministic_algorithms(True)` (with
    `torch.utils.deterministic.fill_uninitialized_memory`, on by default): NaN for floating
    and complex dtypes, the largest value for the others; elements from `start` on."""
    if not (torch.are_deterministic_algorithms_enabled()
            and torch.utils.deterministic.fill_uninitialized_memory):
        return
    if t.is_floating_point() or t.is_complex():
        value = float("nan")
    else:
        value = True if t.dtype is torch.bool else torch.iinfo(t.dtype).max
    n = t._handle.nbytes // t.element_size() - start
    if n > 0:  # (to the engine itself: this may run below the Python key, inside a kernel of
        # ours that PyTorch reached while excluding it, where torch's own fill_ has no kernel)
        view = NeuronTensor(t._engine, t._handle, (n,), (1,), start, t.dtype)
        t._engine.dispatch(aten.fill_.Scalar, (view, value), {})


def resize_out(eng, t, size, stride) -> None:
    """An out= tensor of the wrong shape is resized, as CPU's resize_output does (the
    meta kernel already gave CPU's deprecation warning)."""
    off = t.storage_offset()
    need = extent_bytes(size, stride, off, t.element_size())
    if need > t._handle.nbytes:
        grow(eng, t, need)
    with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS):
        aten.as_strided_.default(t, size, stride, off)
    t._set_layout()


def grow(eng, t, need: int) -> None:
    """A tensor resized past its buffer: the buffer itself grows (a new, larger
    allocation that starts with the old bytes), so every view of it sees the new storage,
    as CPU's resize_ reallocates the storage its views share."""
    h = t._handle
    eng.flush("resize")
    eng.make_room(need)
    buf = eng.device.alloc(need)
    if h.buffer is not None and h.nbytes:
        src, dst, n = h.buffer.storage, buf.storage, h.nbytes

        def copy():
            u8 = torch.uint8
            torch.empty(0, dtype=u8, device="cpu").set_(dst, 0, (n,), (1,)).copy_(
                torch.empty(0, dtype=u8, device="cpu").set_(src, 0, (n,), (1,)))

        with torch._C._DisableTorchDispatch():
            eng.device.submit(Launch("resize_", copy, 2 * n, 0.0))
    h.buffer, h.nbytes = buf, need  # the old allocation is released with its last user


def resize_outs(eng, func, args, kwargs, resize) -> None:
    """out= tensors of the wrong shape (meta's `resize`: argument, list index, CPU's size and
    strides, CPU's warning) are resized as CPU resizes them, with CPU's warning word for word
    where CPU's kernel gives one (resize_output's; not resize_'s)."""
    for j, k, size, stride, warn in resize:
        a = func._schema.arguments[j]
        v = args[j] if j < len(args) and not a.kwarg_only else kwargs[a.name]
        v = v[k] if isinstance(v, (list, tuple)) else v
        if v.numel():  # (factories resize with resize_: no warning)
            for text in warn:
                warnings.warn(text, UserWarning, stacklevel=_user_stacklevel())
        resize_out(eng, v, size, stride)
