"""The neuron tensor: a wrapper subclass on the `neuron` device whose data is a handle to a
(simulated) device buffer. `__torch_dispatch__` stays a few lines: it hands every ATen op to
the engine. Host reads (repr, item, bool, tolist, cpu) are sync points, counted by reason.
"""
from __future__ import annotations

import sys
import threading

import torch
from torch.utils._pytree import tree_flatten

from .. import patches
from . import hooks
from . import serialization
from .storage import NeuronStorage, NeuronTypedStorage, device_address, set_storage
from fusion.ir import extent_bytes
from ..config import DEVICE_TYPE


_UNBOUNDED = 1 << 62


class NeuronTensor(torch.Tensor):
    """A view (sizes, strides, offset, dtype) of a device buffer (`_handle`), owned by the
    engine that made it (`_engine`): its ops and host reads go to that engine."""
    __slots__ = ()  # the handle lives in __dict__ (wrapper subclasses need one)

    @staticmethod
    def __new__(cls, engine, handle=None, size=None, stride=None, offset=None, dtype=None,
                requires_grad=None, info=None, **attrs):
        if isinstance(engine, torch.Tensor):  # Note [type(p) of a neuron Parameter]
            grad = handle if handle is not None else requires_grad  # (data, requires_grad)
            return torch.nn.Parameter(engine, True if grad is None else grad,
                                      **{k: v for k, v in attrs.items() if k not in _OURS})
        if attrs:
            raise TypeError(f"NeuronTensor() got unexpected keyword arguments {sorted(attrs)}")
        # The wrapper's own (data-less) storage is made as large as can be, so that in-place
        # resizes (resize_, out= of another shape) can restride it; the engine checks every
        # view against the real buffer (`_handle.nbytes`) instead.
        if offset or requires_grad or info is None:
            t = torch.Tensor._make_wrapper_subclass(
                cls, size, strides=stride, storage_offset=offset, dtype=dtype,
                device=engine.tdev or _device(engine), requires_grad=bool(requires_grad),
                storage_size=_UNBOUNDED)
            t._engine = engine
            t._handle = handle
            if info is None:
                t._set_layout()
            else:
                t._info = info
            return t
        return fresh(engine, handle, size, stride, dtype, info)

    def _set_layout(self):
        """Cache what every op's template needs (reading it back through torch is slower):
        `_info` = (layout: sizes, strides, offset, dtype name; bytes of the view; bytes of
        the buffer it reaches, its end, checked against the buffer)."""
        layout = (tuple(self.shape), self.stride(), self.storage_offset(), str(self.dtype)[6:])
        self._info = (layout, self.numel() * self.element_size(),
                      extent_bytes(layout[0], layout[1], layout[2], self.element_size()))

    @property
    def data(self):
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, new):  # `p.data = q` (module.half(), ...) swaps the buffer too
        torch.Tensor.data.__set__(self, new)
        self._engine, self._handle = new._engine, new._handle
        self._set_layout()

    # Note [type(p) of a neuron Parameter]: a neuron Parameter is a neuron tensor flagged
    # `_is_param` (nn.Parameter's own rule for tensor subclasses: `isinstance(p, Parameter)`
    # holds), so `type(p)` is NeuronTensor where CUDA's is nn.Parameter. Libraries rebuild a
    # parameter as `type(p)(data, requires_grad=...)`: accelerate's `set_module_tensor_to_device`
    # (CPU and disk offload, `device_map` with "cpu", `dispatch_model`), `init_on_device`, and
    # PEFT's copy of it. That call form (a tensor first) is nn.Parameter's constructor here too:
    # `NeuronTensor(t, requires_grad=r)` is `nn.Parameter(t, r)` (a meta or CPU `t` gives a
    # plain Parameter there, a neuron one a flagged neuron tensor, as `Parameter(t)` does).
    # `init_on_device` passes the old parameter's `__dict__` as keywords too, where a neuron
    # tensor keeps its own attributes (`_OURS`: they describe the old tensor, so are dropped).
    #
    # Note [Module.to keeps Parameters]: `Module._apply` keeps a parameter's identity by
    # `param.data = new` only for tensor types compatible with the old one (CPU and a wrapper
    # subclass are not), and otherwise makes a new Parameter, which breaks ties and
    # optimizers built before `.to`. For traceable wrapper subclasses (this protocol) it
    # swaps the new tensor into the old Python object (torch.utils.swap_tensors) instead, as
    # identity and ties survive `.to("cuda")`. A neuron tensor holds no inner tensors: its
    # buffer handle and view are the context.
    def __tensor_flatten__(self):
        return [], (self._engine, self._handle, self.storage_offset(), self.dtype,
                    self.requires_grad)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        engine, handle, offset, dtype, requires_grad = ctx
        return NeuronTensor(engine, handle, tuple(outer_size), tuple(outer_stride), offset,
                            dtype, requires_grad)

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __coerce_same_metadata_as_tangent__(self, expected_metadata, expected_type=None):
        # AOTAutograd (torch.compile, backend "neuron") traced this tangent as a plain
        # tensor on neuron: a neuron tensor is one. Note [Dynamo and the neuron tensor].
        return self if expected_type in (None, torch.Tensor) else None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if len(types) > 1:  # another subclass among the args (DTensor's AsyncCollectiveTensor
            return NotImplemented  # wrapping a neuron tensor): it unwraps first, then calls us
        a = args[0] if args else None
        engine = a._engine if type(a) is NeuronTensor else engine_of(args, kwargs)
        return engine.dispatch(func, args, kwargs or {})

    def new_tensor(self, data, *, dtype=None, device=None, requires_grad=False, **kwargs):
        """On this tensor's core unless told otherwise: PyTorch places it through the C++
        device guard set to this tensor's device, which a Python backend's guard ignores
        (it landed on neuron:0)."""
        if device is None or torch.device(device).type == DEVICE_TYPE \
                and torch.device(device).index is None:
            device = self.device
        return torch.Tensor.new_tensor(self, data, dtype=dtype, device=device,
                                       requires_grad=requires_grad, **kwargs)

    # Note [Hooks that raise] in hooks.py
    def register_hook(self, hook):
        return torch.Tensor.register_hook(self, hooks.guarded(hook))

    def register_post_accumulate_grad_hook(self, hook):
        return torch.Tensor.register_post_accumulate_grad_hook(self, hooks.guarded(hook))

    # -- sync points with their own reason ----------------------------------------------
    def _host(self, reason: str) -> torch.Tensor:
        with torch.no_grad():
            return self._engine.read(self, reason)

    def __repr__(self, *, tensor_contents=None):
        text = tensor_repr(self, self._host("repr"))
        return "Parameter containing:\n" + text if self.__dict__.get("_is_param") else text

    def __format__(self, spec):
        if self.dim() == 0:  # as torch.Tensor: a 0-d tensor formats as its item
            return self._host("format").item().__format__(spec)
        return tensor_repr(self, self._host("format"))

    # Python's conversions read the value on the host (the flush reason is passed along,
    # never stashed), then convert as a CPU tensor does, with CPU's errors.
    def __bool__(self):
        return bool(self._host("bool"))

    def __int__(self):
        return int(self._host("int"))

    def __float__(self):
        return float(self._host("float"))

    def __complex__(self):  # torch.tensor([z, ...]) of 0-d complex tensors reads each so
        return complex(self._host("complex"))

    def __index__(self):
        # CPU's refusal from metadata, without a sync: PyTorch's argument parser asks it of
        # every tensor in a list where an overload takes int[] (histogramdd's bin tensors)
        if self.numel() != 1 or self.is_floating_point() or self.is_complex():
            raise TypeError("only integer tensors of a single element can be converted to "
                            "an index")
        return self._host("int").__index__()

    def tolist(self):
        return self._host("tolist").tolist()

    def numpy(self, *, force=False):
        if force:
            return self._host("numpy").numpy()
        raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use "
                        f"Tensor.cpu() to copy the tensor to host memory first.")

    def __array__(self, dtype=None):
        return self.numpy()

    # -- storage identity (Note [Device addresses] in storage.py) ------------------------
    def untyped_storage(self):
        return NeuronStorage(self._handle, self._engine)

    def _typed_storage(self):  # Tensor.storage(), and what share_memory_ and collate reach
        if torch.utils.data.get_worker_info() is not None:  # a DataLoader worker's collate
            raise RuntimeError(
                f"A DataLoader worker made {DEVICE_TYPE} tensors, which cannot be sent to the "
                f"main process (their buffers live in this process's device memory). Return "
                f"CPU tensors from the Dataset and move each batch with .to('{DEVICE_TYPE}') "
                f"in the training loop (pin_memory=True and non_blocking=True overlap it).")
        return NeuronTypedStorage(self.untyped_storage(), self.dtype)

    def set_(self, source=None, storage_offset=0, size=None, stride=None):
        """`t.set_(storage, offset, size, stride)` over a neuron storage (typed or not), and
        `t.set_(other)`: t becomes a view of that buffer, as on CUDA (Note [set_])."""
        if isinstance(source, (NeuronStorage, torch.TypedStorage)) or source is None:
            return set_storage(self, source, storage_offset, size, stride)
        if size is None or type(source) is not NeuronTensor:  # (through autograd's set_)
            return torch.Tensor.set_(self, source) if size is None else \
                torch.Tensor.set_(self, source, storage_offset, size, stride)
        if source.dtype != self.dtype:
            raise RuntimeError(f"Could not set tensor of type {source.dtype} to a tensor of "
                               f"type {self.dtype}")
        return set_storage(self, source.untyped_storage(), storage_offset, size, stride)

    # Note [Sharing across processes]: a neuron buffer cannot be shared with another process
    # (CUDA shares through IPC handles; the simulated HBM is this process's). Sending one
    # through torch.multiprocessing raises (it arrived as a CPU copy: the child's writes
    # were lost without a word); share_memory_ is a no-op, as on CUDA.
    def share_memory_(self):
        return self

    def is_shared(self) -> bool:
        return False

    def data_ptr(self) -> int:
        if not self._handle.nbytes:  # no memory: 0, as CPU and CUDA give
            return 0
        return device_address(self._handle) + self.storage_offset() * self.element_size()

    def __dlpack__(self, *args, **kwargs):  # PyTorch packed a null pointer of device "ext"
        raise _dlpack_error(self)

    def __dlpack_device__(self):  # torch.from_dlpack asks this first ("Unknown device type
        raise _dlpack_error(self)  # neuron for Dlpack" otherwise)

    def __reduce_ex__(self, proto):
        # torch.save / pickle as CPU's tensors go: (storage, offset, size, stride), over a
        # host copy of the buffer shared by its views (Note [Checkpoints] in
        # serialization.py). Honours map_location; with map_location="cpu" a process
        # without this package loads it. (Tensor.__reduce_ex__ would wrap our class.)
        return serialization.reduce(self)

    def __deepcopy__(self, memo):
        return serialization.deepcopy(self, memo)

    def __copy__(self):  # CPU's goes through __reduce_ex__, which here makes a host copy
        return serialization.shallow_copy(self)


