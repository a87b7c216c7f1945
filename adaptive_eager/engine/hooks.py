"""User hooks on neuron autograd graphs, guarded so that one that raises reaches the caller.

Note [Hooks that raise]: autograd calls a hook and, when it raises, unwinds with the Python
error still pending through the node's device guard, which for a Python backend calls into
Python: the process aborts ("terminate called without an active exception"; CUDA's guard is
C++). So hooks on neuron tensors (tensor hooks, post-accumulate-grad hooks, nn.Module's full
backward hooks, which BackwardHook puts on autograd nodes) hand their error over (Note
[Device-thread errors] below) and return what autograd refuses with a C++ error (a
gradient of another device; a tuple of the wrong length), which unwinds safely; the backward
wrapper in _registration re-raises the hook's own exception. Outside a backward a hook's error
is raised as it is. A hook that returns the wrong type is the same case: PyTorch's check
raises its TypeError with the Python error pending, so the guard raises it instead. Saved-
tensor unpack hooks (`saved_tensors_hooks`, `save_on_cpu`, and non-reentrant
`torch.utils.checkpoint`, whose recompute runs inside one) are guarded too: their refusal is
a non-tensor, which autograd's C++ check refuses. Not guarded (PyTorch's node types cannot be
patched): hooks registered directly on a node, `y.grad_fn.register_hook(...)`.
"""
from __future__ import annotations

import functools
import threading

import torch

from .. import patches
from ..config import DEVICE_TYPE


_HANDOFF: list = []  # errors raised on autograd's device thread, for the caller (_surface)

_HANDOFF_LOCK = threading.Lock()



def _hand_off(e: BaseException) -> str:
    """Note [Device-thread errors]: autograd runs a neuron backward on its own device thread,
    where a Python exception unwinding through PyTorch's Python device guard aborts the
    process (the guard calls into Python while the error is pending). There the error is
    handed over instead: the op returns a value the dispatcher refuses with a C++ error,
    which autograd carries to the caller safely, and the backward wrapper in
    integration/registration.py re-raises the original exception."""
    with _HANDOFF_LOCK:
        _HANDOFF.append(e)
    return f"<{type(e).__name__} on autograd's device thread: {e}>"



def in_backward() -> bool:
    """Inside a backward node (autograd's device thread, or the caller's own thread once
    backward runs single-threaded): where an error must be handed over, not raised."""
    return (torch._C._current_autograd_node() is not None
            or type(threading.current_thread()) is threading._DummyThread)


def after_fork() -> None:
    """A forked child's own hand-off lock (Note [Threads] across os.fork in engine.py)."""
    global _HANDOFF_LOCK
    _HANDOFF_LOCK = threading.Lock()


def take_handoff() -> BaseException | None:
    """The first error handed over from autograd's device thread, if any (clears them)."""
    with _HANDOFF_LOCK:
        if not _HANDOFF:
            return None
        first = _HANDOFF[0]
        _HANDOFF.clear()
        return first


def guarded(hook):
    """Note [Hooks that raise]: `hook`, whose error inside a backward is handed over."""
    @functools.wraps(hook)
    def guarded(*args):
        try:
            result = hook(*args)
        except BaseException as e:
            if not in_backward():
                raise  # nothing to unwind through
            _hand_off(e)
            return torch.empty(0)  # a CPU gradient: autograd's C++ check refuses it
        if result is None or isinstance(result, torch.Tensor) or not in_backward():
            return result
        _hand_off(TypeError(f"expected Variable, but hook returned '{type(result).__name__}'"))
        return torch.empty(0)
    return guarded


def _guarded_node_hook(hook):
    """Note [Hooks that raise] for a hook on an autograd node (`hook(grads, ...)` returns
    a replacement for `grads`): one of the wrong length is refused by a C++ check."""
    @functools.wraps(hook)
    def guarded(*args):
        grads = args[-2] if len(args) == 3 else args[0]  # legacy module hooks: (module, gi, go)
        try:
            result = hook(*args)
        except BaseException as e:
            if not in_backward() or not _neuron_in(g for a in args[-2:] for g in a):
                raise  # not a neuron backward: PyTorch's own path
            _hand_off(e)
            return (None,) * (len(grads) + 1)
        if result is None or isinstance(result, tuple) or not in_backward() \
                or not _neuron_in(g for a in args[-2:] for g in a):
            return result
        _hand_off(TypeError(f"expected tuple, but hook returned '{type(result).__name__}'"))
        return (None,) * (len(grads) + 1)
    return guarded


