"""The errors users see, and how an op's error reaches them.

Two kinds (adaptive_eager/README.md, "Design contracts"): a user error is raised with
PyTorch's own (CPU's) exception at the call; an error only execution finds is a deferred
device error, raised at the next sync as a NeuronRuntimeError naming the op and the user's
line. Bugs of ours are raised as themselves.
"""
from __future__ import annotations

import weakref

import torch

from fusion.ir import extent_bytes
from .config import DEVICE_TYPE
from .engine.source import BACKWARD, file_line


class NeuronRuntimeError(RuntimeError):
    """An error the device found while running an op, raised at the next sync point."""

    def __init__(self, op: str, message: str, source):
        self.op = op
        backward = source is not None and source[0] is BACKWARD  # Note [Backward lines]
        self.source = source = file_line(source)  # (file, line, stack)
        where = f'File "{source[0]}", line {source[1]}' if source else "unknown"
        if backward:
            where += " (the forward op this backward op differentiates)"
        if source and source[2]:
            where += "\n" + source[2]
        super().__init__(f"An error occurred on Neuron for operation={op}; "
                         f"error message={message}; python stack trace={where}")

    def __reduce__(self):
        """Pickled (a worker's error sent to another process) as its message and attributes:
        unpickling calls no __init__ (its arguments are gone; BaseException's reduce gave
        `cls(message)`, a TypeError)."""
        return _rebuilt, (type(self), self.args, self.__dict__)


def _rebuilt(cls, args, state):
    e = cls.__new__(cls)
    e.args = args
    e.__dict__.update(state)
    return e


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
    at = getattr(err, "_ae_kernel_at", None)  # Note [Custom kernels]: the body's line
    where = f" (raised in kernel {op} at {at})" if at else ""
    raise NeuronRuntimeError(op, f"{type(err).__name__}: {err}{where}",
                             node.source if node is not None else None) from err



class NeuronFallbackError(RuntimeError):
    """A device op could not run and CPU recovery is turned off."""


class FlushInterrupted(Exception):
    """The flush that computes a value stopped before it did (KeyboardInterrupt, ...)."""


class NeuronInductorError(RuntimeError):
    """TorchInductor (torch.compile's default backend) was asked to compile neuron code."""


def user_error(e: BaseException) -> BaseException:
    """Tag `e` as CPU's own error for the user's call (Engine.dispatch raises it with no
    frames of ours); returns `e`."""
    e._ae_user_error = True
    return e


def is_user_error(e: BaseException) -> bool:
    return getattr(e, "_ae_user_error", False)


# Note [Copied views]: conjugate and negative views are materialized on the device (the
# wrapper tensor cannot carry the bit: `_materialized` in engine/handlers.py), so a write through one
# (`z.conj().add_(1)`, `z.conj().imag.fill_(0)`, `z.conj().copy_(w)`) would land in the copy
# and leave `z` as it was, where CPU writes `z`: silently wrong. The copies' buffers are kept
# here (weakly) and every write path refuses them: queued and replayed ops writing an
# argument (queue.record, replay.follow), host and direct copies (transfer.write,
# transfer.device_copy), and in-place calls of a graph torch.compile captured
# (refuse_traced_writes); a compiled function's outputs that are copied views are marked at
# each call (traced_copy_outputs). A clone of the view is writable. (Most programs make none:
# each path asks only once one was made, `COPIED[0]`, a list read: a WeakSet's truth is a
# Python call.)
COPIED_VIEWS: weakref.WeakSet = weakref.WeakSet()
COPIED = [False]


def copied_view(t):
    """Note [Copied views]: `t` is a materialized conj/neg view; returns it. A tensor traced
    on the device has no buffer: Dynamo's fake tensor has its storage marked instead
    (`refuse_traced_writes`), AOTAutograd's functional tensor nothing (its graph holds the
    copy: `conj_physical`)."""
    handle = getattr(t, "_handle", None)
    if handle is not None:
        COPIED_VIEWS.add(handle)
        COPIED[0] = True
    elif isinstance(t, torch._subclasses.fake_tensor.FakeTensor):
        from torch.multiprocessing.reductions import StorageWeakRef
        if len(TRACED_COPIES) > 1024:  # (a weak reference keeps its storage's address taken)
            TRACED_COPIES.difference_update([r for r in TRACED_COPIES if r.expired()])
        TRACED_COPIES.add(StorageWeakRef(t.untyped_storage()))
    return t


TRACED_COPIES: set = set()  # StorageWeakRefs of Dynamo's fake copied views (Note [Copied views])


