"""What `untyped_storage()` and `data_ptr()` show of a neuron tensor: its device buffer.

Note [Device addresses]: a wrapper subclass has no storage of its own (torch raises "Attempted
to access the data pointer on an invalid python storage"), yet libraries identify shared
tensors by `untyped_storage().data_ptr()` and `nbytes()` (safetensors, Transformers' tied
weights). Each device buffer gets an address in a simulated device address space, on first
use: unique and non-overlapping while the buffer lives, and never reused (a bump allocator
over 64 bits), so views of one buffer share it and offsets add up as on CUDA. As a CUDA
pointer, it cannot be read from the host: `.cpu()` gives the values. Threads ask for
addresses with no engine lock held (`data_ptr()` queues nothing): the bump is made under a
lock of its own, else two threads read one `_next` and two live buffers shared an address.
"""
from __future__ import annotations

import os
import threading
import weakref

import torch

from fusion.ir import extent_bytes

from .. import patches
from ..config import DEVICE_TYPE

_BASE = 0x7E00_0000_0000  # nonzero: 0 means "no storage" to safetensors
_ALIGN = 512  # as CUDA's caching allocator: every allocation starts 512-byte aligned
_addresses: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Handle -> address
_next = _BASE
_lock = threading.Lock()


def device_address(handle) -> int:
    global _next
    addr = _addresses.get(handle)
    if addr is None:
        with _lock:
            addr = _addresses.get(handle)
            if addr is None:
                addr = _addresses[handle] = _next
                _next += -(-max(handle.nbytes, 1) // _ALIGN) * _ALIGN
    return addr


def _after_fork_in_child() -> None:
    """A lock another thread held at a fork stays held in the child for good."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


# Note [Storage weak references]: PyTorch keys storages by `StorageWeakRef(storage)`, which
# holds a C++ weak pointer made by `storage._weak_ref()` and freed by
# `torch.Storage._free_weak_ref`: FakeTensor's constants (a one-element tensor made and moved
# `.to("neuron")` inside a compiled function: Dynamo runs that op for real, then records the
# result's storage) and AOTAutograd's alias checks. A device buffer has no C++ storage, so
# each gets a token, an empty host storage made at the first `_weak_ref()` and living as long
# as the buffer's handle: the weak reference is the token's, the same for every view of the
# buffer, and expires when the buffer is gone.
_tokens: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Handle -> token


# Note [Storage resize]: PyTorch resizes a wrapper tensor's storage through the C++
# PrivateUse1 hooks (`resizePrivateUse1Bytes`), which the Python hooks object cannot provide
# (torch._C._acc.PrivateUse1Hooks exposes is_available, is_built, has_primary_context only).
# A neuron tensor's `untyped_storage()` is this Python object, so `resize_` is ours: the
# buffer's handle, shared by every view of it, gets a new device buffer (an empty one at
# size 0, releasing its HBM). An op reading past the end fails on the device ("setStorage:
# ... out of bounds", raised at the next sync; CPU would crash) until it grows back.


class NeuronStorage:
    """`untyped_storage()` of a neuron tensor: the identity (`data_ptr`) and size (`nbytes`)
    of its device buffer. It holds no host bytes; copy the tensor to the CPU for those."""

    __slots__ = ("_handle", "_engine", "__weakref__")

    def __init__(self, handle, engine):
        self._handle = handle
        self._engine = engine

    @property
    def device(self) -> torch.device:
        return torch.device(DEVICE_TYPE, self._engine.index)

    def data_ptr(self) -> int:  # (an empty buffer's is 0, as CPU's and CUDA's: fuzzer)
        return device_address(self._handle) if self._handle.nbytes else 0

    def nbytes(self) -> int:
        return self._handle.nbytes

    @property
    def _cdata(self) -> int:  # the identity PyTorch compares storages by (fake_utils' alias
        return device_address(self._handle)  # checks): one per buffer, never reused

    def _weak_ref(self, *args, **kwargs) -> int:
        """What `StorageWeakRef` keeps of a storage (Note [Storage weak references])."""
        token = _tokens.get(self._handle)
        if token is None:
            token = _tokens[self._handle] = torch.UntypedStorage(0)
        return token._weak_ref(*args, **kwargs)

    size = nbytes

    def element_size(self) -> int:
        return 1

    def is_pinned(self, device=None) -> bool:
        return False

    def is_shared(self) -> bool:
        return False

    def _bytes(self) -> torch.Tensor:
        """The whole buffer as a uint8 neuron tensor (queued writes included)."""
        h = self._handle
        with torch.no_grad():
            return self._engine.wrap(h, (h.nbytes,), (1,), 0, torch.uint8)

    def cpu(self) -> torch.UntypedStorage:
        """A host copy of the buffer's bytes (a sync point, as `.cpu()` of a tensor)."""
        return self._bytes().cpu().untyped_storage()

    def clone(self) -> "NeuronStorage":
        """A new device buffer holding a copy of these bytes."""
        return self._bytes().clone().untyped_storage()

    def tolist(self) -> list:
        return self._bytes().tolist()

    def resize_(self, nbytes: int) -> "NeuronStorage":
        """Resize the device buffer, as `UntypedStorage.resize_` does on CPU: the first
        min(old, new) bytes are kept. FSDP2 frees an unsharded parameter by resizing its
        storage to 0 and re-allocates it before the next all-gather (Note [Storage resize])."""
        nbytes = int(nbytes)
        if nbytes < 0:
            raise RuntimeError(f"Storage size calculation overflowed with nbytes={nbytes}")
        eng = self._engine
        with eng.lock:
            h = self._handle
            if nbytes == h.nbytes:
                return self
            eng.flush("resize")  # queued readers and writers of the old bytes run first
            old = h.buffer
            eng.make_room(nbytes)
            new = eng.device.alloc(nbytes)  # size 0: an empty buffer, no HBM
            if nbytes:
                keep = min(nbytes, h.nbytes)
                if keep and old is not None and old.storage is not None:
                    with torch._C._DisableTorchDispatch():
                        u8 = {"dtype": torch.uint8, "device": "cpu"}
                        dst = torch.empty(0, **u8).set_(new.storage, 0, (keep,))
                        dst.copy_(torch.empty(0, **u8).set_(old.storage, 0, (keep,)))
            h.buffer, h.nbytes, h.pending = new, nbytes, False
            _addresses.pop(h, None)  # a new allocation: a new device address
        return self

    def __len__(self) -> int:
        return self._handle.nbytes

    def __eq__(self, other):
        return isinstance(other, NeuronStorage) and other._handle is self._handle

    def __hash__(self):
        return hash(self._handle)

    def __repr__(self):
        return (f"<neuron storage of {self._handle.nbytes} bytes at "
                f"{self.data_ptr():#x} on {self.device}>")


class NeuronTypedStorage(torch.TypedStorage):
    """`t.storage()` of a neuron tensor: a TypedStorage over its `NeuronStorage`, as CUDA's
    is over its device memory: `data_ptr()`, `size()` (elements), `nbytes()`, `device`,
    `dtype`, identity across views, `Tensor.set_(storage, ...)`. Element reads go through
    one host copy of the buffer (never a device read per element: a failure report that
    repr'd a storage walked it element by element, for minutes)."""

    def __new__(cls, untyped: NeuronStorage, dtype: torch.dtype):
        self = object.__new__(cls)  # (TypedStorage.__new__ takes host UntypedStorages only)
        self._untyped_storage = untyped
        self.dtype = dtype
        return self

    def __init__(self, *args, **kwargs):
        pass

    def _new_wrapped_storage(self, untyped_storage):
        return NeuronTypedStorage(untyped_storage, self.dtype)

    def cpu(self) -> torch.TypedStorage:
        """A host copy (a sync point)."""
        return torch.TypedStorage(wrap_storage=self._untyped_storage.cpu(), dtype=self.dtype,
                                  _internal=True)

    def _host(self) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype).set_(self.cpu())

    def _getitem(self, idx):
        if not isinstance(idx, int):
            return super()._getitem(idx)  # (its errors)
        n = self._size()
        if not -n <= idx < n:
            raise IndexError(f"index {idx} out of range for storage of size {n}")
        return self._host()[idx].item()

    def tolist(self) -> list:
        return self._host().tolist()

    def __str__(self):
        info = (f"[{torch.typename(self)}(dtype={self.dtype}, device={self.device}) of size "
                f"{self._size()}]")
        values = self._host().tolist()
        if len(values) > 1000:  # (CPU prints every element; a summary keeps it short)
            values = values[:3] + ["..."] + values[-3:]
        return " " + "\n ".join(str(v) for v in values) + "\n" + info

    __repr__ = __str__

    def __reduce__(self):
        raise RuntimeError("a neuron storage cannot be pickled; torch.save the tensor")


