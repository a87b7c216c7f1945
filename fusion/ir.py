"""Graph IR of recorded ops: a Node per queued ATen op, and the argument templates it carries.

Note [Templates]: a node's arguments are stored as a template, a tree of tuples in which
  ("T", i, size, stride, offset, dtype)  is a device tensor viewing the node's buffer i
                                         (+ (k,): the k-th other tensor object with that
                                         view, Note [Tensor identity] in templates.py),
  ("S", k, type)                         is a runtime scalar (value k of node.inputs),
  ("H", k, dtype, shape)                 is a host (CPU) tensor input (value k of node.inputs),
  ("L", *items)                          is a list, ("dt"|"dev"|"lay"|"mf", name) a torch enum,
and anything else (int, float, bool, str, None) is a static argument. Static arguments and
tensor metadata are part of the cache key; runtime scalars contribute only their type, so
`x * 0.5` and `x * 0.25` share one executable (as in the reference). Buffers are numbered
locally per node; a group maps them to its own slots, so a node's template (and its
signature) never depends on which buffers it touched.
"""
from __future__ import annotations

import functools
import math
import itertools
from typing import Any

import torch

_ENUMS = ((torch.dtype, "dt"), (torch.device, "dev"), (torch.layout, "lay"),
          (torch.memory_format, "mf"))


_SHAPE_SCALARS = frozenset({"aten::arange", "aten::range"})


@functools.lru_cache(maxsize=1 << 16)  # (bounded: a row loop makes a new offset per row)
def extent_bytes(size, stride, offset, itemsize) -> int:
    """Bytes from a buffer's start to one past the last element a layout reaches."""
    if any(s == 0 for s in size):
        return 0
    return (offset + sum((s - 1) * st for s, st in zip(size, stride)) + 1) * itemsize


def scalar_positions(func) -> tuple[frozenset, frozenset]:
    """(positional indices, kwarg names) where a Python number is a runtime input: `Scalar`
    arguments, and `Tensor` ones (`x * 0.5` reaches `mul.Tensor` with a plain float). None
    for ops whose Scalars decide the output's shape (`arange(n, out=t)`): those are static."""
    if func._schema.name in _SHAPE_SCALARS:
        return frozenset(), frozenset()
    pos, names = set(), set()
    for i, a in enumerate(func._schema.arguments):
        t = str(a.type)  # an optional one prints as "Optional[number]" (clamp's min and max)
        t = t[9:-1] if t.startswith("Optional[") else t.rstrip("?")
        # Scalar[]: the foreach optimizers' per-step values (bias corrections, step sizes)
        if t in ("Scalar", "number", "Tensor", "List[number]", "Scalar[]"):
            names.add(a.name)
            if not a.kwarg_only:
                pos.add(i)
    return frozenset(pos), frozenset(names)


@functools.lru_cache(maxsize=None)
def written_arguments(func) -> tuple[frozenset, frozenset]:
    """(positional indices, names) of the arguments `func` writes (`self` of an in-place op,
    `out=`), as the schema marks them (`Tensor(a!)`)."""
    args = [(i, a) for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write]
    return (frozenset(i for i, a in args if not a.kwarg_only),
            frozenset(a.name for _, a in args))


def written_values(func, args, kwargs) -> list:
    """The values a call of `func` writes (`written_arguments`), tensor lists flattened."""
    positions, names = written_arguments(func)
    out = []
    for v in [args[i] for i in positions if i < len(args)] + [
            v for k, v in kwargs.items() if k in names]:
        out += list(v) if isinstance(v, (list, tuple)) else [v]
    return out


def encode_static(v: Any) -> Any:
    """Template form of a non-tensor, non-runtime-scalar argument. -0.0 and NaN are tagged:
    as keys, -0.0 == 0.0 (nan_to_num(nan=-0.0) reused nan=0.0's executable) and NaN equals
    nothing (a cache miss at every call)."""
    if type(v) is float and (v != v or v == 0.0 and math.copysign(1.0, v) < 0):
        return ("F", repr(v))
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return ("L",) + tuple(encode_static(x) for x in v)
    for typ, tag in _ENUMS:
        if isinstance(v, typ):
            return (tag, str(v).replace("torch.", "") if tag != "dev" else v.type)
    if isinstance(v, torch.SymInt):
        return int(v)
    raise TypeError(f"unsupported static argument {v!r} of type {type(v).__name__}")


_DECODE_ENUM = {
    "dt": lambda s: getattr(torch, s),
    # Every executable runs on host memory (Note [Simulated asynchrony]): device args -> cpu.
    "dev": lambda s: torch.device("cpu"),
    "lay": lambda s: getattr(torch, s),
    "mf": lambda s: getattr(torch, s),
}


def to_json(t: Any) -> Any:
    """Templates are tuples; JSON has lists. Tags survive (first element a str)."""
    if isinstance(t, tuple):
        return [to_json(x) for x in t]
    return t


def from_json(t: Any) -> Any:
    if isinstance(t, list):
        return tuple(from_json(x) for x in t)
    return t


