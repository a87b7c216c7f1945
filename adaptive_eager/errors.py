"""The errors users see, and how an op's error reaches them.

Two kinds (STYLE.md): a user error is raised with PyTorch's own (CPU's) exception at the call;
an error only execution finds is a deferred device error, raised at the next sync as a
NeuronRuntimeError naming the op and the user's line. Bugs of ours are raised as themselves.
"""
from __future__ import annotations

import threading

import torch

from fusion.ir import extent_bytes
from .engine.source import DEVICE_TYPE, file_line


class NeuronRuntimeError(RuntimeError):
    """An error the device found while running an op, raised at the next sync point."""

    def __init__(self, op: str, message: str, source):
        self.op = op
        self.source = source = file_line(source)  # (file, line, stack)
        where = f'File "{source[0]}", line {source[1]}' if source else "unknown"
        if source and source[2]:
            where += "\n" + source[2]
        super().__init__(f"An error occurred on Neuron for operation={op}; "
                         f"error message={message}; python stack trace={where}")



def _raise_launch_error(launch):
    """Raise the user-facing error of a failed launch: the op's own error as a
    NeuronRuntimeError naming the op and the user's source line; a bug of ours (an internal
    error while running it) as itself, with a note."""
    err = launch.error
    k = getattr(err, "instr_index", 0)
    node = launch.context[k] if launch.context else None
    op = node.func._schema.name if node is not None else launch.name
    if launch.internal:
        note = f"(internal error of adaptive-eager while running {op}: please report it)"
        if note not in getattr(err, "__notes__", ()):
            err.add_note(note)
        raise err
    raise NeuronRuntimeError(op, f"{type(err).__name__}: {err}",
                             node.source if node is not None else None) from err



class NeuronFallbackError(RuntimeError):
    """A device op could not run and CPU recovery is turned off."""



def _out_of_bounds(size, stride, off, dtype, nbytes):
    """CPU's error for a view that would address memory outside its buffer."""
    need = extent_bytes(size, stride, off, dtype.itemsize)
    e = RuntimeError(f"setStorage: sizes {list(size)}, strides {list(stride)}, storage offset "
                     f"{off}, and itemsize {dtype.itemsize} requiring a storage size of {need} "
                     f"are out of bounds for storage of size {nbytes}")
    e._ae_user_error = True
    raise e



_HANDOFF: list = []  # errors raised on autograd's device thread, for the caller (_surface)

_HANDOFF_LOCK = threading.Lock()



def _hand_off(e: BaseException) -> str:
    """Note [Device-thread errors]: autograd runs a neuron backward on its own device thread,
    where a Python exception unwinding through PyTorch's Python device guard aborts the
    process (the guard calls into Python while the error is pending). There the error is
    handed over instead: the op returns a value the dispatcher refuses with a C++ error,
    which autograd carries to the caller safely, and the backward wrapper in
    _registration re-raises the original exception."""
    with _HANDOFF_LOCK:
        _HANDOFF.append(e)
    return f"<{type(e).__name__} on autograd's device thread: {e}>"



def in_backward() -> bool:
    """Inside a backward node (autograd's device thread, or the caller's own thread once
    backward runs single-threaded): where an error must be handed over, not raised."""
    return (torch._C._current_autograd_node() is not None
            or type(threading.current_thread()) is threading._DummyThread)


def after_fork() -> None:
    """A forked child's own hand-off lock (Note [Threads] across os.fork in (engine.py))."""
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



def _generator_error(g) -> RuntimeError:
    """As CUDA: a device op refuses a generator of another device (and a neuron generator
    cannot be made: README, known gaps)."""
    return RuntimeError(f"Expected a '{DEVICE_TYPE}' device type for generator but found "
                       f"'{g.device.type}'")



def _sparse_error(op: str, layout) -> NotImplementedError:
    """Sparse results (`to_sparse`, `sparse_coo_tensor(..., device="neuron")`) are refused."""
    return NotImplementedError(
        f"{op}: sparse layouts (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, "
        f"torch.sparse_bsr, torch.sparse_bsc) are not supported on the neuron device, which "
        f"holds strided tensors only (this result would be {layout}). Keep sparse tensors on "
        f"the CPU.")


