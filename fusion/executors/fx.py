"""A resolved Executable as an FX graph of ATen ops, ready for a graph compiler.

Note [FX form of a group]: the graph takes one flat 1-D tensor per external slot (the
slot's storage seen as its single dtype, as long as the group's views reach) and one per
host tensor input; the group's tensors are `as_strided` views of those, as the interpreter
makes them with `set_`. In-place ops and `out=` stay in the graph as they are: the
compiler's functionalization turns them into pure ops plus copies back into the inputs.
Runtime scalars are baked in as constants, so a graph is specific to its scalar values
(`scalar_key`); a group whose scalars change from launch to launch is not compiled. The
graph returns the group's written-back slots; each must come out with the layout its later
readers assume (`store` copies when the compiler chose another one).

Note [Views of buffers made in the group]: an op's output is its node's value, but the
compiler picks its physical layout (Inductor's clone of a transposed input stays transposed,
where ATen's cat of it is contiguous), and `as_strided` reinterprets whatever storage its
argument has. So a buffer made in the group is viewed other than as made only through a
1-D storage node built for it from its value (flattened and cloned when contiguous, else an
`as_strided_scatter` into zeros: logical, so layout-proof); from then on every access to that
buffer, the made view included, goes through that node, so writes through one view reach the
others.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from ..ir import written_arguments
from ..ops import FUSED_OPTIMIZER_PREFIXES


_aten = torch.ops.aten


class NotCompilable(Exception):
    """The group cannot be compiled; `reason` says why (counted, shown in the metrics)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _walk(t, visit):
    """Call visit(template) on every tagged leaf of a bound template."""
    if type(t) is tuple and t:
        tag = t[0]
        if tag == "L":
            for x in t[1:]:
                _walk(x, visit)
        elif tag in ("T", "S", "H"):
            visit(t)


def _templates(ins):
    return list(ins.args) + list(ins.kwargs.values())


def _contiguous(size) -> list[int]:
    out, n = [], 1
    for d in reversed(size):
        out.append(n)
        n *= max(d, 1)
    return out[::-1]


def _extent(size, stride, offset) -> int:
    if any(s == 0 for s in size):
        return offset
    return offset + sum((s - 1) * st for s, st in zip(size, stride)) + 1


def check(exe) -> str | None:
    """Why the group cannot be compiled at all (structure only, cheap), or None."""
    dtypes: dict[int, torch.dtype] = {}
    for ins in exe.instrs:
        if ins.random:  # Note [Executors] in tiered.py: random ops stay interpreted
            return "random op"
        if ins.f64:
            return "float64 (computed as float32)"
        if ins.op.name().startswith(FUSED_OPTIMIZER_PREFIXES):
            # torch 2.13's functionalization of the fused optimizer steps fails an internal
            # assert (RegisterFunctionalization); interpreted, they are CPU's kernel
            return f"{ins.op.name()} (a fused optimizer step)"
        rets = [str(r.type) for r in ins.op._schema.returns]
        if not (rets in ([], ["Tensor[]"], ["List[Tensor]"]) or all(r == "Tensor" for r in rets)):
            return f"returns {rets}"
        reason = _aliased_writes(ins)
        if reason is not None:
            return reason
        bad = []

        def visit(t):
            if t[0] == "T" and t[2] < exe.program.n_inputs:
                if dtypes.setdefault(t[2], t[6]) is not t[6]:
                    bad.append(t)
        for t in _templates(ins):
            _walk(t, visit)
        if bad:
            return "one input buffer viewed as two dtypes"
    return None


