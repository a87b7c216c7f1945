"""Checkpoints and copies: neuron tensors through torch.save, torch.load and copy.deepcopy,
with views of one buffer still views of one buffer afterwards, as CPU's and CUDA's are.

Note [Checkpoints]: torch.save writes a tensor as (storage, offset, size, stride), each
storage once, tagged with its device ("cuda:0"); torch.load restores each storage once, where
the tag or `map_location` says, and rebuilds every tensor as a view of it. A neuron buffer
has no C++ storage (its bytes are the simulated HBM's), so:
- save: a tensor reduces to `_rebuild_tensor_v2` over a host copy of its whole buffer, made
  once per buffer while the buffer is unchanged (one save) and tagged `neuron:k` by our
  entry in torch.serialization's package registry;
- load: a storage bound for neuron (by its tag or by `map_location`) stays on the host and
  carries one device copy, made by our registry entry (PyTorch's own PrivateUse1 entry calls
  `storage.to(device)`, which needs a C++ allocator: it crashed the process);
  `torch._utils._rebuild_tensor` (private) makes each tensor a view of that copy;
- deepcopy: one copy of a buffer per memo, each tensor a view of it (CPU's deepcopy copies a
  storage once through the memo too), and only graph leaves, as on CPU.
A file saved from neuron loads without this package with `map_location="cpu"`. TorchScript's
loader is C++ and builds device storages itself: `torch.jit.load(map_location="neuron")`
raises (it loaded empty weights) rather than pretend.
"""
from __future__ import annotations

import collections
import copy
import functools
import weakref

import torch

from .. import patches
from ..config import DEVICE_TYPE

# handle uid -> (host copy of the whole buffer, the device buffer then, `_writers` then)
_HOST_COPIES: dict[int, tuple] = {}
_OWN_READS: collections.Counter = collections.Counter()  # device -> our pickle reads' DMAs


def reduce(t) -> tuple:
    """`t.__reduce_ex__` (Note [Checkpoints]): CPU's reduction, over a host copy of the whole
    buffer shared with every other tensor of that buffer in the same save, with the tensor's
    Python attributes as CPU saves them (a Parameter's too)."""
    state = user_state(t)
    if t.__dict__.get("_is_param"):  # a Parameter (Note [Module.to keeps Parameters])
        if not state:
            return (torch._utils._rebuild_parameter,
                    (t.detach(), t.requires_grad, collections.OrderedDict()))
        return (torch._utils._rebuild_parameter_with_state,
                (t.detach(), t.requires_grad, collections.OrderedDict(), state))
    host = _host_copy(t)
    args = (t.storage_offset(), tuple(t.shape), t.stride(), t.requires_grad,
            collections.OrderedDict())
    if t.dtype in torch.storage._new_dtypes():  # float8, uint16...: CPU's v3 format
        func, args = torch._utils._rebuild_tensor_v3, (host,) + args + (t.dtype,)
    else:
        typed = torch.storage.TypedStorage(wrap_storage=host, dtype=t.dtype, _internal=True)
        func, args = torch._utils._rebuild_tensor_v2, (typed,) + args
    if not state:
        return func, args
    return torch._tensor._rebuild_from_type_v2, (func, torch.Tensor, args, state)


# What a neuron tensor's `__dict__` holds for the engine (the rest is the user's, as a CPU
# tensor's `__dict__` is).
_INTERNAL = frozenset(("_engine", "_handle", "_info", "_layout", "_vbytes", "_extent",
                       "_is_param"))


def user_state(t) -> dict:
    """The Python attributes a user (or a library: `_no_weight_decay`) set on `t`."""
    return {k: v for k, v in t.__dict__.items() if k not in _INTERNAL}


def _writers(dev) -> int:
    """Submissions to `dev` that may have written a buffer: every launch and DMA but the
    reads of `_host_copy` itself (a save reading other buffers between two views of one
    must not take the first copy for stale: the views came back as two storages)."""
    return dev.submits - _OWN_READS[dev]


def _host_copy(t) -> torch.UntypedStorage:
    """The buffer's bytes on the host, read once while nothing can have written them: the
    same device buffer, nothing submitted since that could write, no queued op on it."""
    with t._engine.lock:  # (the checks and the read as one step: Note [Threads])
        return _host_copy_locked(t)


