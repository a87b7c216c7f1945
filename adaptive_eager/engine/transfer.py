"""Host <-> device: reads (device-to-host, a sync point), writes (host-to-device), and the
ops that move data across (`copy_`, `_to_copy` to the CPU, `.item()`)."""
from __future__ import annotations

import torch
from torch.nn.parameter import UninitializedTensorMixin

from device import Launch

from .tensor import NeuronTensor
from ..errors import (COPIED, _generator_error, _out_of_bounds, _raise_launch_error,
                      refuse_copied_view, user_error)
from ..config import DEVICE_TYPE
from .meta import _global_state
from .source import _source, file_line
from .templates import template

aten = torch.ops.aten


def read(eng, t, reason: str, dma: str = "d2h") -> torch.Tensor:
    """Device-to-host: the current value of neuron tensor `t` as a CPU tensor."""
    if eng.seg.nodes:  # a host read that cuts queued work: where (run's advice)
        src = file_line(_source())
        eng.metrics.sync_sites[f"{reason}@{src[0]}:{src[1]}" if src else reason] += 1
    eng.sync(reason)
    h = t._handle
    if h.poison is not None:  # Note [Poison] in fusion/program.py
        _raise_launch_error(h.poison)
    n = t.numel() * t.element_size()
    eng.device.submit(Launch(dma, None, n, 0.0, kind="dma", dma_bytes=n))
    eng.device.wait_idle()
    if dma == "d2h":
        eng.metrics.d2h_bytes += n
    if n == 0:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu")
    with torch._C._DisableTorchDispatch():
        return torch.empty(0, dtype=t.dtype, device="cpu").set_(
            h.buffer.storage, t.storage_offset(), t.shape, t.stride()).clone()


def write(eng, dst, src: torch.Tensor, dma: str = "h2d") -> None:
    """Host-to-device copy into neuron tensor `dst` (broadcast and casts as copy_)."""
    h = dst._handle
    if COPIED[0]:  # Note [Copied views] in errors.py
        refuse_copied_view([h])
    if h.seg is eng.seg.token and eng.seg.nodes:  # a queued op uses dst's buffer
        eng.flush("h2d")  # the copy must land after queued readers/writers of dst
    src = src.detach()
    if src.dtype == torch.float64:
        eng.check_dtype(torch.float64)
        src = src.to(torch.float32)  # Note [float64 policy] in fusion/program.py
    n = src.numel() * src.element_size()
    eng.device.submit(Launch(dma, None, n, 0.0, kind="dma", dma_bytes=n))
    if dma == "h2d":
        eng.metrics.h2d_bytes += n
        c = eng.metrics  # where the tensor entered the device (churn in tools/lines.py)
        c.n_entries += 1
        c.entries.append((c.n_entries, _source(), tuple(dst.shape)))
    with torch._C._DisableTorchDispatch():
        torch.empty(0, dtype=dst.dtype, device="cpu").set_(
            h.buffer.storage, dst.storage_offset(), dst.shape, dst.stride()).copy_(src)


def upload(eng, cpu: torch.Tensor) -> torch.Tensor:
    """A new neuron tensor on `eng`'s core holding host tensor `cpu` (made dense first: an
    expanded host tensor cannot be written into a buffer of its own extent)."""
    cpu = cpu.contiguous()
    out = eng.empty(tuple(cpu.shape), cpu.stride(), cpu.dtype)
    eng.write(out, cpu)
    return out


# Note [Native hooks] in integration/native.py: a neuron generator's numbers are drawn by a CPU generator
# (its own; a core's default one: that core's device RNG). Registration sets this to the
# function that finds it; None without the hooks (then no neuron generator can be made).
CPU_GENERATOR = None


def use_cpu_generator(find) -> None:
    """`find(neuron_generator) -> CPU generator` (registration, with the native hooks)."""
    global CPU_GENERATOR
    CPU_GENERATOR = find


