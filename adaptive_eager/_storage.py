"""What `untyped_storage()` and `data_ptr()` show of a neuron tensor: its device buffer.

Note [Device addresses]: a wrapper subclass has no storage of its own (torch raises "Attempted
to access the data pointer on an invalid python storage"), yet libraries identify shared
tensors by `untyped_storage().data_ptr()` and `nbytes()` (safetensors, Transformers' tied
weights). Each device buffer gets an address in a simulated device address space, on first
use: unique and non-overlapping while the buffer lives, and never reused (a bump allocator
over 64 bits), so views of one buffer share it and offsets add up as on CUDA. As a CUDA
pointer, it cannot be read from the host: `.cpu()` gives the values.
"""
from __future__ import annotations

import weakref

import torch

from . import _engine

_BASE = 0x7E00_0000_0000  # nonzero: 0 means "no storage" to safetensors
_ALIGN = 512  # as CUDA's caching allocator: every allocation starts 512-byte aligned
_addresses: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Handle -> address
_next = _BASE


def device_address(handle) -> int:
    global _next
    addr = _addresses.get(handle)
    if addr is None:
        addr = _addresses[handle] = _next
        _next += -(-max(handle.nbytes, 1) // _ALIGN) * _ALIGN
    return addr


class NeuronStorage:
    """`untyped_storage()` of a neuron tensor: the identity (`data_ptr`) and size (`nbytes`)
    of its device buffer. It holds no host bytes; copy the tensor to the CPU for those."""

    __slots__ = ("_handle", "__weakref__")

    def __init__(self, handle):
        self._handle = handle

    @property
    def device(self) -> torch.device:
        return _engine.DEVICE

    def data_ptr(self) -> int:
        return device_address(self._handle)

    def nbytes(self) -> int:
        return self._handle.nbytes

    size = nbytes

    def __len__(self) -> int:
        return self._handle.nbytes

    def __eq__(self, other):
        return isinstance(other, NeuronStorage) and other._handle is self._handle

    def __hash__(self):
        return hash(self._handle)

    def __repr__(self):
        return (f"<neuron storage of {self._handle.nbytes} bytes at "
                f"{self.data_ptr():#x} on {self.device}>")