class _Protocol:
    """Who sees NeuronTensor's traceable-subclass protocol (`__tensor_flatten__`), decided by
    who asks (read from the caller's frame):
    - Note [Flatten protocol and Dynamo]: the PT2 stack (modules `_PT2`) never does. Dynamo and
      AOTAutograd would treat a neuron tensor as a subclass to desugar into inner tensors,
      which one without inner tensors cannot survive; hidden, it is traced as what it is, a
      plain tensor on the neuron device.
    - Note [Module.to keeps Parameters]: `Module._apply` does, so that `.to("neuron")` swaps
      the new tensor into the old Parameter object, except when the old parameter is already
      a neuron tensor (`.half()`, `.to(torch.bfloat16)`, another core): then, as on CUDA,
      `param.data = new` keeps it, which unlike a swap also works while an autograd graph
      still holds the parameter (a swap needs the only reference).
    - Libraries that identify storages by walking a subclass's inner tensors
      (`huggingface_hub`'s shard planner and shared-tensor check, `_HIDDEN_FROM`) do not: with
      none to walk, every neuron tensor looked like one empty storage (a tied model refused
      to save, `max_shard_size` was ignored); hidden, they read its storage as a tensor's.
    Everyone else (swap_tensors, user code) sees it."""

    def __init__(self, name, attr):
        self.name = name
        self.attr = attr

    def __get__(self, obj, cls=None):
        f = sys._getframe(1)
        while f is not None and f.f_globals.get("__name__") == "torch.utils._python_dispatch":
            f = f.f_back  # is_traceable_wrapper_subclass(): whoever called it is the asker
        if f is not None:
            module = f.f_globals.get("__name__", "")
            if module.startswith(_HIDDEN_FROM) or (
                    module == "torch.nn.modules.module" and f.f_code.co_name == "_apply"
                    and type(f.f_locals.get("param")) is NeuronTensor):
                raise AttributeError(self.name)
        return self.attr.__get__(obj, cls)


