"""Note [Generated runs]: an Executable's instrs, as one generated Python function.

The interpreter (`Executable.run`'s loop over `run_instr`) decodes every instr's templates
on every run: per op, about as much host time again as the CPU kernel itself. A program is
fixed once built, so its run is generated once instead, as TorchInductor's wrapper code and
tinygrad's generated runners are: each op one line that calls its kernel on the tensors it
reads, held in the run's `views` list, as `run_instr` would make them.

The generated function runs only when no input is poisoned (Note [Poison] in program.py: the
interpreter skips what depends on one). It does exactly what `run_instr` does, instr by
instr, with the same objects: a view made at its first read and reused after, a result
tensor reused by the ops that read its exact view, the same output checks. Instrs it does
not specialize (random ones, the float64 policy's, results of several tensors) call
`run_instr` itself. It returns None, or, if an instr raised, `(index, LaunchError)` (the
kernel's own error, or an internal one, told apart as `run_instr` tells them) with every
earlier instr done: the interpreter goes on from the next instr.
"""
from __future__ import annotations

import dis
import math
import os

import torch

from device import LaunchError

_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep  # Dynamo's skip rule: by file

_CPU = torch.device("cpu")
# The instructions that call the kernel: where its own error stops the frame (3.11's PRECALL
# makes the call itself once specialized; `co_code` shows the unspecialized opcode)
_CALLS = frozenset(dis.opmap[n] for n in ("PRECALL", "CALL") if n in dis.opmap)
_CACHE = dis.opmap.get("CACHE")


def _call_offsets(code) -> frozenset:
    """The offsets of `code` where a frame stopped by a call's exception may stand: a call
    instruction's own and its inline cache entries'. A kernel that is a Python function
    (fusion/ops.py's wrappers) runs in a frame 3.11 pushes after stepping past the CALL's
    caches, so the traceback's `tb_lasti` is the last cache entry, not the CALL."""
    raw, out, owner = code.co_code, set(), None
    for at in range(0, len(raw), 2):
        if raw[at] != _CACHE or owner is None:
            owner = raw[at]
        if owner in _CALLS:
            out.add(at)
    return frozenset(out)


