"""Pinned host memory for the neuron device: `Tensor.pin_memory()`, `DataLoader(pin_memory=
True)`, `.to("neuron", non_blocking=True)` from pinned tensors.

PyTorch asks the accelerator's C++ hooks for a pinned-memory allocator, which a Python
backend cannot provide. On the simulator page-locked memory buys nothing (host-to-device
copies cost the modeled DMA time either way), so pinning for neuron makes an ordinary host
copy and remembers its storage, so `is_pinned()` answers True for it and its views. Pinning
for another device (CUDA in a CUDA build) goes to PyTorch's own kernel.
"""
from __future__ import annotations

import weakref

import torch

_PINNED: dict[int, int] = {}  # storage data_ptr -> live pinned tensors over it
_lib = None
_FALLTHROUGH = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


def _for_neuron(device) -> bool:
    if device is None:
        acc = torch.accelerator.current_accelerator()
        return acc is not None and acc.type == "neuron"
    return torch.device(device).type == "neuron"


def _pin_memory(self, device=None):
    if not _for_neuron(device):
        return torch.ops.aten._pin_memory.default.redispatch(_FALLTHROUGH, self, device)
    out = torch.empty_strided(self.shape, self.stride(), dtype=self.dtype, device="cpu")
    out.copy_(self)
    ptr = out.untyped_storage().data_ptr()
    if ptr:
        _PINNED[ptr] = _PINNED.get(ptr, 0) + 1
        weakref.finalize(out, _unpin, ptr)
    return out


def _unpin(ptr: int) -> None:
    n = _PINNED.get(ptr, 0) - 1
    if n > 0:
        _PINNED[ptr] = n
    else:
        _PINNED.pop(ptr, None)


def _is_pinned(self, device=None):
    if not _for_neuron(device):
        return torch.ops.aten.is_pinned.default.redispatch(_FALLTHROUGH, self, device)
    return self.untyped_storage().data_ptr() in _PINNED


def register() -> None:
    global _lib
    _lib = torch.library.Library("aten", "IMPL")
    _lib.impl("_pin_memory", _pin_memory, "CPU")
    _lib.impl("is_pinned", _is_pinned, "CPU")