_PT2 = ("torch._dynamo", "torch._functorch", "torch._subclasses", "torch._inductor",
        "torch.fx", "torch._export", "torch._higher_order_ops", "torch._guards")
_HIDDEN_FROM = _PT2 + ("huggingface_hub",)
for _name in ("__tensor_flatten__", "__tensor_unflatten__"):
    setattr(NeuronTensor, _name, _Protocol(_name, NeuronTensor.__dict__[_name]))


def _swap_keeping_attributes(t1, t2, _swap=torch.utils.swap_tensors):
    """Note [Module.to keeps Parameters]: a swap exchanges the two objects' `__dict__`s, so
    the Parameter `Module._apply` keeps would lose its Python attributes (`_no_weight_decay`,
    `_is_hf_initialized`, `sequence_parallel`: flags optimizers' param groups and loaders
    read), which CUDA's `.data` path keeps. Swapping from there, they are carried over first
    (ours, the buffer handle and layout, stay with the neuron tensor). Where `_apply` swaps
    only because we asked it to (`_swap_on_conversion`), a conversion `.data =` can do
    (neuron to neuron, CPU to CPU) takes `.data =`, as it would have without us. Everyone
    else's swap is PyTorch's. A parameter's gradient hooks (`register_hook`,
    `register_post_accumulate_grad_hook`: a gradient clamp or mask) are kept too: autograd
    leaves them on the tensor swapped out, so a hook registered before `.to("neuron")` (or
    `.cpu()`) silently stopped running; where `_apply` swaps because we asked, they are
    registered again on the tensor swapped in, as `.data =` keeps them (with PyTorch's own
    swap flag set they are dropped, as PyTorch drops them on any device)."""
    if sys._getframe(1).f_code is _APPLY:
        if (not _user_swaps() and not torch.__future__.get_overwrite_module_params_on_conversion()
                and torch._has_compatible_shallow_copy_type(t1, t2)):
            t1.data = t2
            return
        for k, v in t1.__dict__.items():
            if k not in _OURS:
                t2.__dict__.setdefault(k, v)
        _swap(t1, t2)
        if not _user_swaps():
            for hooks in ("_backward_hooks", "_post_accumulate_grad_hooks"):
                if getattr(t1, hooks, None) is not None:  # the dicts stayed with t1's object
                    setattr(t1, hooks, getattr(t1, hooks))  # the setter registers them anew
        return
    _swap(t1, t2)