def generate(instrs, n_views: int, outputs, run_instr, checked: bool = True):
    """The generated run of `instrs` (bound Instrs): `fn(st, inputs, rng, views)`, `views`
    holding n_views + the program's slot count entries (Note [Host views]). Slots of
    `outputs` (written back) get their storage in `st`, as does any slot a later op reads
    through another view; a view is dropped after its last read, so the memory of a chain's
    dead intermediates is reused as on CPU (the interpreter keeps every one to the end).

    Note [Proven layouts]: `checked` runs check each result's layout against the op's
    signature (and copy it into that layout where it differs: `fn.fixed` holds those ops).
    A kernel's result layout is a function of its inputs' layouts, dtypes and scalar types,
    which a program fixes (its views are made from its templates, its scalars' types are in
    its key): once checked runs needed no copy, an unchecked run (`checked=False`) skips the
    checks, except for ops reading host tensors (their layouts are the caller's)."""
    fixed: set[int] = set()  # ops whose result a checked run had to copy into its layout
    ns = {"LaunchError": LaunchError, "run_instr": run_instr, "_view": _view,
          "_fix": _fix, "I": tuple(instrs), "FIXED": fixed}
    fast = [not (ins.random or ins.f64 or ins.user or ins.quiet or not _simple_outs(ins))
            for ins in instrs]
    last: dict[int, int] = {}  # view id -> the last instr reading it
    stored = set(outputs)  # slots whose storage must be in `st`
    made: set[int] = set()  # view ids this run has made by the time an instr runs
    for i, ins in enumerate(instrs):
        for t in tensor_templates(ins.args + tuple(ins.kwargs.values())):
            last[t[1]] = i
            # a view made from its slot's storage (a first read; run_instr's reads may be)
            if not fast[i] or t[1] not in made:
                stored.add(t[2])
            made.add(t[1])
        made.update(o[4] for o in ins.outs if o is not None and o[4] is not None)
    made = set()
    body = []  # (line, phase code k): instr i's arguments 3i, kernel 3i+1, output 3i+2
    for i, ins in enumerate(instrs):
        if not fast[i]:
            body.append((f"run_instr(I[{i}], st, inputs[{i}], rng, views)", 3 * i))
            made.update(t[1] for t in tensor_templates(ins.args + tuple(ins.kwargs.values())))
            made.update(o[4] for o in ins.outs if o is not None and o[4] is not None)
        else:
            pre = []  # the views this instr reads first: made before its kernel is called
            exprs = [_expr(a, i, j, ns, made, pre) for j, a in enumerate(ins.args)]
            exprs += [f"{name}={_expr(v, i, f'k{name}', ns, made, pre)}"
                      for name, v in ins.kwargs.items()]
            body += [(line, 3 * i) for line in pre]
            ns[f"K{i}"] = ins.kernel
            body.append((f"r = K{i}({', '.join(exprs)})", 3 * i + 1))
            o = next((o for o in ins.outs if o is not None), None) if ins.any_out else None
            if o is not None:
                s, size, stride, dtype, vid = o
                ns[f"o{i}"], ns[f"d{i}"], ns[f"s{i}"], ns[f"z{i}"] = o, dtype, stride, size
                if checked or _reads_host(ins):
                    body.append((f"if r.dtype is not d{i} or r.storage_offset() or r.stride() "
                                 f"!= s{i} or r.shape != z{i}: FIXED.add({i}); "
                                 f"r = _fix(r, o{i}, {op_name(ins.op)!r})", 3 * i + 2))
                if s in stored:
                    body.append((f"st[{s}] = r.untyped_storage()", 3 * i + 2))
                if s in outputs:  # Note [Host views]: its buffer's host view, after the run
                    body.append((f"views[{n_views + s}] = r", 3 * i + 2))
                if vid is not None and last.get(vid, -1) > i:
                    body.append((f"views[{vid}] = r", 3 * i + 2))
                    made.add(vid)
        dead = [v for v, j in last.items() if j == i]
        if dead:
            body.append(("; ".join(f"views[{v}] = None" for v in dead), 3 * i + 2))
    src = ["def run(st, inputs, rng, views):", "    try:"]
    # Which instr and phase each line is (the line an exception stops at: no per-op stores)
    ns["PHASE"] = {len(src) + 1 + n: k for n, (_, k) in enumerate(body)}
    src += [f"        {line}" for line, _ in body] or ["        pass"]
    src += ["    except Exception as e:",
            "        tb = e.__traceback__",
            "        k = PHASE[tb.tb_lineno]",
            "        if k % 3 == 1 and tb.tb_lasti not in CALL_AT:  # an argument",
            "            k -= 1",
            "        if not isinstance(e, LaunchError):",
            "            e = LaunchError(e, internal=k % 3 != 1)",
            "        return k // 3, e",
            "    return None"]
    # Named inside this package: Dynamo skips the package's files (integration/compile.py),
    # and so it must skip a run that a flush makes inside a compiled region's graph break
    # (it would trace the run, its host views under no_dispatch).
    exec(compile("\n".join(src), f"{_HERE}<generated run of {len(instrs)} ops>", "exec"), ns)
    ns["CALL_AT"] = _call_offsets(ns["run"].__code__)
    run = ns["run"]
    run.checked, run.fixed = checked, fixed
    return run


def _reads_host(ins) -> bool:
    """Does `ins` read a host tensor ("H" templates, in lists too)?"""
    def host(t):
        return type(t) is tuple and t and (t[0] == "H" or t[0] == "L" and any(map(host, t[1:])))
    return any(map(host, ins.args + tuple(ins.kwargs.values())))


def _simple_outs(ins) -> bool:
    """One result tensor of a dtype with no special storage rule, or none (`run_instr`'s
    output loop, specialized)."""
    if not ins.any_out:
        return True
    returns = ins.op._schema.returns
    if len(returns) != 1 or str(returns[0].type) != "Tensor":  # a list, a tuple
        return False
    outs = [o for o in ins.outs if o is not None]
    return (len(ins.outs) == 1 and len(outs) == 1
            and outs[0][3] is not torch.float64 and not outs[0][3].is_complex)


def _expr(t, i, j, ns, made, body) -> str:
    """The expression of bound template `t` (argument `j` of instr `i`): as `_value` makes
    it. A view's first read makes it (a line of `body`), later ones reuse it."""
    if type(t) is tuple:
        tag = t[0]
        if tag == "T":
            vid = t[1]
            if vid not in made:
                made.add(vid)
                # (body: the instr's lines before its kernel; the test inlined: per launch)
                body.append(f"if views[{vid}] is None: _view(st, views, {vid}, {t[2]}, "
                            f"{t[3]!r}, {t[4]!r}, {t[5]}, c{i}_{j})")
                ns[f"c{i}_{j}"] = t[6]
            return f"views[{vid}]"
        if tag == "L":
            return "[" + ", ".join(_expr(x, i, f"{j}_{n}", ns, made, body)
                                   for n, x in enumerate(t[1:])) + "]"
        if tag in ("S", "H"):
            return f"inputs[{i}][{t[1]}]"
        ns[f"c{i}_{j}"] = t[1]  # "C": an enum or a special float, as an object
        return f"c{i}_{j}"
    ns[f"c{i}_{j}"] = t
    return f"c{i}_{j}"


