"""Fused-executable codegen: a group of nodes becomes a Program (plain data, the cache entry)
and an Executable (the Program's ops resolved against an allow-list, ready to run).

The default executor runs the group's ops in order on host memory, so fused results are
bit-for-bit those of eager mode; fusion changes what the device *costs*, not what it computes.
"""
from __future__ import annotations

import warnings

import torch
from torch.utils._pytree import tree_leaves

from device import LaunchError

from .codegen import generate, host_views, layout_key, misshaped, op_name, tensor_templates
from .host import QUIET_OPS, cpp_warnings_scope
from .ir import Node, from_json, to_json, _DECODE_ENUM
from .ops import BARRIER, KERNEL, LAYOUT_ONLY, RANDOM, device_kernel, op_class


def _quietly(fn):
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        return cpp_warnings_scope(fn)


_CPU = torch.device("cpu")  # host tensors made here: never the default device

FORMAT_VERSION = 1


class Program:
    """A group's canonical form: what the cache stores and the key is made of."""

    __slots__ = ("name", "n_inputs", "n_slots", "instrs", "outputs", "key")

    def __init__(self, name, n_inputs, n_slots, instrs, outputs):
        self.name = name
        self.n_inputs = n_inputs  # slots [0, n_inputs) are buffers from outside the group
        self.n_slots = n_slots
        self.instrs = instrs  # (schema name, overload, args, kwargs, outs, slot map)
        self.outputs = outputs  # created slots written back to HBM
        self.key = (instrs, n_inputs, outputs)

    def to_json(self) -> dict:
        return {"name": self.name, "n_inputs": self.n_inputs, "n_slots": self.n_slots,
                "instrs": to_json(self.instrs), "outputs": list(self.outputs)}

    @classmethod
    def from_json(cls, d: dict) -> "Program":
        return cls(d["name"], d["n_inputs"], d["n_slots"], from_json(d["instrs"]),
                   tuple(d["outputs"]))


def build_program(nodes: list[Node], keep: set[int]) -> tuple[Program, list[int]]:
    """The program of a group, and the buffer uid held by each of its slots.

    `keep`: uids whose values must leave the group (live tensors or later readers)."""
    created, ext, order = set(), [], []
    for n in nodes:
        for li, u in enumerate(n.uids):
            if u not in created and u not in ext and not n.is_new(li):
                ext.append(u)
        for li in n.writes:
            if n.is_new(li):
                created.add(n.uids[li])
                order.append(n.uids[li])
    slot_uids = ext + order
    slot = {u: s for s, u in enumerate(slot_uids)}
    instrs = tuple(n.sig + (tuple(slot[u] for u in n.uids),) for n in nodes)
    outputs = tuple(slot[u] for u in order if u in keep)
    name = "|".join(n.name for n in nodes)
    return Program(name, len(ext), len(slot_uids), instrs, outputs), slot_uids


class CompileError(Exception):
    """The compiler refused a program (a fused group it cannot build): its ops then run one
    by one. Any other exception from compiling is a bug of ours and propagates."""


class BadProgram(CompileError, ValueError):
    """A program names an op outside the allow-list (or is malformed)."""


def _resolve(schema_name: str, overload: str):
    ns, _, packet = schema_name.partition("::")
    if ns != "aten":  # a custom kernel (Note [Custom kernels] in kernels.py), if registered
        try:
            op = getattr(getattr(getattr(torch.ops, ns), packet), overload)
        except (AttributeError, RuntimeError):
            op = None
        if op is None or op_class(op) != KERNEL:
            raise BadProgram(f"op {schema_name} is not an aten op or a registered kernel")
        return op
    try:
        op = getattr(getattr(torch.ops.aten, packet), overload)
    except AttributeError:
        raise BadProgram(f"unknown op {schema_name}.{overload}") from None
    if op_class(op) in (None, BARRIER):
        raise BadProgram(f"op {schema_name} is not implemented by the device")
    return op