_OURS = ("_engine", "_handle", "_info", "_is_param")
_APPLY = torch.nn.Module._apply.__code__
_user_swaps = torch.__future__.get_swap_module_params_on_conversion


def _swap_on_conversion():
    """Note [Module.to keeps Parameters]: moving a neuron parameter back to the CPU
    (`module.cpu()`, `.to("cpu")`: Trainer, Lightning's teardown) made a new CPU Parameter,
    because `_apply` keeps the object by `.data =` only between tensor types PyTorch deems
    compatible (CPU and CUDA are; a wrapper subclass and the CPU are not, nor would a C++
    PrivateUse1 backend be) and swaps only into traceable subclasses: ties came undone
    silently (GPT-2's lm_head and wte became two Parameters) and optimizers built before
    kept training the old ones. Asked by `_apply` for a module holding a neuron parameter
    or gradient, this answers PyTorch's own "swap on conversion" yes, so the CPU tensor is
    swapped into the old object; where a swap cannot be made (an autograd graph or a weakref
    still holds the parameter) `_apply` raises "Couldn't swap", never unties."""
    if _user_swaps():
        return True
    f = sys._getframe(1)
    if f.f_code is not _APPLY:
        return False
    module = f.f_locals.get("self")
    params = getattr(module, "_parameters", None) or {}
    return any(type(p) is NeuronTensor or type(p.grad) is NeuronTensor
               for p in params.values() if p is not None)


class _Depth(threading.local):
    n = 0


_DEPTH = _Depth()


def _places(module, recurse):
    """Where a module's tensors are: parameters and gradients by identity, buffers by name."""
    where, buffers = {}, {}
    for m in module.modules() if recurse else (module,):
        for p in m._parameters.values():
            if p is not None:
                where[id(p)] = p.device
                if p.grad is not None:
                    where[id(p.grad)] = p.grad.device
        for name, b in m._buffers.items():
            if b is not None:
                buffers[(m, name)] = b.device
    return where, buffers