def _aliased_writes(ins) -> str | None:
    """Functionalization computes all of an op's writes from the values before it, then
    copies them back. Eager's foreach ops go tensor by tensor: `_foreach_mul_([x, x], s)`
    scales x twice, `_foreach_add_([a, b], [b, a])` adds the new a to b."""
    wpos, wnames = written_arguments(ins.op)
    written, lists, every = [], False, []
    for i, t in enumerate(ins.args):
        _walk(t, lambda t: every.append(t[2]) if t[0] == "T" else None)
        if i in wpos:
            lists |= t[0] == "L"
            _walk(t, lambda t: written.append(t[2]) if t[0] == "T" else None)
    for n, t in ins.kwargs.items():
        _walk(t, lambda t: every.append(t[2]) if t[0] == "T" else None)
        if n in wnames:
            lists |= t[0] == "L"
            _walk(t, lambda t: written.append(t[2]) if t[0] == "T" else None)
    if len(set(written)) < len(written):
        return "an op writes one buffer through two arguments"
    if lists and any(every.count(s) > 1 for s in written):
        return "a foreach op writes a buffer another of its arguments reads"
    if wnames and any(n in wnames and n != "self" for n in ins.kwargs):
        dtypes = set()
        for t in _templates(ins):
            _walk(t, lambda t: dtypes.add(t[6]) if t[0] == "T" else None)
        if len(dtypes) > 1:
            # `torch.sum(float_t, 0, out=int_t)`: Inductor's functional form computes in
            # another dtype than eager's kernel (fuzzer seed 21000083)
            return "out= of another dtype than its inputs"
    return None


def scalar_positions(exe) -> tuple[tuple[int, int], ...]:
    """(instr index, runtime input index) of each runtime scalar, in graph order."""
    pos = []
    for k, ins in enumerate(exe.instrs):
        for t in _templates(ins):
            _walk(t, lambda t: pos.append((k, t[1])) if t[0] == "S" else None)
    return tuple(pos)


def _freeze(v):
    return tuple(_freeze(x) for x in v) if isinstance(v, (list, tuple)) else (type(v), v)


def scalar_key(positions, inputs) -> tuple:
    """The runtime scalars' values, keyed by (type, value): a compiled graph bakes them in."""
    return tuple([_freeze(inputs[k][i]) for k, i in positions])


@dataclasses.dataclass(frozen=True)
class FxGroup:
    gm: fx.GraphModule
    ext: tuple  # (slot, dtype, elements) per flat input, in placeholder order
    hosts: tuple  # (instr index, input index, dtype, shape) per host tensor input
    outputs: tuple  # (slot, size, stride, dtype) per graph output

    def example_inputs(self) -> list[torch.Tensor]:
        return ([torch.zeros(n, dtype=d, device="cpu") for _, d, n in self.ext]
                + [torch.zeros(shape, dtype=d, device="cpu") for _, _, d, shape in self.hosts])

    def args(self, st, inputs) -> list[torch.Tensor]:
        """The graph's inputs over this launch's slot storages."""
        return ([torch.empty(0, dtype=d, device="cpu").set_(st[s], 0, (n,), (1,))
                 for s, d, n in self.ext]
                + [inputs[k][i].contiguous() for k, i, _, _ in self.hosts])

    def store(self, outs, st, args) -> None:
        """Fill the created slots from the graph's outputs, in the layout readers assume."""
        seen = {a.untyped_storage().data_ptr() for a in args}
        for (s, size, stride, dtype), r in zip(self.outputs, outs):
            ptr = r.untyped_storage().data_ptr()
            if (r.dtype is not dtype or r.shape != size or r.stride() != stride
                    or r.storage_offset() != 0 or ptr in seen):
                e = torch.empty_strided(size, stride, dtype=dtype, device="cpu")
                e.copy_(r)
                r = e
            seen.add(r.untyped_storage().data_ptr())
            st[s] = r.untyped_storage()