def traced_copy(v) -> bool:
    """Note [Copied views]: is `v` a fake tensor over a traced copied view's storage?"""
    from torch.multiprocessing.reductions import StorageWeakRef
    return bool(TRACED_COPIES) and isinstance(v, torch._subclasses.fake_tensor.FakeTensor) \
        and StorageWeakRef(v.untyped_storage()) in TRACED_COPIES
_WRITES = {"setitem", "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow",
           "iand", "ior", "ixor", "ilshift", "irshift", "imatmul"}


def refuse_traced_writes(gm) -> None:
    """Note [Copied views] in a graph Dynamo captured: an in-place call (`v.add_(1)`,
    `v[0] = 5`, `v += 1`, `out=v`) writing a copied view (or a view of one) is refused, as in
    eager mode: the compiled graph would write the copy, where CPU writes the tensor."""
    if not TRACED_COPIES:
        return
    for node in gm.graph.nodes:
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        written = []
        if node.op in ("call_method", "call_function") and node.args and (
                (name.endswith("_") and not name.startswith("_")) or name in _WRITES
                or (name.startswith("__i") and name.endswith("__"))):
            written.append(node.args[0])
        if "out" in node.kwargs:
            written.append(node.kwargs["out"])
        for w in written:
            if traced_copy(getattr(w, "meta", {}).get("example_value")):
                refuse_copied_view([None])


def traced_copy_outputs(gm) -> list[int]:
    """Note [Copied views]: which outputs of a graph Dynamo captured are copied views (or
    views of one): the backend marks them at each run, as eager mode marks its own, so a
    write to one after the compiled call is refused (CPU's output is a view of its input,
    which the write reaches)."""
    if not TRACED_COPIES:
        return []
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return [i for i, node in enumerate(out if isinstance(out, (list, tuple)) else (out,))
            if traced_copy(getattr(node, "meta", {}).get("example_value"))]


def any_copied(handles, writes) -> bool:
    """Note [Copied views]: is one of `handles[i] for i in writes` a copied view's buffer?"""
    return any(handles[i] in COPIED_VIEWS for i in writes)


def refuse_copied_view(handles) -> None:
    """Note [Copied views]: raise if one of the written `handles` is a materialized view's."""
    for h in handles:
        if h is None or h in COPIED_VIEWS:  # (None: a traced one, `refuse_traced_writes`)
            raise user_error(RuntimeError(
                f"a write through a conj() or neg view of a {DEVICE_TYPE} tensor is not "
                f"supported: on {DEVICE_TYPE} the view is a copy, so the write would not reach "
                f"the tensor it views. Write the tensor itself (e.g. z.copy_(w.conj()) for "
                f"z.conj().copy_(w)), or clone the view to write a new tensor."))



def _out_of_bounds(size, stride, off, dtype, nbytes):
    """CPU's error for a view that would address memory outside its buffer."""
    need = extent_bytes(size, stride, off, dtype.itemsize)
    e = RuntimeError(f"setStorage: sizes {list(size)}, strides {list(stride)}, storage offset "
                     f"{off}, and itemsize {dtype.itemsize} requiring a storage size of {need} "
                     f"are out of bounds for storage of size {nbytes}")
    raise user_error(e)



def _generator_error(g) -> RuntimeError:
    """As CUDA: a device op refuses a generator of another device (and a neuron generator
    cannot be made: adaptive_eager/LIMITS.md)."""
    return RuntimeError(f"Expected a '{DEVICE_TYPE}' device type for generator but found "
                       f"'{g.device.type}'")



def _sparse_error(op: str, layout) -> NotImplementedError:
    """Sparse results (`to_sparse`, `sparse_coo_tensor(..., device="neuron")`) are refused."""
    return NotImplementedError(
        f"{op}: sparse layouts (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, "
        f"torch.sparse_bsr, torch.sparse_bsc) are not supported on the neuron device, which "
        f"holds strided tensors only (this result would be {layout}). Keep sparse tensors on "
        f"the CPU.")




def _nested_error(op: str) -> NotImplementedError:
    """Nested results (`torch.nested`, nn.TransformerEncoder's inference fast path) are
    refused."""
    return NotImplementedError(
        f"{op}: nested tensors are not supported on the neuron device, which holds strided "
        f"tensors only. nn.TransformerEncoder makes one in eval under no_grad when given a "
        f"padding mask: build it with enable_nested_tensor=False.")


def _quantized_error(op: str) -> NotImplementedError:
    """Quantized tensors (`quantize_per_tensor`, `.to("neuron")` of one) are refused."""
    return NotImplementedError(
        f"{op}: quantized tensors (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, "
        f"torch.quint2x4) are not supported on the neuron device, which has no quantized "
        f"kernels. Keep quantized tensors on the CPU, or dequantize() them before .to('neuron').")