def _bind(t, smap, vids):
    """Resolve a template against slot numbers: tensors get their slot and a view id (one per
    distinct (slot, view) of the program), enums their object."""
    if type(t) is tuple and t and type(t[0]) is str:
        tag = t[0]
        if tag == "T":  # t[6:]: an instance number (Note [Tensor identity], templates.py)
            view = (smap[t[1]], t[2], t[3], t[4], getattr(torch, t[5]))
            return ("T", vids.setdefault(view + t[6:], len(vids))) + view
        if tag == "L":
            return ("L",) + tuple(_bind(x, smap, vids) for x in t[1:])
        if tag in ("S", "H"):
            return t
        if tag in _DECODE_ENUM:
            return ("C", _DECODE_ENUM[tag](t[1]))
        if tag == "F":  # -0.0 or NaN (encode_static)
            return ("C", float(t[1]))
        raise BadProgram(f"unknown template tag {tag!r}")
    if t is None or type(t) in (bool, int, float, str):
        return t
    raise BadProgram(f"malformed template {t!r}")


def _value(t, st, inputs, views):
    if type(t) is tuple:
        tag = t[0]
        if tag == "T":  # ("T", view id, slot, size, stride, offset, dtype): one object per run
            v = views[t[1]]
            if v is None:
                s = st[t[2]]
                if s is None:  # Note [Poison]: made by an op of this run that failed, read
                    # by a layout-only op (ones_like), the one kind not skipped: a stand-in
                    # of its layout (it was a TypeError poisoning that op's result)
                    v = views[t[1]] = torch.empty_strided(t[3], t[4], dtype=t[6], device=_CPU)
                    return v
                v = views[t[1]] = torch.empty(0, dtype=t[6], device=_CPU).set_(
                    s, t[5], t[3], t[4])
            return v
        if tag == "L":
            return [_value(x, st, inputs, views) for x in t[1:]]
        if tag == "C":
            return t[1]
        return inputs[t[1]]  # "S" / "H"
    return t


class Instr:
    __slots__ = ("op", "kernel", "args", "kwargs", "outs", "any_out", "random", "f64",
                 "mutated", "in_slots", "out_slots", "user", "quiet")
    # (outs holds (templates, slot map) until bind_outputs)

    def __init__(self, schema_name, overload, args, kwargs, outs, smap, vids):
        self.op = _resolve(schema_name, overload)
        kernel = device_kernel(self.op)  # the C++ entry: OpOverload.__call__ minus a frame
        self.kernel = self.op._op if kernel is self.op else kernel
        self.args = tuple(_bind(a, smap, vids) for a in args)
        self.kwargs = {k: _bind(v, smap, vids) for k, v in kwargs}
        self.outs = outs, smap  # bound by bind_outputs, once every instr's inputs are known
        self.random = op_class(self.op) == RANDOM
        self.user = op_class(self.op) == KERNEL  # a user's kernel: its results are checked
        self.quiet = self.op in QUIET_OPS
        # Note [float64 policy]: the device computes float64 as float32, like the reference.
        self.f64 = "'float64'" in repr((args, kwargs))
        self.mutated = [i for i, a in enumerate(self.op._schema.arguments)
                        if a.alias_info is not None and a.alias_info.is_write]
        # Note [Poison]: the slots an instr reads, and those it writes (new outputs and
        # mutated arguments), so a failed op invalidates exactly what depends on it.
        read = self.args[1:] if self.op._schema.name in LAYOUT_ONLY else self.args
        self.in_slots = frozenset(_slots(read) + _slots(tuple(self.kwargs.values())))
        names = [a.name for a in self.op._schema.arguments]
        mut = [self.args[i] for i in self.mutated if i < len(self.args)]
        mut += [v for k, v in self.kwargs.items() if names.index(k) in self.mutated]
        self.out_slots = frozenset(_slots(tuple(mut)) + tuple(smap[o[1]] for o in outs if o))

    def bind_outputs(self, vids) -> None:
        """(slot, size, stride, dtype, view id or None) per new output: a later op reading
        the output's exact view reuses the result tensor itself."""
        outs, smap = self.outs
        bound = []
        for o in outs:
            if o is None:
                bound.append(None)
                continue
            view = (smap[o[1]], o[2], o[3], 0, getattr(torch, o[4]))
            bound.append(view[:3] + (view[4], vids.get(view)))
        self.outs = tuple(bound)
        self.any_out = any(self.outs)


