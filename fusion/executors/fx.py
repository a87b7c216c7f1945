"""A resolved Executable as an FX graph of ATen ops, ready for a graph compiler.

Note [FX form of a group]: the graph takes one flat 1-D tensor per external slot (the
slot's storage seen as its single dtype, as long as the group's views reach) and one per
host tensor input; the group's tensors are `as_strided` views of those, as the interpreter
makes them with `set_`. In-place ops and `out=` stay in the graph as they are: the
compiler's functionalization turns them into pure ops plus copies back into the inputs.
Runtime scalars are graph inputs where Note [Scalars as graph inputs] allows, else baked in
as constants, so a graph is specific to those values (`scalar_key`); a group whose baked
scalars change from launch to launch is not compiled. The graph returns the group's written-back slots; each must come out with the layout its later
readers assume (`store` copies when the compiler chose another one).

Note [Views of buffers made in the group]: an op's output is its node's value, but the
compiler picks its physical layout (Inductor's clone of a transposed input stays transposed,
where ATen's cat of it is contiguous), and `as_strided` reinterprets whatever storage its
argument has. So a buffer made in the group is viewed other than as made only through a
1-D storage node built for it from its value (flattened and cloned when contiguous, else an
`as_strided_scatter` into zeros: logical, so layout-proof); from then on every access to that
buffer, the made view included, goes through that node, so writes through one view reach the
others.

Note [Scalars as graph inputs]: an optimizer's per-step values (AdamW's bias corrections and
step size, a scheduled learning rate) change at every launch; baked in, they would compile
the group anew each step, so such groups ran interpreted. An op's runtime scalars are
instead one float32 graph input (`FxGroup.scalars`, each a 0-d `select` of it) when the
op's tensors are all float32 (none from the host) and its scalars are all int or float:
then eager computes with each scalar cast to float32 (the op math of float32), and a 0-d
float32 tensor in its place changes neither the result's dtype nor the values. The op takes
it where its schema has a Tensor (`x * 0.5` reaches `mul.Tensor`), through its packet's
overload with a Tensor there (`mul.Scalar` -> `mul.Tensor`, `lerp_.Scalar` -> `lerp_.Tensor`),
or, for addcmul/addcdiv (a Scalar `value` only), as `self + value * t1 * t2` and
`self + value * t1 / t2` (eager's formulas). A foreach op with scalars runs as its per-tensor
op on each element (its writes never alias its reads: `check`). A launch with a finite
scalar beyond float32's range runs interpreted (`scalar_input`: eager raises, or makes inf).
Any other op bakes its scalars in, as before (`scalar_positions` keys them by value).
"""
from __future__ import annotations

import dataclasses
import functools
import operator

import torch
import torch.fx as fx

from ..decomps import CORRECTED
from ..ir import written_arguments
from ..ops import FUSED_OPTIMIZER_PREFIXES


_aten = torch.ops.aten
# Note [Wrong decompositions in graphs] in fusion/decomps.py: the packets whose out= forms
# Inductor would decompose wrongly
_CORRECTED_PACKETS = frozenset(op.overloadpacket for op in CORRECTED)


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
        if ins.op.overloadpacket in _CORRECTED_PACKETS and ins.op not in CORRECTED:
            # Note [Wrong decompositions in graphs] in fusion/decomps.py
            return f"{ins.op.name()} (PyTorch decomposes it wrongly)"
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
    """(instr index, runtime input index) of each runtime scalar baked into the graph (Note
    [Scalars as graph inputs]: not those that are graph inputs), in graph order."""
    pos = []
    for k, ins in enumerate(exe.instrs):
        if lift(ins) is None:
            for t in _templates(ins):
                _walk(t, lambda t: pos.append((k, t[1])) if t[0] == "S" else None)
    return tuple(pos)


_TENSOR_TYPES = ("Tensor", "Optional[Tensor]")
_F32_MAX, _INF = torch.finfo(torch.float32).max, float("inf")
# Ops whose scalars may be graph inputs: arithmetic whose kernels treat a scalar as any value
# (not pow: eager special-cases exponents 2, 0.5, -1 ..., sqrt(-inf) is nan, pow(-inf, 0.5)
# inf), and the foreach forms the optimizers use
_LIFTED = frozenset({"mul", "div", "add", "sub", "rsub", "lerp", "clamp", "clamp_min",
                     "clamp_max", "addcmul", "addcdiv"})