def build(exe, inputs) -> FxGroup:
    """The group as an FX graph, scalars baked in from `inputs` (one launch's values)."""
    reason = check(exe)
    if reason is not None:
        raise NotCompilable(reason)
    p = exe.program
    g = fx.Graph()
    ext: dict[int, list] = {}  # slot -> [dtype, elements]
    reach: dict[int, int] = {}  # slot made in the group -> elements its views reach
    hosts = []
    for k, ins in enumerate(exe.instrs):
        def visit(t, k=k):
            if t[0] == "T" and t[2] < p.n_inputs:
                e = ext.setdefault(t[2], [t[6], 0])
                e[1] = max(e[1], _extent(t[3], t[4], t[5]))
            elif t[0] == "T":
                reach[t[2]] = max(reach.get(t[2], 0), _extent(t[3], t[4], t[5]))
            elif t[0] == "H":
                hosts.append((k, t[1], getattr(torch, t[2]), tuple(t[3])))  # "float32"
        for t in _templates(ins):
            _walk(t, visit)
    bases = {s: g.placeholder(f"slot{s}") for s in ext}
    host_nodes = {(k, i): g.placeholder(f"host{k}_{i}") for k, i, _, _ in hosts}
    views: dict[int, fx.Node] = {}  # view id -> node (the interpreter's `views`)
    created: dict[int, tuple] = {}  # slot -> (node, size, stride, dtype, view id)
    flats: dict[int, fx.Node] = {}  # slot made in the group -> its 1-D storage node

    def flat(s):
        """Note [Views of buffers made in the group]."""
        node = flats.get(s)
        if node is None:
            leaf, size, stride, dtype, vid = created[s]
            numel = _extent(size, stride, 0)
            n = max(reach.get(s, 0), numel)
            if list(stride) == _contiguous(size):  # its values in order are its storage
                node = g.call_function(_aten.clone.default, (
                    g.call_function(_aten.reshape.default, (leaf, [-1])),))
                if n > numel:
                    node = g.call_function(_aten.constant_pad_nd.default, (node, [0, n - numel]))
            else:  # (as_strided_scatter of a 0-d value gave zeros: fuzzer seed 23001022)
                zeros = g.call_function(_aten.zeros.default, ([n],), {"dtype": dtype})
                node = g.call_function(_aten.as_strided_scatter.default,
                                       (zeros, leaf, list(size), list(stride), 0))
            flats[s] = node
            views.pop(vid, None)  # the made view too reads the storage node from now on
        return node

    def value(t, k):
        if type(t) is not tuple:
            return t
        tag = t[0]
        if tag == "T":
            _, vid, s, size, stride, offset, dtype = t
            node = views.get(vid)
            if node is None:
                if s in bases:
                    base = bases[s]
                else:
                    if created[s][3] is not dtype:
                        raise NotCompilable("a created buffer viewed as another dtype")
                    base = flat(s)
                node = views[vid] = g.call_function(
                    _aten.as_strided.default, (base, list(size), list(stride), offset))
            return node
        if tag == "L":
            return [value(x, k) for x in t[1:]]
        if tag == "C":
            return t[1]
        if tag == "H":
            return host_nodes[(k, t[1])]
        v = inputs[k][t[1]]  # "S": baked in (Note [FX form of a group])
        return list(v) if isinstance(v, tuple) else v

    for k, ins in enumerate(exe.instrs):
        node = g.call_function(ins.op, tuple(value(a, k) for a in ins.args),
                               {n: value(v, k) for n, v in ins.kwargs.items()})
        rets = ins.op._schema.returns
        single = len(rets) == 1 and str(rets[0].type) == "Tensor"
        for li, o in enumerate(ins.outs):
            if o is None:
                continue
            s, size, stride, dtype, vid = o
            leaf = node if single else g.call_function(operator.getitem, (node, li))
            created[s] = (leaf, size, stride, dtype, vid)
            if vid is not None:
                views[vid] = leaf

    def result(s):
        leaf, size, stride, _, _ = created[s]
        if s not in flats:
            return leaf
        return g.call_function(_aten.as_strided.default, (flats[s], list(size), list(stride), 0))
    g.output(tuple(result(s) for s in p.outputs))
    gm = fx.GraphModule(torch.nn.Module(), g)
    return FxGroup(gm, tuple((s, d, n) for s, (d, n) in ext.items()), tuple(hosts),
                   tuple((s,) + created[s][1:4] for s in p.outputs))