def _neuron_in(values) -> bool:
    return any(isinstance(v, torch.Tensor) and v.device.type == DEVICE_TYPE for v in values)


class _Packed:
    """What a guarded pack hook saves: the user's packed value, and whether the tensor was a
    neuron tensor (only then does its unpack run behind the Python device guard)."""
    __slots__ = ("value", "neuron")

    def __init__(self, value, neuron: bool):
        self.value, self.neuron = value, neuron


def guarded_saved_tensor_hooks(push):
    """Note [Hooks that raise]: `torch._C._autograd._push_saved_tensors_default_hooks`, with
    the unpack hook guarded (every `saved_tensors_hooks` context, `save_on_cpu` and the
    non-reentrant `torch.utils.checkpoint` push through it)."""
    @functools.wraps(push)
    def push_guarded(pack_hook, unpack_hook):
        if isinstance(unpack_hook, torch.fx.GraphModule):  # AOTAutograd inlines these
            return push(pack_hook, unpack_hook)

        def pack(t):
            return _Packed(pack_hook(t), t.device.type == DEVICE_TYPE)

        def unpack(packed):
            if not packed.neuron:
                return unpack_hook(packed.value)
            try:
                return unpack_hook(packed.value)
            except BaseException as e:
                if not in_backward():
                    raise
                _hand_off(e)
                return None  # not a tensor: autograd's C++ check refuses it
        return push(pack, unpack)
    return push_guarded


class _GuardedNode:
    """An autograd node whose hooks registered through it are guarded."""
    __slots__ = ("_fn",)

    def __init__(self, fn):
        self._fn = fn._fn if type(fn) is _GuardedNode else fn

    def register_hook(self, hook):
        return self._fn.register_hook(_guarded_node_hook(hook))

    def register_prehook(self, hook):
        return self._fn.register_prehook(_guarded_node_hook(hook))

    def __getattr__(self, name):
        return getattr(self._fn, name)


def install() -> None:
    """Guard the hooks PyTorch registers on autograd's behalf (Note [Hooks that raise])."""
    import torch.nn.modules.module as module
    patches.patch(module, "BackwardHook", wrap=lambda _: _module_backward_hook_class(),
                  rests_on="nn.Module's full backward (pre-)hooks made through "
                           "torch.nn.modules.module.BackwardHook (_set_user_hook, "
                           "_apply_on_tensors)")

    def guard_legacy(get):  # legacy `register_backward_hook`
        def _get_backward_hooks(self):
            full, non_full = get(self)
            return full, [_guarded_node_hook(h) for h in non_full]
        return _get_backward_hooks
    patches.patch(module.Module, "_get_backward_hooks", wrap=guard_legacy,
                  rests_on="Module._get_backward_hooks (private), returning (full, non_full)")
    patches.patch(torch._C._autograd, "_push_saved_tensors_default_hooks",
                  wrap=guarded_saved_tensor_hooks,
                  rests_on="torch._C._autograd._push_saved_tensors_default_hooks (private), "
                           "which every saved_tensors_hooks context calls")


def _module_backward_hook_class():
    """nn.Module's full backward (pre-)hooks run inside Python hooks that BackwardHook puts
    on autograd nodes: those are guarded (Note [Hooks that raise])."""
    from torch.utils.hooks import BackwardHook

    class GuardedBackwardHook(BackwardHook):
        def _set_user_hook(self, grad_fn):
            return super()._set_user_hook(_GuardedNode(grad_fn))

        def _apply_on_tensors(self, fn, args):
            return super()._apply_on_tensors(lambda g: fn(_GuardedNode(g)), args)
    return GuardedBackwardHook