# Note [set_]: `t.set_(storage, offset, size, stride)` makes t a view of another buffer (its
# handle), as CUDA's set_ points t at another allocation: views of t's old buffer keep it;
# later ops on t reach the new one. Queued ops captured their handles when queued, so no
# flush is needed. The storage must be on t's core, of t's dtype if typed, and large enough
# (CPU's errors, word for word).
_PYTHON_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.Python)
                | torch._C.DispatchKeySet(torch._C.DispatchKey.PythonTLSSnapshot))


def set_storage(t, source, offset=0, size=None, stride=None):
    """`t.set_(source, offset, size, stride)` for a neuron storage (Note [set_]); `t.set_()`
    with no source gives t an empty buffer."""
    from ..errors import _out_of_bounds
    eng = t._engine
    if source is None:
        source = NeuronStorage(eng.empty((0,), (1,), torch.uint8)._handle, eng)
    if isinstance(source, torch.TypedStorage):
        if source.dtype != t.dtype:
            raise RuntimeError(
                f"Expected a Storage of type {_c_name(t.dtype)} or an UntypedStorage, but got "
                f"type {_c_name(source.dtype).capitalize()} for argument 1 'storage'")
        source = source._untyped_storage
    if not isinstance(source, NeuronStorage):  # a host storage
        raise RuntimeError(
            f"Attempted to set the storage of a tensor on device \"{t.device}\" to a storage "
            f"on different device \"{source.device}\".  This is no longer allowed; the "
            f"devices must match.")
    if source._engine is not eng:
        raise RuntimeError(
            f"Attempted to set the storage of a tensor on device \"{t.device}\" to a storage "
            f"on different device \"{source.device}\".  This is no longer allowed; the "
            f"devices must match.")
    h = source._handle
    if size is None:
        size = (h.nbytes // t.element_size(),)
    size = tuple(size)
    if stride is None:
        stride, n = [], 1
        for s in reversed(size):
            stride.insert(0, n)
            n *= max(s, 1)
    stride = tuple(stride)
    offset = int(offset)
    if extent_bytes(size, stride, offset, t.element_size()) > h.nbytes:
        _out_of_bounds(size, stride, offset, t.dtype, h.nbytes)
    with eng.lock:
        t._handle = h
        with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS):
            torch.ops.aten.as_strided_.default(t, size, stride, offset)
        t._set_layout()  # (as_strided_ bumped t's version, as set_ does on CPU)
    return t


def _c_name(dtype) -> str:
    return {torch.float32: "float", torch.float64: "double", torch.int64: "long",
            torch.int32: "int", torch.int16: "short", torch.int8: "char",
            torch.uint8: "byte", torch.bool: "bool", torch.float16: "half",
            torch.bfloat16: "bfloat16"}.get(dtype, str(dtype)[6:])


def refuse_device_storages() -> None:
    """`torch.UntypedStorage(n, device="neuron")` (and TypedStorage, `_new_shared`) asked the
    C++ allocator of PrivateUse1, which a Python backend has none of: the process died
    (segmentation fault). It raises now; device memory is made through tensors."""
    make = torch._C.StorageBase.__new__

    def __new__(cls, *args, **kwargs):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == DEVICE_TYPE:
            raise RuntimeError(
                f"torch.UntypedStorage(..., device={str(device)!r}) is not supported: neuron "
                f"memory is made through tensors (torch.empty(n, dtype=torch.uint8, "
                f"device={str(device)!r}); its untyped_storage() is the buffer)")
        return make(cls, *args, **kwargs)
    patches.patch(torch.UntypedStorage, "__new__", __new__,
                  rests_on="torch._C.StorageBase.__new__ (private), the constructor of every "
                           "storage class")