class Executable:
    """A Program whose ops were resolved: callable on slot storages."""

    def __init__(self, program: Program):
        self.program = program
        self.name = program.name
        vids: dict = {}
        self.instrs = [Instr(*i[:5], i[5], vids) for i in program.instrs]
        for ins in self.instrs:
            ins.bind_outputs(vids)
        # slot -> the host view key (size, stride, offset, dtype) of each new output (Note
        # [Host views])
        self.out_keys = {o[0]: layout_key((o[1], o[2], 0, o[3])) for ins in self.instrs
                         for o in ins.outs if o is not None}
        self.n_views = len(vids)
        self.host_views = host_views(self.instrs, program.n_inputs)  # Note [Host views]
        # Note [Generated runs]
        self.generated = generate(self.instrs, self.n_views, program.outputs, run_instr)
        self.checked_runs = 0  # Note [Proven layouts] in codegen.py

    def run(self, st: list, inputs: list[list], rng, poisoned: set,
            causes: dict | None = None, views: list | None = None) -> None:
        """Run in order; fills the created slots of `st`. `inputs[i]`: runtime values of instr i.

        Note [Poison]: `poisoned` holds the slots whose values are invalid (on entry: inputs
        poisoned by an earlier failure). An instr that reads one is skipped and poisons what
        it writes; an instr that raises poisons what it writes too. Independent instrs still
        run, so one failed op never corrupts values that do not depend on it. The first
        error is raised at the end, tagged with its instr index; `causes` (slot -> what
        poisoned it) gets the later ones, (instr index, LaunchError), so that each value
        names its own failed op. `views`: n_views + n_slots entries, the host views the
        launch hands in (Note [Host views]; it reads the results' from the others after)."""
        if views is None:
            views = [None] * (self.n_views + self.program.n_slots)
        first, start = None, 0
        if not poisoned:  # Note [Generated runs]: the same steps, generated once
            run = self.generated
            failed = run(st, inputs, rng, views)
            if failed is None:
                if run.checked:  # Note [Proven layouts]: two checked runs, no copy: proven
                    self.checked_runs += 1
                    if self.checked_runs == 2 and not run.fixed:
                        self.generated = generate(self.instrs, self.n_views,
                                                  self.program.outputs, run_instr, False)
                return
            start, first = failed
            poisoned.update(self.instrs[start].out_slots)
            first.cause.instr_index = start
            start += 1
        for k in range(start, len(self.instrs)):
            ins = self.instrs[k]
            if poisoned and not poisoned.isdisjoint(ins.in_slots):
                skip(ins, poisoned, causes)
                continue
            try:
                run_instr(ins, st, inputs[k], rng, views)
            except Exception as e:
                poisoned.update(ins.out_slots)
                err = e if isinstance(e, LaunchError) else LaunchError(e, internal=True)
                if first is None:
                    first = err
                    first.cause.instr_index = k  # the engine maps it to the op and source line
                elif causes is not None:
                    for s in ins.out_slots:
                        causes[s] = (k, err)
        if first is not None:
            raise first


def skip(ins, poisoned: set, causes: dict | None) -> None:
    """Note [Poison]: `ins` reads a poisoned slot: it does not run, and what it writes is
    poisoned by the same cause."""
    poisoned.update(ins.out_slots)
    if causes:
        why = next((causes[s] for s in ins.in_slots if s in causes), None)
        if why is not None:
            for s in ins.out_slots:
                causes.setdefault(s, why)


def _slots(templates: tuple) -> tuple:
    """Slots named by bound templates ("T", view id, slot, ...), recursing into lists."""
    return tuple(t[2] for t in tensor_templates(templates))


