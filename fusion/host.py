"""How a group's CPU kernels run on the host, inside the engine's dispatch or outside it:
with the view keys PyTorch's dispatch excluded put back (`cpu_kernels`), and with their C++
warnings raised where they are caught (`cpp_warnings_scope`, `QUIET_OPS`). Used by the
programs here and by the engine's probe, fallback and flush."""
from __future__ import annotations

import contextlib

import torch

# Note [CPU kernels inside dispatch]: inside `__torch_dispatch__` PyTorch excludes the keys
# above Python, the Conjugate and Negative fallbacks among them. A CPU kernel run there that
# makes a lazy conjugate view and hands it to another op (pinv's `U.mH()`, `solve(left=
# False)`) then read it unconjugated: silently wrong complex results. The CPU's kernels run
# with those keys back on (and ZeroTensor's), as they run on CPU; autograd stays off.
_VIEW_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.Conjugate)
              | torch._C.DispatchKeySet(torch._C.DispatchKey.Negative)
              | torch._C.DispatchKeySet(torch._C.DispatchKey.ZeroTensor))


_CONJUGATE = torch._C.DispatchKey.Conjugate
_NO_GUARD = contextlib.nullcontext()


def cpu_kernels():
    """A context that runs CPU kernels with the conjugate / negative view keys on (none
    needed outside dispatch: the flush of a sync)."""
    if not torch._C._dispatch_tls_is_dispatch_key_excluded(_CONJUGATE):
        return _NO_GUARD
    exclude = torch._C._dispatch_tls_local_exclude_set()
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                           exclude - _VIEW_KEYS)


_PYTHON_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.Python)
                | torch._C.DispatchKeySet(torch._C.DispatchKey.PythonTLSSnapshot))
_HOST_EXCLUDES: dict = {}  # raw exclude set -> host_kernels' exclude set


def host_kernels():
    """`_DisableTorchDispatch()` and `cpu_kernels()` as one guard (a flush runs under both,
    per op in eager mode): the keys `_DisableTorchDispatch` excludes (Python and its TLS
    snapshot) are excluded, and inside dispatch the view keys are back on."""
    if not torch._C._dispatch_tls_is_dispatch_key_excluded(_CONJUGATE):
        return torch._C._DisableTorchDispatch()
    exclude = torch._C._dispatch_tls_local_exclude_set()
    raw = exclude.raw_repr()
    new = _HOST_EXCLUDES.get(raw)
    if new is None:
        if len(_HOST_EXCLUDES) > 64:
            _HOST_EXCLUDES.clear()
        new = _HOST_EXCLUDES[raw] = (exclude - _VIEW_KEYS) | _PYTHON_KEYS
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), new)


# Note [Host calls]: a flush runs under `host_kernels()`, and in eager mode a flush is one op:
# the Python guard (reading the thread's key sets, building the new ones, entering and leaving
# a pybind context manager) cost about as much as the rest of an eager launch's bookkeeping.
# `host_call(fn, *args)` is `fn(*args)` under the same keys; with the native hooks (Note
# [Native hooks] in adaptive_eager/integration/native.py) it is one C call that sets them
# and restores them on return, by value or by exception (csrc/neuron_hooks.cpp `host_call`);
# without them, the guard.
def _python_host_call(fn, *args):
    with host_kernels():
        return fn(*args)


host_call = _python_host_call


def use_native_host_call(fn) -> None:
    """Note [Host calls]: `host_call` is the native hooks' `fn` from now on (registration)."""
    global host_call
    host_call = fn


# Note [C++ warnings]: a TORCH_WARN inside a `torch.ops` call is not turned into a Python
# warning when that call returns: it waits in the warning buffer of the outermost Python call
# into torch (the user's `torch.add(..., out=t)`, or in adaptive mode whatever call flushes)
# and is raised when that returns. So the warnings of internal calls (a meta kernel's, the CPU
# probe's, a device kernel's) reached the user besides the ones given on purpose: CPU's resize
# warning came twice, and a kernel's warning came at a later statement in adaptive mode.
# `cpp_warnings_scope(fn)` runs fn inside a Python call into torch of its own (a torch
# function whose argument answers __torch_function__), so its C++ warnings become Python
# warnings when it returns, where a catch_warnings sees them. (About 5 us: for work done once
# per op signature, or for the few kernels in QUIET_OPS.)
class _Scope:
    __slots__ = ("fn",)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return args[0].fn()


def cpp_warnings_scope(fn):
    """fn() with its C++ warnings raised as Python warnings when it returns."""
    scope = _Scope()
    scope.fn = fn
    return torch.neg(scope)


# Ops whose CPU kernel warned in the engine's probe: the engine gives those warnings at the
# call, once per call (meta.give_warnings), so the device's run of the kernel drops its own.
QUIET_OPS: set = set()
