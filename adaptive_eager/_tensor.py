"""The neuron tensor: a wrapper subclass on the `neuron` device whose data is a handle to a
(simulated) device buffer. `__torch_dispatch__` stays a few lines: it hands every ATen op to
the engine. Host reads (repr, item, bool, tolist, cpu) are sync points, counted by reason.
"""
from __future__ import annotations

import torch

from . import _engine


class NeuronTensor(torch.Tensor):
    __slots__ = ()  # the handle lives in __dict__ (wrapper subclasses need one)

    @staticmethod
    def __new__(cls, handle, size, stride, offset, dtype, requires_grad=False, info=None):
        t = torch.Tensor._make_wrapper_subclass(
            cls, size, strides=stride, storage_offset=offset, dtype=dtype,
            device=_engine.DEVICE, requires_grad=requires_grad)
        t._handle = handle
        if info is None:
            t._wrapper_nbytes = _engine._extent_bytes(size, stride, offset, dtype.itemsize)
            t._set_layout()
        else:  # precomputed per op signature by the engine's meta cache
            t._layout, t._vbytes, t._wrapper_nbytes = info
        return t

    def _set_layout(self):
        """Cache what every op's template needs (reading it back through torch is slower)."""
        self._layout = (tuple(self.shape), self.stride(), self.storage_offset(),
                        str(self.dtype)[6:])
        self._vbytes = self.numel() * self.element_size()

    @property
    def data(self):
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, new):  # `p.data = q` (module.half(), ...) swaps the buffer too
        torch.Tensor.data.__set__(self, new)
        self._handle, self._wrapper_nbytes = new._handle, new._wrapper_nbytes
        self._set_layout()

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __coerce_same_metadata_as_tangent__(self, expected_metadata, expected_type=None):
        # AOTAutograd (torch.compile, backend "neuron") traced this tangent as a plain
        # tensor on neuron: a neuron tensor is one. Note [Dynamo and the neuron tensor].
        return self if expected_type in (None, torch.Tensor) else None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _engine.ENGINE.dispatch(func, args, kwargs or {})

    # -- sync points with their own reason ----------------------------------------------
    def _host(self, reason: str) -> torch.Tensor:
        with torch.no_grad():
            return _engine.ENGINE.read(self, reason)

    def __repr__(self, *, tensor_contents=None):
        return tensor_repr(self, self._host("repr"))

    def __format__(self, spec):
        if self.dim() == 0 and spec:
            return self._host("format").item().__format__(spec)
        return tensor_repr(self, self._host("format"))

    def _scalar(self, reason):
        _engine.ENGINE._reason = reason
        return self

    def __bool__(self):
        return torch.Tensor.__bool__(self._scalar("bool"))

    def __int__(self):
        return torch.Tensor.__int__(self._scalar("int"))

    def __float__(self):
        return torch.Tensor.__float__(self._scalar("float"))

    def __index__(self):
        return torch.Tensor.__index__(self._scalar("int"))

    def tolist(self):
        return self._host("tolist").tolist()

    def numpy(self, *, force=False):
        if force:
            return self._host("numpy").numpy()
        raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use "
                        f"Tensor.cpu() to copy the tensor to host memory first.")

    def __array__(self, dtype=None):
        return self.numpy()

    def __reduce_ex__(self, proto):
        # torch.save / pickle / deepcopy: serialize the values (as torch does for devices
        # without storage sharing), restored on the neuron device.
        return (_rebuild, (self._host("pickle"), self.requires_grad))

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self.clone()
        new.requires_grad_(self.requires_grad)
        memo[id(self)] = new
        return new


_engine.NeuronTensor = NeuronTensor


def _rebuild(cpu, requires_grad):
    t = cpu.to(_engine.DEVICE)
    return t.requires_grad_(requires_grad) if requires_grad else t


def tensor_repr(t: torch.Tensor, cpu: torch.Tensor) -> str:
    """`tensor([...], device='neuron:0', ...)`: torch's own formatting, with our device."""
    prefix = "tensor("
    if cpu.numel() == 0:
        body = "[]"
    else:
        body = torch._tensor_str._tensor_str(cpu, len(prefix))
    suffixes = [f"device='{t.device}'"]  # torch's order: device, size, dtype, grad
    if cpu.numel() == 0 and tuple(cpu.shape) != (0,):
        suffixes.append(f"size={tuple(cpu.shape)}")
    if t.dtype not in (torch.get_default_dtype(), torch.int64, torch.bool,
                       torch.complex64 if torch.get_default_dtype() == torch.float32
                       else torch.complex128):
        suffixes.append(f"dtype={t.dtype}")
    if t.grad_fn is not None:
        suffixes.append(f"grad_fn=<{type(t.grad_fn).__name__}>")
    elif t.requires_grad:
        suffixes.append("requires_grad=True")
    return torch._tensor_str._add_suffixes(prefix + body, suffixes, len(prefix), False)