def run_instr(ins: Instr, st: list, inputs: list, rng, views: list) -> None:
    """One op of a program. `views`: tensors already made over slots in this run, reused
    (a chain's next op reads its producer's output object itself)."""
    args = [_value(a, st, inputs, views) for a in ins.args]
    kwargs = {k: _value(v, st, inputs, views) for k, v in ins.kwargs.items()} \
        if ins.kwargs else {}
    if ins.f64:
        args, kwargs, writeback = _as_f32(ins, args, kwargs)
    try:
        if ins.quiet:  # its warnings were given at the call (QUIET_OPS)
            out = _quietly(lambda: rng.run(ins.op, args, kwargs) if ins.random
                           else ins.kernel(*args, **kwargs))
        elif ins.random:
            out = rng.run(ins.op, args, kwargs)
        else:
            out = ins.kernel(*args, **kwargs)
    except Exception as e:  # the kernel refused its inputs: the op's own error
        if ins.user:
            e._ae_kernel_at = _kernel_line(e)
        raise LaunchError(e) from None
    if ins.f64:
        for orig, low in writeback:
            _unique(orig, orig.to(torch.float32) if low is None else low)
    if not ins.any_out:
        return
    for o, r in zip(ins.outs, (out,) if type(out) is torch.Tensor else tree_leaves(out)):
        if o is None:
            continue
        s, size, stride, dtype, vid = o
        if ins.user and (not isinstance(r, torch.Tensor) or r.shape != size
                         or r.dtype is not dtype and not (ins.f64 and dtype is torch.float64
                                                          and r.dtype is torch.float32)):
            # (a float64 result may come back float32: the kernel ran on float32 twins of
            # its float64 inputs, Note [float64 policy])
            raise LaunchError(_bad_result(ins, r, size, dtype))
        if dtype is torch.float64:  # Note [float64 policy]: values carry float32 precision
            r = r.to(torch.float32)
        if (r.dtype is not dtype or r.storage_offset() != 0 or r.stride() != stride
                or r.shape != size or dtype.is_complex and (r.is_conj() or r.is_neg())):
            # (a conjugate view, `solve(left=False)`'s: its storage holds the unconjugated
            # values; copy_ writes the values the view shows)
            error = misshaped(op_name(ins.op), r, size)
            if error is not None:
                raise LaunchError(error)
            e = torch.empty_strided(size, stride, dtype=dtype, device=_CPU)
            e.copy_(r)
            r = e
        st[s] = r.untyped_storage()
        if vid is not None:
            views[vid] = r


def _unique(orig, low) -> None:
    """orig.copy_(low) where orig may be broadcast (stride-0 dims, e.g. an expanded tensor
    updated in place): those dims are narrowed to one element on both sides, so each memory
    location is written once (copy_ refuses overlapping targets)."""
    for d in range(orig.dim()):
        if orig.stride(d) == 0 and orig.shape[d] > 1:
            orig, low = orig.narrow(d, 0, 1), low.narrow(d, 0, 1)
    orig.copy_(low)