def _whole_or_not_at_all(apply):
    """Note [A failed move moves nothing]: `module.cpu()` (or `.to(...)`) of a module holding
    neuron tensors (or moving to neuron) swaps one parameter at a time (Note [Module.to keeps
    Parameters]); where a swap cannot be made (an autograd graph still holds that parameter:
    the step an exception left, or a loss kept alive) `_apply` raises "Couldn't swap" after
    moving the parameters before it, so the model was left half on the CPU, half on neuron,
    and its next forward failed on mixed devices. On CUDA the move succeeds (`.data =`).
    Here the outermost `_apply` that fails moves what it had moved back where it was
    (parameters and gradients by identity, which the swaps keep; buffers by name, which
    `_apply` replaces) and raises PyTorch's error: the module is whole where it was."""
    def _apply(self, fn, recurse=True):
        if _DEPTH.n:
            return apply(self, fn, recurse)
        where, buffers = _places(self, recurse)
        _DEPTH.n += 1
        try:
            return apply(self, fn, recurse)
        except RuntimeError as e:
            if "Couldn't swap" not in str(e):
                raise
            now, now_buffers = _places(self, recurse)
            if not any(d.type == DEVICE_TYPE for places in (where, buffers, now, now_buffers)
                       for d in places.values()):
                raise  # no neuron tensor: PyTorch's own swap (its flag set), PyTorch's result
            apply(self, lambda t: t.to(where[id(t)]) if where.get(id(t), t.device) != t.device
                  else t, recurse)
            for (m, name), device in buffers.items():
                b = m._buffers.get(name)
                if b is not None and b.device != device:
                    m._buffers[name] = b.to(device)
            raise
        finally:
            _DEPTH.n -= 1
    return _apply


patches.patch(torch.utils, "swap_tensors", _swap_keeping_attributes,
              rests_on="Module._apply (its code object) calling torch.utils.swap_tensors")
patches.patch(torch.nn.Module, "_apply", _whole_or_not_at_all(torch.nn.Module._apply),
              rests_on="Module._apply raising \"Couldn't swap\" (a RuntimeError) after earlier "
                       "swaps, every move of a module (to, cpu, cuda, half...) going through it")
patches.patch(torch.__future__, "get_swap_module_params_on_conversion", _swap_on_conversion,
              rests_on="Module._apply asking torch.__future__ per module, its frame's `self`")


def _dlpack_error(t) -> RuntimeError:
    return RuntimeError(  # Tensor.__dlpack__'s words for an XLA tensor it cannot export
        f"Can't export to dlpack a {t.device} tensor: its memory is on the device. Copy it "
        f"to the host first: `t.cpu()`.")


def _to_dlpack(original):
    def to_dlpack(tensor, *args, **kwargs):
        if type(tensor) is NeuronTensor:
            raise _dlpack_error(tensor)
        return original(tensor, *args, **kwargs)
    return to_dlpack


for _owner in (torch, torch.utils.dlpack):  # one function, re-exported
    patches.patch(_owner, "to_dlpack", wrap=_to_dlpack,
                  rests_on="torch.to_dlpack reads a tensor's C++ storage, which ours lacks")


def _refuse_sharing(t):
    """Note [Sharing across processes]: torch.multiprocessing's reducer for neuron tensors."""
    raise RuntimeError(
        f"A {DEVICE_TYPE} tensor cannot be sent to another process: its buffer lives in this "
        f"process's device memory and cannot be shared. Send t.cpu() and move it with "
        f".to('{DEVICE_TYPE}') in the other process (a copy: writes there are not seen here).")


def fresh(engine, handle, size, stride, dtype, info) -> NeuronTensor:
    """`NeuronTensor(engine, handle, size, stride, 0, dtype, info=info)`, made without going
    through the class's `__new__` (this runs per op): a view at offset 0 of `handle`, its
    layout precomputed per op signature by the engine's meta cache (`info`)."""
    # (the default keywords not passed: each costs time)
    t = _make_wrapper(NeuronTensor, size, strides=stride, dtype=dtype,
                      device=engine.tdev or _device(engine), storage_size=_UNBOUNDED)
    t._engine = engine
    t._handle = handle
    t._info = info
    return t