def tensor_templates(templates) -> list[tuple]:
    """The bound tensor templates ("T", view id, slot, ...) among `templates`, in lists too."""
    out = []
    for t in templates:
        if type(t) is tuple and t:
            if t[0] == "T":
                out.append(t)
            elif t[0] == "L":
                out += tensor_templates(t[1:])
    return out


def _view(st, views, vid, slot, size, stride, offset, dtype) -> None:
    """`_value`'s first read of a view: a CPU tensor over the slot's storage, unless the
    launch handed it in (Note [Host views])."""
    if views[vid] is None:
        views[vid] = torch.empty(0, dtype=dtype, device=_CPU).set_(st[slot], offset, size,
                                                                   stride)


# Note [Host views]: making a CPU tensor over a slot's storage (`torch.empty(0).set_(...)`)
# costs about two CPU kernels of a tiny op; a one-op launch (eager mode) makes one per input,
# on every launch, for buffers it read the launch before. So a device buffer keeps the last
# CPU tensor a launch read it through (`Buffer.host`: its layout and the tensor), and a
# launch reading it with that layout gets that tensor in its `views` (Executable.host_views:
# the input views it may take so); a new buffer keeps the result tensor that wrote it (the
# generated run leaves it at `views[n_views + slot]`). A buffer's storage never changes (a
# resize makes a new buffer), and a program's kernels do not change their arguments'
# metadata (in-place view ops and resizes are the engine's, before the launch), so the
# tensor is exactly what `_view` would make. A view whose (slot, layout) two view ids of the
# program share (one tensor passed as two objects: Note [Tensor identity] in
# adaptive_eager/engine/templates.py) is always made afresh. Layout keys are one object per
# layout (`layout_key`), so a reader finds its writer's view by identity. A launch that runs TorchInductor's
# code (fusion/executors) reads its slots' storages (`FxGroup.args`): it makes none.
def host_views(instrs, n_inputs: int) -> tuple:
    """(view id, slot, layout) of the input views a launch may hand in (Note [Host views])."""
    seen: dict = {}
    for ins in instrs:
        for t in tensor_templates(ins.args + tuple(ins.kwargs.values())):
            if t[2] < n_inputs:
                seen.setdefault((t[2],) + tuple(t[3:7]), set()).add(t[1])
    return tuple((next(iter(v)), k[0], layout_key(k[1:])) for k, v in seen.items()
                 if len(v) == 1)


_LAYOUTS: dict = {}


def layout_key(layout: tuple) -> tuple:
    """One object per (size, stride, offset, dtype) seen (Note [Host views]): a launch finds
    the view a buffer keeps by `is` (its writer's out key, its reader's host_views key), not
    by comparing the tuples. (Past 10,000 layouts they start again: only `==` finds those
    kept before.)"""
    key = _LAYOUTS.get(layout)
    if key is None:
        if len(_LAYOUTS) >= 10_000:
            _LAYOUTS.clear()
        key = _LAYOUTS[layout] = layout
    return key


# Note [Misshaped results]: an output's shape is planned at the call, from the meta kernel
# checked by the CPU probe (Note [CPU probe]). Where the plan is wrong (a meta kernel shaping
# unlike CPU's, over inputs too big to probe), copying the kernel's result into the planned
# buffer would broadcast it: `nansum(x, dim=[])`'s total in every element of x's shape. A
# result of another element count raises instead (at the sync, naming the op): never a
# silently wrong value. (Same count, other shape: size-1 dims only, the same values.)
def op_name(op) -> str:
    schema = getattr(op, "_schema", None)
    return schema.name if schema is not None else str(op)


def misshaped(name, r, size) -> RuntimeError | None:
    """The error for result `r` if copying it into the planned `size` would broadcast it."""
    if r.shape == size or r.numel() == math.prod(size):
        return None
    return RuntimeError(f"internal error: {name} returned a result of shape {list(r.shape)} "
                        f"where the device planned {list(size)} (its meta kernel shapes it "
                        f"unlike CPU's kernel); please report it")


def _fix(r, o, name):
    """A result laid out unlike the op's signature says: copied into that layout (as
    `run_instr`), unless misshaped (Note [Misshaped results])."""
    e = misshaped(name, r, o[1])
    if e is not None:
        raise e
    e = torch.empty_strided(o[1], o[2], dtype=o[3], device=_CPU)
    e.copy_(r)
    return e