def lift(ins):
    """How this instr takes its runtime scalars as graph inputs: an emitter
    `emit(graph, args, kwargs)` (its scalars given as 0-d tensor nodes), or None: baked in.
    Note [Scalars as graph inputs]; decided by the templates alone (dtypes and scalar types,
    all in the Program key), so every launch of a group decides alike."""
    s_args = tuple(i for i, t in enumerate(ins.args) if type(t) is tuple and t and t[0] == "S")
    s_kw = tuple(sorted(n for n, t in ins.kwargs.items()
                        if type(t) is tuple and t and t[0] == "S"))
    packet = ins.op.overloadpacket.__name__
    if not s_args and not s_kw or packet.removeprefix("_foreach_").rstrip("_") not in _LIFTED:
        return None
    ok, tensors = [True], [0]

    def visit(t):
        if t[0] == "T":
            tensors[0] += 1
            ok[0] = ok[0] and t[6] is torch.float32
        elif t[0] == "H":
            ok[0] = False
        else:  # "S": a type name, or a tuple of them (a Scalar[])
            names = t[2] if type(t[2]) is tuple else (t[2],)
            ok[0] = ok[0] and all(n in ("int", "float") for n in names)
    for t in _templates(ins):
        _walk(t, visit)
    if not ok[0] or not tensors[0]:
        return None
    if packet.startswith("_foreach_") and ins.kwargs:
        return None
    return _emitter(ins.op, s_args, s_kw)


@functools.lru_cache(maxsize=None)
def _emitter(op, s_args, s_kw):
    schema = op._schema.arguments
    packet = op.overloadpacket.__name__
    if packet.startswith("_foreach_"):  # per element: its per-tensor op
        if s_kw:
            return None
        base = packet[len("_foreach_"):]
        core = base.rstrip("_")
        if core in ("addcmul", "addcdiv"):
            elem = _addc(core, base.endswith("_")) if s_args == (3,) else None
        else:
            ov = getattr(getattr(_aten, base, None), "Scalar", None)
            per = {"List[Tensor]": "Tensor", "List[number]": "number"}
            if ov is None or [per.get(str(a.type), str(a.type)) for a in schema] != \
                    [str(a.type) for a in ov._schema.arguments[:len(schema)]] or any(
                    not a.kwarg_only and a.default_value is None
                    for a in ov._schema.arguments[len(schema):]):
                return None
            elem = _emitter(ov, s_args, ())
        if elem is None:
            return None

        def emit_each(g, args, kwargs):
            n = len(args[0])
            return [elem(g, [a[i] if type(a) is list else a for a in args], {})
                    for i in range(n)]
        return emit_each
    names = [a.name for a in schema]
    lifted = {names[i] for i in s_args} | set(s_kw)
    if all(str(a.type) in _TENSOR_TYPES for a in schema if a.name in lifted):
        target = op
    else:
        target = None
        for name in op.overloadpacket.overloads():
            cand = getattr(op.overloadpacket, name)
            args = cand._schema.arguments
            # the same arguments, a Tensor where a scalar is lifted (a Scalar? that is not
            # a runtime scalar is None: a Tensor? takes it too), the same returns
            if [a.name for a in args] == names and all(
                    str(c.type) in _TENSOR_TYPES if c.name in lifted else
                    str(c.type) == str(a.type) or (str(c.type), str(a.type)) == (
                        "Optional[Tensor]", "Optional[number]")
                    for c, a in zip(args, schema)) and \
                    str(cand._schema.returns) == str(op._schema.returns):
                target = cand
                break
    if target is not None:  # (an argument positional here may be keyword-only there)
        npos = sum(1 for a in target._schema.arguments if not a.kwarg_only)

        def emit(g, args, kwargs):
            kw = dict(kwargs, **{names[i]: args[i] for i in range(npos, len(args))})
            return g.call_function(target, tuple(args[:npos]), kw)
        return emit
    if packet.rstrip("_") in ("addcmul", "addcdiv") and op._overloadname == "default" \
            and not s_args and s_kw == ("value",):  # (not addcmul.out: its out= is written)
        return _addc(packet.rstrip("_"), packet.endswith("_"))
    return None


def _addc(core, inplace):
    """addcmul/addcdiv with a tensor `value`: eager's `self + value * t1 * t2` and
    `self + value * t1 / t2`."""
    second = _aten.mul.Tensor if core == "addcmul" else _aten.div.Tensor
    add = _aten.add_.Tensor if inplace else _aten.add.Tensor

    def emit(g, args, kwargs):
        self, t1, t2 = args[:3]
        value = args[3] if len(args) > 3 else kwargs["value"]
        scaled = g.call_function(_aten.mul.Tensor, (t1, value))
        return g.call_function(add, (self, g.call_function(second, (scaled, t2))))
    return emit


def _freeze(v):
    return tuple(_freeze(x) for x in v) if isinstance(v, (list, tuple)) else (type(v), v)


def scalar_key(positions, inputs) -> tuple:
    """The runtime scalars' values, keyed by (type, value): a compiled graph bakes them in."""
    return tuple([_freeze(inputs[k][i]) for k, i in positions])


class _Empties(dict):
    """dtype -> an empty CPU tensor, whose `new()` makes `FxGroup.args`' flat inputs."""

    def __missing__(self, d):
        t = self[d] = torch.empty(0, dtype=d, device="cpu")
        return t


_EMPTY = _Empties()
_UNIT = (1,)