def on_host(v, tensor):
    """Argument v for a host call: neuron tensors replaced by `tensor(t)`, the neuron device
    by the CPU (recursing into lists and tuples)."""
    if isinstance(v, NeuronTensor):
        return tensor(v)
    # Note [Generators by type]: `type(v) is torch.Generator`, never isinstance: the
    # Generator's metaclass checks instances in a Python frame, which Dynamo (its frame hook
    # still set while the engine runs under torch.compile) compiled, faking the host tensor
    # it was asked about: compiled packed sequences (their lengths are a host tensor) failed.
    if type(v) is torch.Generator:
        if v.device.type == DEVICE_TYPE and CPU_GENERATOR is not None:
            return CPU_GENERATOR(v)
        raise _generator_error(v)
    if isinstance(v, (list, tuple)):
        return type(v)(on_host(x, tensor) for x in v)
    if isinstance(v, torch.device) and v.type == DEVICE_TYPE:
        return torch.device("cpu")
    return v


def buffer_view(v):
    """A host tensor viewing neuron tensor v's device buffer (the same bytes)."""
    h = v._handle
    if v.numel() == 0 or h.buffer is None:
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="cpu")
    return torch.empty(0, dtype=v.dtype, device="cpu").set_(
        h.buffer.storage, v.storage_offset(), v.shape, v.stride())


def copy_(eng, func, args, kwargs):
    dst, src = args[0], args[1]
    if isinstance(dst, NeuronTensor) and isinstance(src, NeuronTensor):
        if dst._engine is not src._engine:
            eng.metrics.ops += 1
            core_to_core(src, dst)
            return dst
        if not kwargs or set(kwargs) == {"non_blocking"}:
            if _direct(eng, dst, src):
                return device_copy(eng, dst, src)
            if eng.is_lazy() and _first_sight(eng, func, args, kwargs):
                eng.flush("copy")  # Note [Direct copies]: a new layout pair, not compiled
                if _direct(eng, dst, src):
                    return device_copy(eng, dst, src)
        return eng.dispatch_plain(func, args, kwargs)
    if isinstance(dst, NeuronTensor):  # host -> device
        if isinstance(src, UninitializedTensorMixin):
            raise _uninitialized(src)
        if src.dim() == 0:  # an op with a host value (which counts it: once)
            return eng.dispatch_plain(func, args, kwargs)
        eng.metrics.ops += 1
        eng.write(dst, src)
        return dst
    eng.metrics.ops += 1
    with torch._C._DisableTorchDispatch():  # device -> host
        dst.copy_(eng.read(src, "d2h"))
    return dst


# Note [Direct copies]: `dst.copy_(src)` between two neuron tensors of one core is a copy
# on the device (a memcpy, with a cast if the dtypes differ). Through the op path each new
# pair of layouts is a new signature: the storage offset of a view is in the key, so the
# reference loop for index_copy (`for i in range(n): a[i] = src[i]`, `a[i] = row`) inferred,
# probed and compiled an executable for every row (~500-900x CPU per assignment in eager).
# When nothing queued touches either buffer (always, in eager mode) and both values are in
# HBM, the copy is done at the call instead, as a host write is (`write`): CPU's copy_ on
# host views of the two buffers (those they keep, Note [Host views] in fusion/codegen.py;
# its broadcast, casts, overlap checks and errors, at the call, word for word), then one
# launch of the op on the device queue, costed as the op's one-op executable is (bytes of
# both views read, of dst written; one FLOP per element), and counted as eager counts an op
# (one op, one flush, a group of one). No executable is looked up or compiled: the cache
# counters do not move. The op path keeps
# what needs it: a copy_ among queued work (adaptive mode fuses it there), pending or
# poisoned values, float64 (Note [float64 policy]), complex into real (CPU's warning),
# buffers a collective is writing.
# In adaptive mode a copy_ whose buffers are queued is a node like any other, fused with
# them, except the first time its signature is seen: then what is queued is flushed and the
# copy done at the call. So a row loop (`a = torch.zeros(n, d); for i: a[i] = src[i]`)
# compiles no executable per row, while a copy_ a steady loop repeats is fused from its
# second time on (its signature is in the meta cache then).
_SEEN: set = set()  # copy_ signatures seen once (bounded as the meta cache is)
_WIDE = (torch.float64, torch.complex128)


