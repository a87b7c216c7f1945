"""User hooks on neuron autograd graphs, guarded so that one that raises reaches the caller.

Note [Hooks that raise]: autograd calls a hook and, when it raises, unwinds with the Python
error still pending through the node's device guard, which for a Python backend calls into
Python: the process aborts ("terminate called without an active exception"; CUDA's guard is
C++). So hooks on neuron tensors (tensor hooks, post-accumulate-grad hooks, nn.Module's full
backward hooks, which BackwardHook puts on autograd nodes) hand their error over (Note
[Device-thread errors] in errors.py) and return what autograd refuses with a C++ error (a
gradient of another device; a tuple of the wrong length), which unwinds safely; the backward
wrapper in _registration re-raises the hook's own exception. Outside a backward a hook's error
is raised as it is.
"""
from __future__ import annotations

import functools

import torch

from .errors import _hand_off, in_backward
from .source import DEVICE_TYPE


def guarded(hook):
    """Note [Hooks that raise]: `hook`, whose error inside a backward is handed over."""
    @functools.wraps(hook)
    def guarded(*args):
        try:
            return hook(*args)
        except BaseException as e:
            if not in_backward():
                raise  # nothing to unwind through
            _hand_off(e)
            return torch.empty(0)  # a CPU gradient: autograd's C++ check refuses it
    return guarded


def _guarded_node_hook(hook):
    """Note [Hooks that raise] for a hook on an autograd node (`hook(grads, ...)` returns
    a replacement for `grads`): one of the wrong length is refused by a C++ check."""
    @functools.wraps(hook)
    def guarded(*args):
        try:
            return hook(*args)
        except BaseException as e:
            if not in_backward() or not any(
                    isinstance(g, torch.Tensor) and g.device.type == DEVICE_TYPE
                    for a in args for g in a):
                raise  # not a neuron backward: PyTorch's own path
            _hand_off(e)
            return (None,) * (len(args[0]) + 1)
    return guarded


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


def module_backward_hook_class():
    """nn.Module's full backward (pre-)hooks run inside Python hooks that BackwardHook puts
    on autograd nodes: those are guarded (Note [Hooks that raise])."""
    from torch.utils.hooks import BackwardHook

    class GuardedBackwardHook(BackwardHook):
        _neuron = True

        def _set_user_hook(self, grad_fn):
            return super()._set_user_hook(_GuardedNode(grad_fn))

        def _apply_on_tensors(self, fn, args):
            return super()._apply_on_tensors(lambda g: fn(_GuardedNode(g)), args)
    return GuardedBackwardHook