@functools.lru_cache(maxsize=None)
def op_name(func) -> str:
    """Short name in fused names (`mul.Tensor|add.Tensor|gelu`, as the reference)."""
    ns, _, name = func._schema.name.partition("::")
    if ns != "aten":  # a custom kernel: named in full (Note [Custom kernels])
        name = func._schema.name
    return name if func._overloadname == "default" else f"{name}.{func._overloadname}"


class OpSig:
    """What every call of one op signature shares (computed once, cached by the engine)."""

    __slots__ = ("func", "name", "cls", "sig", "outs", "reads", "writes", "arg_writes", "new",
                 "inplace", "flops", "new_bytes", "new_total", "cost")

    def __init__(self, func, cls, args, kwargs, outs, n_args, writes, flops, new_bytes,
                 cost=None):
        self.func = func
        self.name = op_name(func)
        self.cls = cls
        self.outs = outs  # per result leaf: ("N", li, size, stride, dtype) if new, else None
        # Why each signature field is there: the op overload picks the kernel, the templates
        # carry every static argument and tensor layout, `outs` says which results get new
        # buffers. Buffer identity across nodes is added by the group (fusion.program).
        self.sig = (func._schema.name, func._overloadname, args, kwargs, outs)
        self.new = frozenset(o[1] for o in outs if o is not None)
        self.reads = tuple(range(n_args))  # every argument buffer is read
        self.writes = tuple(writes) + tuple(sorted(self.new))  # in place, then new
        self.arg_writes = tuple(writes)  # the argument buffers it writes (in place, out=)
        self.inplace = bool(writes)  # writes a buffer it did not create (in-place / out=)
        self.flops = flops
        self.new_bytes = new_bytes  # bytes of each new output, in order
        self.new_total = sum(new_bytes)
        # A custom kernel's declared (or roofline) cost: fusion.kernels.Cost; None for ATen ops
        self.cost = cost
        if cost is not None:
            self.flops = cost.flops


class Node:
    """One queued ATen op: its signature's shared data, and this call's buffers and values."""

    __slots__ = ("op", "uids", "inputs", "vbytes", "in_bytes", "out_bytes", "source")

    def __init__(self, op: OpSig, uids, inputs, vbytes, source):
        self.op = op
        # Per local buffer index, the buffer's index in its queued segment (Handle.seg): its
        # identity within the segment, numbered by first use (the plan cache's numbering).
        self.uids = uids
        self.inputs = inputs  # runtime scalar / host tensor values
        self.vbytes = vbytes  # bytes of the views touched, per local buffer index
        self.in_bytes = sum(vbytes[:len(op.reads)])  # reads are the argument buffers, in order
        # (vbytes of the new buffers are the signature's new_bytes)
        self.out_bytes = op.new_total + sum([vbytes[li] for li in op.arg_writes]) \
            if op.arg_writes else op.new_total
        if op.cost is not None:  # a custom kernel: its declared HBM traffic
            self.in_bytes, self.out_bytes = op.cost.bytes_read, op.cost.bytes_written
        self.source = source  # the user's call (adaptive_eager.engine.source._source)

    def again(self, inputs, source) -> "Node":
        """This node's op on the same buffers, with another call's runtime values and source
        line (Note [Replay] in adaptive_eager/engine/replay.py)."""
        n = Node.__new__(Node)
        n.op, n.uids, n.vbytes = self.op, self.uids, self.vbytes
        n.in_bytes, n.out_bytes = self.in_bytes, self.out_bytes
        n.inputs, n.source = inputs, source
        return n

    # The signature's data, read through the node (the partitioner and codegen use these).
    func = property(lambda self: self.op.func)
    name = property(lambda self: self.op.name)
    cls = property(lambda self: self.op.cls)
    sig = property(lambda self: self.op.sig)
    outs = property(lambda self: self.op.outs)
    reads = property(lambda self: self.op.reads)
    writes = property(lambda self: self.op.writes)
    flops = property(lambda self: self.op.flops)

    def is_new(self, li: int) -> bool:
        """Is local buffer li created by this op (rather than read or updated in place)?"""
        return li in self.op.new


class Handle:
    """A device buffer as the engine sees it: pending (its value is queued) or in HBM.

    Tensors (and views) hold their handle strongly; queued nodes hold a pending handle only
    weakly, so a value whose tensors were all freed before the flush is never written back.
    """

    __slots__ = ("uid", "nbytes", "buffer", "pending", "poison", "seg", "ci", "__weakref__")
    _uids = itertools.count(1)

    def __init__(self, nbytes: int, buffer=None, pending: bool = False):
        self.uid = next(Handle._uids)
        # The queued segment that uses it (a token the engine replaces at each flush), and
        # its index there (Node.uids): set when an op using it is queued.
        self.seg = None
        self.ci = 0
        self.nbytes = nbytes
        self.buffer = buffer  # device.Buffer once the value is in HBM
        self.pending = pending
        # The failed launch whose error made this value invalid (Note [Poison] in
        # fusion/program.py): reading it raises that error, ops reading it are skipped.
        self.poison = None