@dataclasses.dataclass(frozen=True)
class FxGroup:
    gm: fx.GraphModule
    ext: tuple  # (slot, dtype, elements) per flat input, in placeholder order
    hosts: tuple  # (instr index, input index, dtype, shape) per host tensor input
    outputs: tuple  # (slot, size, stride, dtype) per graph output
    # (instr index, input index, element index or None) per runtime scalar that is a graph
    # input, in the order of the `scalars` input (Note [Scalars as graph inputs])
    scalars: tuple = ()

    def example_inputs(self) -> list[torch.Tensor]:
        return ([torch.zeros(n, dtype=d, device="cpu") for _, d, n in self.ext]
                + [torch.zeros(shape, dtype=d, device="cpu") for _, _, d, shape in self.hosts]
                + ([torch.zeros(len(self.scalars))] if self.scalars else []))

    def scalar_input(self, inputs) -> torch.Tensor | None:
        """This launch's lifted scalars as the graph's float32 input; None if one is finite
        and beyond float32's range (eager raises "value cannot be converted to type float
        without overflow", or makes inf: the interpreter runs that launch, as eager)."""
        vals = [inputs[k][i] if j is None else inputs[k][i][j] for k, i, j in self.scalars]
        for v in vals:
            if _F32_MAX < abs(v) < _INF:
                return None
        return torch.tensor(vals, dtype=torch.float32)

    def args(self, st, inputs, scalars=None) -> list[torch.Tensor]:
        """The graph's inputs over this launch's slot storages (`scalars`: scalar_input).
        (A flat input is an empty CPU tensor of its dtype `set_` over the storage: made by
        `Tensor.new`, the cheapest constructor, which also keeps the CPU device under a
        `torch.device` context; AdamW's group makes about 120 per launch.)"""
        out = [_EMPTY[d].new().set_(st[s], 0, (n,), _UNIT) for s, d, n in self.ext]
        if self.hosts:
            out += [inputs[k][i].contiguous() for k, i, _, _ in self.hosts]
        if self.scalars:
            out.append(scalars)
        return out

    def store(self, outs, st, args) -> None:
        """Fill the created slots from the graph's outputs, in the layout readers assume.
        An output over an input's storage or another output's (Inductor may return one
        as is) is copied: each created slot gets a storage of its own."""
        if not self.outputs:  # (an optimizer's group writes its inputs in place only)
            return
        seen = {a.untyped_storage().data_ptr() for a in args}
        for (s, size, stride, dtype), r in zip(self.outputs, outs):
            storage = r.untyped_storage()
            ptr = storage.data_ptr()
            if (r.dtype is not dtype or r.shape != size or r.stride() != stride
                    or r.storage_offset() != 0 or ptr in seen):
                e = torch.empty_strided(size, stride, dtype=dtype, device="cpu")
                e.copy_(r)
                storage = e.untyped_storage()
                ptr = storage.data_ptr()
            seen.add(ptr)
            st[s] = storage


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
    # Note [Scalars as graph inputs]: one float32 input, a 0-d select of it per scalar
    emitters = [lift(ins) for ins in exe.instrs]
    scalars, scalar_nodes = [], {}
    for k, ins in enumerate(exe.instrs):
        if emitters[k] is None:
            continue
        for t in _templates(ins):
            def visit(t, k=k):
                if t[0] == "S":  # a Scalar[]'s template holds a tuple of type names
                    js = range(len(t[2])) if type(t[2]) is tuple else (None,)
                    scalar_nodes[(k, t[1])] = (type(t[2]) is tuple, len(scalars))
                    scalars.extend((k, t[1], j) for j in js)
            _walk(t, visit)
    if scalars:
        packed = g.placeholder("scalars")
        for key, (many, at) in scalar_nodes.items():
            n = sum(1 for s in scalars if s[:2] == key)
            nodes = [g.call_function(_aten.select.int, (packed, 0, at + j)) for j in range(n)]
            scalar_nodes[key] = nodes if many else nodes[0]
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
        if emitters[k] is not None:  # Note [Scalars as graph inputs]
            return scalar_nodes[(k, t[1])]
        v = inputs[k][t[1]]  # "S": baked in (Note [FX form of a group])
        return list(v) if isinstance(v, tuple) else v

    for k, ins in enumerate(exe.instrs):
        args = [value(a, k) for a in ins.args]
        kwargs = {n: value(v, k) for n, v in ins.kwargs.items()}
        if emitters[k] is not None:  # a list of nodes for a foreach op
            node = emitters[k](g, args, kwargs)
        else:  # Note [Wrong decompositions in graphs] in fusion/decomps.py
            node = g.call_function(CORRECTED.get(ins.op, ins.op), tuple(args), kwargs)
        rets = ins.op._schema.returns
        single = len(rets) == 1 and str(rets[0].type) == "Tensor"
        for li, o in enumerate(ins.outs):
            if o is None:
                continue
            s, size, stride, dtype, vid = o
            leaf = (node if single else node[li] if type(node) is list else
                    g.call_function(operator.getitem, (node, li)))
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
                   tuple((s,) + created[s][1:4] for s in p.outputs), tuple(scalars))
