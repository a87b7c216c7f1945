"""Why each compile happened: its program key against the keys already compiled for the same
op sequence.

Note [Compile causes]: a program key (fusion/program.py) is, per op, the op, its argument
templates (tensor layouts and dtypes, runtime scalars' types, static arguments) and its slot
map, with the group's inputs and outputs. A compile's cause is found by comparing its key
with the keys compiled before for the same op sequence (the nearest one):
  - "new op sequence": no key of that sequence was compiled before;
  - "new dtype" / "new scalar type" / "new shape" / "new static argument" / "new wiring"
    (which buffers the ops share, which values leave the group): the first kind of field,
    in that order, in which the nearest earlier key differs;
  - "cache setting": the very key was compiled before by another cache (a new salt,
    directory or size limits made a new cache: Engine.reconfigure);
  - "cache eviction": it was compiled before by this same cache, which dropped it.
For a new shape, the group input and dimension that varied are named (the first tensor
input of the group whose size differs, in op order), with the op that reads it.
The history is per process and bounded; it survives `reset_metrics()` (what the compiler has
seen is not a counter), the counts and records do not.
"""
from __future__ import annotations

import collections

from device.counters import COUNTERS

_MAX_SEQS = 10_000  # op sequences remembered
_MAX_KEYS = 64  # keys remembered per op sequence (the newest)
ORDER = ("dtype", "scalar", "shape", "static", "wiring")
CAUSES = {"dtype": "new dtype", "scalar": "new scalar type", "shape": "new shape",
          "static": "new static argument", "wiring": "new wiring"}


class Record:
    """One compile: its cause, the varied input dimension if a new shape, its ops' sources."""

    __slots__ = ("cause", "name", "n_ops", "us", "sources", "dim", "sizes", "input_source",
                 "detail", "entry")

    def __init__(self, cause, name, n_ops, us, sources):
        self.cause = cause
        self.name = name
        self.n_ops = n_ops
        self.us = us
        self.sources = sources  # Node.source per op (resolved only when a report asks)
        self.dim = None  # new shape: (op name, argument index, dim)
        self.sizes = None  # (earlier size, this size) of that dim
        self.input_source = None  # Node.source of the op reading that input
        self.detail = ""
        self.entry = COUNTERS.n_entries  # tensors that had entered the device by then


class History:
    def __init__(self):
        self.seqs: collections.OrderedDict = collections.OrderedDict()  # seq -> [(key, cache)]

    def clear(self) -> None:
        self.seqs.clear()

    def cause(self, program, cache_id, nodes=None, us=0.0) -> Record:
        """Classify the compile of `program` (by cache `cache_id`), remember its key, count
        the cause (COUNTERS.compile_causes) and keep its record (COUNTERS.compile_log)."""
        key = program.key
        seq = tuple((i[0], i[1]) for i in key[0])
        sources = tuple(n.source for n in nodes) if nodes is not None else ()
        seen = self.seqs.get(seq)
        rec = Record("new op sequence", program.name, len(key[0]), us, sources)
        if seen is not None:
            self.seqs.move_to_end(seq)
            same = [c for k, c in seen if k == key]
            if same:
                rec.cause = "cache eviction" if cache_id in same else "cache setting"
            else:
                mine = _features(key)
                best = None
                for k, _ in seen:
                    kind, where = _diff(mine, _features(k))
                    rank = ORDER.index(kind) if kind in ORDER else len(ORDER)
                    if best is None or rank > best[0]:  # the nearest: differs least deeply
                        best = (rank, kind, where, k)
                _, kind, where, _ = best
                rec.cause = CAUSES.get(kind, "new wiring")
                if kind == "shape" and where is not None:
                    i, arg, dim, old, new = where
                    rec.dim = (_op_name(key[0][i]), arg, dim)
                    rec.sizes = (old, new)
                    rec.detail = f"dim {dim} of input {arg} of {rec.dim[0]} ({old} -> {new})"
                    if nodes is not None and i < len(nodes):
                        rec.input_source = nodes[i].source
            seen[:] = [(k, c) for k, c in seen if k != key][-(_MAX_KEYS - 1):]
            seen.append((key, cache_id))
        else:
            self.seqs[seq] = [(key, cache_id)]
            if len(self.seqs) > _MAX_SEQS:
                self.seqs.popitem(last=False)
        COUNTERS.compile_causes[rec.cause] += 1
        if rec.detail:
            COUNTERS.compile_dims[rec.detail.split(" (")[0]] += 1
        COUNTERS.compile_log.append(rec)
        return rec


HISTORY = History()


def _op_name(instr) -> str:
    return instr[0].split("::")[-1] + ("" if instr[1] == "default" else "." + instr[1])


def _features(key):
    """Per kind, the key's fields in op order: dtype, scalar (types), shape (size, stride,
    offset of each tensor template, with (op index, argument index, is group input)),
    static (everything else), wiring (slot maps, inputs, outputs)."""
    instrs, n_inputs, outputs = key
    f = {k: [] for k in ORDER}
    for i, ins in enumerate(instrs):
        _, _, args, kwargs, outs, smap = ins
        for a, t in enumerate(tuple(args) + tuple(v for _, v in kwargs)):
            _walk(t, f, (i, a, smap, n_inputs))
        for o in outs:
            if o is not None:  # ("N", li, size, stride, dtype)
                f["shape"].append(((i, -1, False), o[2], o[3], 0))
                f["dtype"].append(o[4])
        f["wiring"].append(smap)
        f["static"].append(tuple(k for k, _ in kwargs))
    f["wiring"].append((n_inputs, outputs))
    return f


def _walk(t, f, where):
    i, a, smap, n_inputs = where
    if type(t) is tuple and t and type(t[0]) is str:
        tag = t[0]
        if tag == "T":  # ("T", local buffer, size, stride, offset, dtype, ...)
            is_input = t[1] < len(smap) and smap[t[1]] < n_inputs
            f["shape"].append(((i, a, is_input), t[2], t[3], t[4]))
            f["dtype"].append(t[5])
            f["static"].append(t[6:])
            return
        if tag == "S":
            f["scalar"].append(t[2])
            return
        if tag == "H":
            f["dtype"].append(t[2])
            f["shape"].append(((i, a, False), t[3], (), 0))
            return
        if tag == "L":
            f["static"].append(("L", len(t)))
            for x in t[1:]:
                _walk(x, f, where)
            return
    f["static"].append(t)


def _diff(a, b):
    """(the first kind in ORDER whose fields differ, and for "shape" the varied input
    dimension (op index, argument index, dim, b's size, a's size)); ("same", None) if none."""
    for kind in ORDER:
        if a[kind] != b[kind]:
            if kind == "shape":
                return kind, _varied(a["shape"], b["shape"])
            return kind, None
    return "same", None


def _varied(a, b):
    if len(a) != len(b):
        return None
    first = None
    for (wa, sa, _, _), (wb, sb, _, _) in zip(a, b):
        if sa != sb and len(sa) == len(sb):
            d = next(d for d in range(len(sa)) if sa[d] != sb[d])
            hit = (wa[0], wa[1], d, sb[d], sa[d])
            if wa[2]:  # a group input: what the user fed in
                return hit
            first = first or hit
    return first