_make_wrapper = torch.Tensor._make_wrapper_subclass


def _device(engine) -> torch.device:
    """neuron:k for core k's engine (made on first use: the device type is named only once
    registration has run)."""
    engine.tdev = torch.device(DEVICE_TYPE, engine.index)
    return engine.tdev


def engine_of(args, kwargs):
    """The engine of the first neuron tensor among an op's arguments (in tree_flatten's
    order: the positional ones, and the items of lists and tuples among them holding no
    container, are looked at without it: a foreach op's lists are walked once)."""
    for v in args:
        if type(v) is NeuronTensor:
            return v._engine
        if type(v) is list or type(v) is tuple:
            for x in v:
                if type(x) is NeuronTensor:
                    return x._engine
                if isinstance(x, (list, tuple, dict)):
                    break
            else:
                continue
            break
        if isinstance(v, (list, tuple, dict)):
            break
    for v in tree_flatten((args, kwargs))[0]:
        if type(v) is NeuronTensor:
            return v._engine
    raise AssertionError("an op reached the neuron tensor's dispatch without one")


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
    implicit = (torch.get_default_dtype(), torch.int64, torch.bool,
                torch.complex64 if torch.get_default_dtype() == torch.float32
                else torch.complex128)
    if (t.dtype != torch.get_default_dtype() if cpu.numel() == 0 else t.dtype not in implicit):
        suffixes.append(f"dtype={t.dtype}")
    if t.grad_fn is not None:
        suffixes.append(f"grad_fn=<{type(t.grad_fn).__name__}>")
    elif t.requires_grad:
        suffixes.append("requires_grad=True")
    return torch._tensor_str._add_suffixes(prefix + body, suffixes, len(prefix), False)


# Note [Setting .data across devices]: `cpu_param.data = t.to("neuron")` (FSDP2 moves a
# CPU-built module's parameters and buffers this way; so do hand-written `.to` helpers) is
# refused by C++'s set_data: a CPU tensor and a PrivateUse1 wrapper are no "compatible
# shallow-copy type" (c10's dense list lacks PrivateUse1: pytorch/pytorch#196975, which C++
# PrivateUse1 backends hit too). On CUDA the same line keeps the object and moves it. So
# `torch.Tensor.data`'s setter, for a neuron value set into a tensor of another device only,
# swaps a fresh alias of that value into the old Python object (torch.utils.swap_tensors,
# as FSDP2 does for wrapper subclasses): the object, its requires_grad and what is tied to
# it stay; it aliases the value's buffer, as `.data =` does. Every other `.data =` is
# PyTorch's own, unchanged.
_BASE_DATA = torch._C.TensorBase.data


def _set_data(self, new):
    if not isinstance(new, NeuronTensor) or type(self) not in (torch.Tensor, torch.nn.Parameter):
        try:
            return _BASE_DATA.__set__(self, new)
        except RuntimeError as e:  # the other way, a neuron tensor given another device's
            if not isinstance(self, NeuronTensor) or "incompatible tensor type" not in str(e):
                raise
            raise RuntimeError(
                f"{e} A neuron tensor cannot take a {new.device} tensor's data (`.data =`): "
                f"C++ set_data refuses it for a Python backend's tensors (pytorch#196975). "
                f"FSDP1's CPUOffload does this; move with `.to()` instead.") from None
    grad, self.grad = self.grad, None
    with torch.no_grad():
        alias = new.detach()
        alias.requires_grad_(self.requires_grad)
        if isinstance(self, torch.nn.Parameter):
            alias = torch.nn.Parameter(alias, requires_grad=self.requires_grad)
    try:
        torch.utils.swap_tensors(self, alias)
    except RuntimeError as e:
        self.grad = grad
        raise RuntimeError(
            f"Attempted to call `variable.set_data(tensor)` with a {new.device} tensor on a "
            f"{self.device} tensor, which a neuron tensor can only do by taking the tensor's "
            f"place (torch.utils.swap_tensors), and that failed: {e}") from e
    if grad is not None:
        self.grad = grad.to(new.device)


def install_set_data() -> None:
    """Note [Setting .data across devices]. Idempotent."""
    patches.patch(torch.Tensor, "data", property(_BASE_DATA.__get__, _set_data,
                                                 doc=_BASE_DATA.__doc__),
                  rests_on="torch._C.TensorBase.data's getter (the C++ one, kept)")