def _host_copy_locked(t) -> torch.UntypedStorage:
    h, eng = t._handle, t._engine
    dev = eng.device
    entry = _HOST_COPIES.get(h.uid)
    if entry is not None:
        ref, buf, writers = entry
        host = ref()
        if host is not None and buf is h.buffer and writers == _writers(dev) and not (
                h.seg is eng.seg.token and eng.seg.nodes):  # no queued op uses the buffer
            return host
    eng.sync("pickle")  # queued work launches first (it may write this buffer)...
    whole = eng.wrap(h, (h.nbytes,), (1,), 0, torch.uint8)
    before = dev.submits
    host = eng.read(whole, "pickle").untyped_storage()
    _OWN_READS[dev] += dev.submits - before  # ...so the read adds only its own DMA
    host._neuron_location = str(t.device)
    # Weak: the copy lives as long as the save holding it; the entry goes with it.
    _HOST_COPIES[h.uid] = (weakref.ref(host, lambda _, uid=h.uid: _HOST_COPIES.pop(uid, None)),
                           h.buffer, _writers(dev))
    return host


def _tag(storage) -> str | None:
    """Package-registry tagger: our host copies are saved as the device's."""
    return getattr(storage, "_neuron_location", None)


def _restore(storage, location: str):
    """Package-registry deserializer: a storage bound for neuron stays on the host and
    carries its device copy (torch.load restores each storage once, so views share it)."""
    if location != DEVICE_TYPE and not location.startswith(DEVICE_TYPE + ":"):
        return None
    device = torch.device(location)
    host = torch.empty(0, dtype=torch.uint8, device="cpu").set_(
        storage, 0, (storage.nbytes(),), (1,))
    storage._neuron_copy = host.to(device)
    if _LEGACY_LOADS:  # its bytes are read later: copied again then (_legacy_load)
        _LEGACY_LOADS[-1].append((storage, host))
    return storage


# One list per legacy-format load in progress: the storages `_restore` gave device copies.
_LEGACY_LOADS: list[list] = []


def _legacy_load(original):
    """The legacy format (`_use_new_zipfile_serialization=False`, and plain `pickle` of a
    tensor, whose storages pickle through it: `all_gather_object`, `broadcast_object_list`)
    restores a storage's location before reading its bytes, so a device copy made then held
    uninitialized memory: refilled once the bytes are in (the tensors are views of it)."""
    def load(*args, **kwargs):
        _LEGACY_LOADS.append([])
        try:
            result = original(*args, **kwargs)
            with torch.no_grad():
                for storage, host in _LEGACY_LOADS[-1]:
                    storage._neuron_copy.copy_(host)
            return result
        finally:
            _LEGACY_LOADS.pop()
    return load


def _rebuild_tensor(original):
    def rebuild(storage, storage_offset, size, stride):
        copy = getattr(storage._untyped_storage, "_neuron_copy", None)
        if copy is None:
            return original(storage, storage_offset, size, stride)
        with torch.no_grad():
            return copy.view(storage.dtype).as_strided(size, stride, storage_offset).detach()
    return rebuild


def _rebuild_tensor_v3(original):
    """float8, uint16...: CPU's v3 format sets the storage directly, past `_rebuild_tensor`:
    a storage bound for neuron goes through v2's path (its device copy) instead."""
    @functools.wraps(original)  # pickled by name, as torch._utils._rebuild_tensor_v3
    def rebuild(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype,
                metadata=None):
        if getattr(storage._untyped_storage, "_neuron_copy", None) is None:
            return original(storage, storage_offset, size, stride, requires_grad,
                            backward_hooks, dtype, metadata)
        typed = torch.storage.TypedStorage(wrap_storage=storage._untyped_storage, dtype=dtype,
                                           _internal=True)
        return torch._utils._rebuild_tensor_v2(typed, storage_offset, size, stride,
                                               requires_grad, backward_hooks, metadata)
    return rebuild