def _direct(eng, dst, src) -> bool:
    """Can `dst.copy_(src)` (one core) be done at the call (Note [Direct copies])?"""
    hd, hs = dst._handle, src._handle
    if hd.pending or hs.pending or hd.poison is not None or hs.poison is not None:
        return False
    if dst.dtype in _WIDE or src.dtype in _WIDE or (src.is_complex() and not dst.is_complex()):
        return False
    seg = eng.seg
    if seg.nodes and (hd.seg is seg.token or hs.seg is seg.token):
        return False
    return not eng.device._pending  # (Note [Collective stream] in device/core.py)


def queues_copy(eng, args, kwargs) -> bool:
    """Note [Guarded replay] in replay.py: would `copy_` (matching a trace: two tensors of
    this core) be queued by its handler now, not copied at the call (Note [Direct copies])?
    A trace's copy_ was queued before, so its signature is not new (`_first_sight`)."""
    src = args[1]
    return type(src) is NeuronTensor and not _direct(eng, args[0], src)


def _first_sight(eng, func, args, kwargs) -> bool:
    """Is this the first time this copy_'s signature is seen (Note [Direct copies])?"""
    args_t, kwargs_t = template(eng, func, args, kwargs)[:2]
    key = (func._op, args_t, kwargs_t, _global_state())
    if key in eng.meta_cache or key in _SEEN:
        return False
    if len(_SEEN) >= 100_000:
        _SEEN.clear()
    _SEEN.add(key)
    return True


def device_copy(eng, dst, src):
    """Note [Direct copies]: `dst.copy_(src)` on one core, done at the call."""
    if COPIED[0]:  # Note [Copied views] in errors.py
        refuse_copied_view([dst._handle])
    eng.count_op()
    hd, hs = dst._handle, src._handle
    (dl, dn, dext), (sl, sn, sext) = dst._info, src._info
    if dext > hd.nbytes:  # its storage was resized smaller (FSDP2's free): CPU's error
        _out_of_bounds(dl[0], dl[1], dl[2], dst.dtype, hd.nbytes)
    if sext > hs.nbytes:
        _out_of_bounds(sl[0], sl[1], sl[2], src.dtype, hs.nbytes)
    with torch._C._DisableTorchDispatch():
        bd, bs = hd.buffer, hs.buffer
        if bd is bs or bd is None or bs is None or not (dn and sn):  # (one buffer: two
            d = buffer_view(dst)  # tensors, made afresh)
            s = d if src is dst else buffer_view(src)  # (one tensor twice: CPU's is_same)
        else:
            d, s = _host_view(dst, hd), _host_view(src, hs)
        try:
            d.copy_(s)
        except Exception as e:  # CPU refuses it: CPU's error, at the call
            raise user_error(e).with_traceback(None) from None
    vd, vs = min(hd.nbytes, dn), min(hs.nbytes, sn)
    nbytes = 2 * max(vd, vs) if hd is hs else 2 * vd + vs  # (as the op's executable)
    flops = float(dst.numel())
    eng.device.submit(Launch("copy_", None, nbytes, flops, context=None,
                             nodes=((_source(),), ((flops, nbytes),))))
    m = eng.metrics
    m.flushes["eager" if not eng.is_lazy() else "direct copy"] += 1
    m.group_sizes[1] += 1
    if eng.device.blocking:
        eng.synchronize()
    return dst


def _host_view(v, h):
    """`buffer_view(v)` (v's handle `h` holds a buffer): the CPU tensor a launch last read or
    wrote the buffer through, when laid out as v, else a new one, kept for the next
    (Note [Host views] in fusion/codegen.py: a device copy reads and writes the buffers
    eager ops just wrote and will read, as a launch does)."""
    buf = h.buffer
    size, stride, offset, _ = v._info[0]
    key = (size, stride, offset, v.dtype)
    hv = buf.host
    if hv is not None and hv[0] == key:
        return hv[1]
    t = torch.empty(0, dtype=v.dtype, device="cpu").set_(buf.storage, offset, size, stride)
    buf.host = (key, t)
    return t