def _span(a: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) of the storage elements `a` covers."""
    lo = a.storage_offset()
    return lo, lo + 1 + sum((n - 1) * st for n, st in zip(a.shape, a.stride()))


_F32_MAX, _INF = torch.finfo(torch.float32).max, float("inf")
# Note [float64 policy]: random_ draws integers from its dtype's range (float64's: up to 2**53,
# float32's: up to 2**24, with CPU's warning for bounds past it), so it runs on the float64
# tensor itself; its values are then rounded to float32 precision, as every float64 value.
_OWN_RANGE = {torch.ops.aten.random_.default, torch.ops.aten.random_.to,
              getattr(torch.ops.aten.random_, "from")}


def _as_f32(ins, args, kwargs):
    """Note [float64 policy]: the op runs on float32 twins of its float64 tensors. Twins share
    memory as the tensors do: one float32 copy of the span each storage's tensors cover, each
    tensor a view of it with its own strides. So an op sees its own writes wherever CPU would:
    through an expanded tensor's stride-0 dims, or in another argument over the same memory
    (`torch._foreach_add_([x, x], [x, x])` updates x twice); random_ is the exception
    (_OWN_RANGE: its range is its dtype's). A float scalar past float32's range is its
    float32 infinity, as a float64 tensor of that value is once made float32 (logcumsumexp's
    float64 backward fills with the float64 `lowest()`)."""
    if ins.op in _OWN_RANGE:  # the float64 tensor itself, rounded to float32 precision after
        return args, kwargs, [(args[0], None)]
    leaves = [t for t in tree_leaves((args, kwargs))
              if isinstance(t, torch.Tensor) and t.dtype == torch.float64 and t.numel()]
    spans: dict[int, list] = {}  # storage -> [lo, hi, storage]
    for t in leaves:
        st = t.untyped_storage()
        lo, hi = _span(t)
        cur = spans.setdefault(st._cdata, [lo, hi, st])
        cur[0], cur[1] = min(cur[0], lo), max(cur[1], hi)
    twins = {k: (lo, torch.empty(0, dtype=torch.float64, device=_CPU).set_(st, lo, (hi - lo,), (1,))
                 .to(torch.float32)) for k, (lo, hi, st) in spans.items()}
    writeback = []
    # an out= tensor of float64 is written float32: so is the dtype asked for it
    # (`torch.sum(x, 0, dtype=torch.float64, out=o)`, CPU's check: "Expected out tensor to
    # have dtype double"; the call's meta check saw the float64 tensor)
    names = [a.name for a in ins.op._schema.arguments]
    written = [a for i, a in enumerate(args) if i in ins.mutated] \
        + [v for k, v in kwargs.items() if names.index(k) in ins.mutated]
    f64_out = any(isinstance(t, torch.Tensor) and t.dtype == torch.float64
                  for t in tree_leaves(written))

    def low(a, mutated):
        if a is torch.float64 and f64_out:
            return torch.float32
        if isinstance(a, torch.Tensor) and a.dtype == torch.float64:
            if not a.numel():
                return a.to(torch.float32)
            lo, flat = twins[a.untyped_storage()._cdata]
            b = flat.as_strided(a.shape, a.stride(), a.storage_offset() - lo)
            if mutated:
                writeback.append((a, b))
            return b
        if isinstance(a, list):
            return [low(x, mutated) for x in a]
        if type(a) is float and _F32_MAX < abs(a) < _INF:  # past float32's range: its float32
            return torch.tensor(a, dtype=torch.float64).float().item()  # cast (CPU's float32
        return a  # kernels refuse it: "value cannot be converted ... without overflow")

    args = [low(a, i in ins.mutated) for i, a in enumerate(args)]
    kwargs = {k: low(v, names.index(k) in ins.mutated) for k, v in kwargs.items()}
    return args, kwargs, writeback


_TORCH_DIR = torch.__file__.rsplit("/", 1)[0] + "/"


def _kernel_line(e: BaseException) -> str | None:
    """Note [Custom kernels]: where in the user's kernel body `e` was raised ("file:line"):
    the innermost frame outside PyTorch and this package."""
    here = __file__.rsplit("/", 1)[0] + "/"  # fusion/ (what runs the body)
    at, tb = None, e.__traceback__
    while tb is not None:
        f = tb.tb_frame.f_code.co_filename
        if not f.startswith(_TORCH_DIR) and not f.startswith(here) and not f.startswith("<"):
            at = f"{f}:{tb.tb_lineno}"
        tb = tb.tb_next
    return at


def _bad_result(ins, r, size, dtype) -> RuntimeError:
    """A kernel's result unlike what its fake impl said: the user's error, named."""
    got = (f"shape {list(r.shape)} and dtype {r.dtype}" if isinstance(r, torch.Tensor)
           else type(r).__name__)
    return RuntimeError(f"kernel {ins.op._schema.name} returned a result of {got}, but its "
                        f"fake impl said shape {list(size)} and dtype {dtype}: the neuron "
                        f"kernel and the fake impl must agree")