def _storage_to(original):
    def to(self, device, non_blocking=False):
        if torch.device(device).type == DEVICE_TYPE:
            raise RuntimeError(
                f"A storage cannot be moved to {DEVICE_TYPE}: this backend keeps no C++ "
                f"storages. Move tensors instead (`t.to('{DEVICE_TYPE}')`); "
                f"torch.load(..., map_location='{DEVICE_TYPE}') and Module.to work.")
        return original(self, device, non_blocking)
    return to


def deepcopy(t, memo: dict):
    """`t.__deepcopy__`: CPU's rules (graph leaves only; a storage copied once per memo)."""
    if not t.is_leaf:
        raise RuntimeError(  # CPU's words
            "Only Tensors created explicitly by the user (graph leaves) support the deepcopy "
            "protocol at the moment.  If you were attempting to deepcopy a module, this may "
            "be because of a torch.nn.utils.weight_norm usage, see "
            "https://github.com/pytorch/pytorch/pull/103001")
    if id(t) in memo:
        return memo[id(t)]
    h, eng = t._handle, t._engine
    key = ("neuron buffer", h.uid)
    with torch.no_grad():
        if key not in memo:
            memo[key] = eng.wrap(h, (h.nbytes,), (1,), 0, torch.uint8).clone()
        base = memo[key]
        new = eng.wrap(base._handle, tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)
    new.requires_grad_(t.requires_grad)
    memo[id(t)] = new
    if t.__dict__.get("_is_param"):  # as Parameter.__deepcopy__: no grad, no attributes
        new._is_param = True
        return new
    if t.grad is not None:  # as Tensor.__deepcopy__
        new.grad = copy.deepcopy(t.grad, memo)
    new.__dict__.update(copy.deepcopy(user_state(t), memo))
    return new


def shallow_copy(t):
    """`copy.copy(t)`: what CPU's `__reduce_ex__` round trip gives, a new leaf over the same
    buffer (writes show through both) with t's `requires_grad` and Python attributes."""
    with torch.no_grad():
        new = t._engine.wrap(t._handle, tuple(t.shape), t.stride(), t.storage_offset(),
                             t.dtype)
    new.requires_grad_(t.requires_grad)
    if t.__dict__.get("_is_param"):
        new._is_param = True
    new.__dict__.update(user_state(t))
    return new


def _jit_load(original):
    def load(f, map_location=None, *args, **kwargs):
        loc = map_location
        if isinstance(loc, (str, torch.device)) and torch.device(loc).type == DEVICE_TYPE:
            raise RuntimeError(
                f"TorchScript modules cannot be loaded onto {DEVICE_TYPE}: TorchScript's C++ "
                f"loader makes device storages, which this backend keeps in Python (the "
                f"weights came out empty). Load with map_location='cpu' and run on the CPU, "
                f"or use torch.export / an eager module, whose .to('{DEVICE_TYPE}') works.")
        return original(f, map_location, *args, **kwargs)
    load.__doc__, load.__wrapped__ = original.__doc__, original
    return load


def register() -> None:
    """Our package-registry entry (before PyTorch's PrivateUse1 one, which would crash) and
    the two private hooks of Note [Checkpoints]. Idempotent."""
    import torch.serialization as ser
    import torch.storage
    if not any(fn is _restore for _, _, fn in ser._package_registry):
        ser.register_package(5, _tag, _restore)  # before CPU's tagger (10): ours are CPU's
    patches.patch(ser, "_legacy_load", wrap=_legacy_load,
                  rests_on="torch.serialization._legacy_load (private), the legacy format's "
                           "reader, restoring a storage's location before its bytes")
    patches.patch(torch._utils, "_rebuild_tensor", wrap=_rebuild_tensor,
                  rests_on="torch._utils._rebuild_tensor (private), which pickled tensors "
                           "name")
    patches.patch(torch._utils, "_rebuild_tensor_v3", wrap=_rebuild_tensor_v3,
                  rests_on="torch._utils._rebuild_tensor_v3 (private), v3's pickled name")
    patches.patch(torch.storage, "_to", wrap=_storage_to,
                  rests_on="torch.storage._to (private), behind every storage's .to()")
    import torch.jit
    patches.patch(torch.jit, "load", wrap=_jit_load,
                  rests_on="torch.jit.load: TorchScript's C++ loader makes device storages")