def copy(eng, func, args, kwargs):
    """`aten.copy`, copy_'s functional form (in torch.compile's graphs, after
    functionalization): a new tensor laid out as `self.clone()` is, on self's device, holding
    `src` as copy_ writes it, across devices as copy_ goes."""
    dst, src = args[0], args[1]
    if isinstance(dst, NeuronTensor) and isinstance(src, NeuronTensor) \
            and dst._engine is src._engine:
        return eng.dispatch_plain(func, args, kwargs)
    like = torch.empty_like(torch.empty_strided(dst.shape, dst.stride(), dtype=dst.dtype,
                                                device="meta"))  # clone's layout
    if isinstance(dst, NeuronTensor):
        out = dst._engine.empty(tuple(like.shape), like.stride(), like.dtype)
    else:
        out = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device="cpu")
    return copy_(eng, aten.copy_.default, (out,) + tuple(args[1:]), kwargs)


def core_to_core(src, dst) -> None:
    """`dst.copy_(src)` across cores: src's core finishes what it has queued, then a DMA out
    of it and a DMA into dst's core (each costed on its own core; Note [Cores])."""
    host = src._engine.read(src, "d2d", dma="d2d")
    dst._engine.write(dst, host, dma="d2d")
    dst._engine.metrics.d2d_bytes += host.numel() * host.element_size()


def to_copy(eng, func, args, kwargs):
    dev = kwargs.get("device")
    if dev is not None and torch.device(dev).type == DEVICE_TYPE:
        target = eng.peer(torch.device(dev).index)
        if target is not eng:  # .to("neuron:k") of another core's tensor
            eng.metrics.ops += 1
            x = args[0]
            kw = {k: v for k, v in kwargs.items() if k not in ("device", "non_blocking")}
            meta = _on_stand_ins(aten._to_copy.default, (x,), kw)  # CPU's layout
            out = target.empty(tuple(meta.shape), meta.stride(), meta.dtype)
            core_to_core(x, out)
            return out
    if dev is not None and torch.device(dev).type == "cpu":
        eng.metrics.ops += 1
        cpu = eng.read(args[0], "cpu")
        kw = {k: v for k, v in kwargs.items() if k not in ("device", "non_blocking")}
        with torch._C._DisableTorchDispatch():
            return aten._to_copy.default(cpu, **kw)
    if dev is not None and torch.device(dev).type != DEVICE_TYPE:  # .to("meta"): no data
        return _on_stand_ins(func, args, kwargs)
    return eng.dispatch_plain(func, args, kwargs)


# Factories shaped like a tensor argument, which read no data of it. Given a `device=` other
# than the tensor's own, they run there (`zeros_like(x, device="cpu")` is a CPU tensor).
LIKE = [getattr(aten, n).default for n in (
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
    "randint_like", "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full")]
LIKE.append(aten.randint_like.low_dtype)


def like(eng, func, args, kwargs):
    if queues_like(eng, args, kwargs):
        return eng.dispatch_plain(func, args, kwargs)
    return _on_stand_ins(func, args, kwargs)


def queues_like(eng, args, kwargs) -> bool:
    """Note [Guarded replay] in replay.py: is a `*_like` / `new_*` op's result on this core
    (queued as an ordinary op), not on another device?"""
    dev = kwargs.get("device")
    return dev is None or eng.peer(torch.device(dev).index) is eng \
        and torch.device(dev).type == DEVICE_TYPE


def _on_stand_ins(func, args, kwargs):
    """`func` with every neuron tensor argument replaced by a meta tensor of its layout: for
    ops whose result is on another device and reads no data of those arguments."""
    def stand_in(v):
        if type(v) is not NeuronTensor:
            return v
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    return func(*[stand_in(v) for v in args], **kwargs)


def local_scalar_dense(eng, func, args, kwargs):
    eng.metrics.ops += 1
    v = eng.read(args[0], "item")
    with torch._C._DisableTorchDispatch():
        return v.item()


def _uninitialized(t) -> RuntimeError:
    """Lazy modules' parameters cannot move uninitialized: an UninitializedParameter is a CPU
    tensor PyTorch re-types in place (`Tensor._make_subclass`), which a neuron tensor (a
    wrapper subclass) cannot be."""
    return RuntimeError(
        f"Cannot move an uninitialized {type(t).__name__} (a lazy module's: nn.LazyLinear, "
        f"nn.LazyConv2d, ...) to {DEVICE_TYPE}: initialize the module first with one forward "
        f"on the CPU (a dry run: `model(example_input)`), then call .to('{DEVICE_TYPE}').")
