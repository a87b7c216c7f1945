"""`ae.line_report()`: where the device time and the compiles go, by the user's own lines.

Note [Line report]: read from what is kept anyway, only when asked: each core's timeline
(Device.trace: every launch with its ops' sources, resolved to file:line here, and their
(FLOPs, bytes), one tuple per plan group) since the last `reset_metrics()` (or the oldest event the bounded timeline
still holds), the compile records (COUNTERS.compile_log, Note [Compile causes]) and the sync
sites (COUNTERS.sync_sites). Per line:
  - ops: ops issued there that were launched; launches: launches holding at least one;
  - device time: each launch's time split among its ops by their modeled cost alone
    (DeviceSpec.launch_us minus the launch overhead: bytes / bandwidth against FLOPs / peak),
    evenly among its ops when none has a modeled cost (`split` says which, per line: "cost",
    "even" or both);
  - compiles: compiles of a group holding one of its ops; new shapes: new-shape compiles
    whose varied input is read by its op; syncs: host reads that flushed there.
Ops that never reach a launch (CPU fallbacks, ops run at once on the host) are not counted.
"""
from __future__ import annotations

import bisect
import os

from device import COUNTERS

from ..engine.source import where

_MARKS: dict = {}  # core index -> the newest timeline event at the last reset_metrics()


def mark(engines) -> None:
    """Start the report's window now (`reset_metrics()` calls it)."""
    for eng in engines:
        t = eng.device.trace
        _MARKS[eng.index] = t[-1] if t else None


def _window(eng) -> list:
    trace = list(eng.device.trace)
    m = _MARKS.get(eng.index)
    if m is None:
        return trace
    for i in range(len(trace) - 1, -1, -1):
        if trace[i] is m:
            return trace[i + 1:]
    return trace  # the bounded timeline dropped the mark: all it holds


class LineReport:
    def __init__(self, rows: list[dict]):
        self.rows = rows  # sorted by device time, then compiles

    def top(self, n: int = 10) -> list[dict]:
        return self.rows[:n]

    def __str__(self) -> str:
        return table(self.rows)

    __repr__ = __str__


def line_report(engines) -> LineReport:
    rows: dict = {}

    def row(k):
        r = rows.get(k)
        if r is None:
            r = rows[k] = {"line": k, "ops": 0, "launches": 0, "device_us": 0.0,
                           "compiles": 0, "new_shapes": 0, "syncs": 0, "split": set()}
        return r

    for eng in engines:
        spec = eng.device.spec
        for name, kind, ts, dur, nbytes, flops, nodes in _window(eng):
            if not nodes or kind not in ("launch", "kernel"):
                continue
            costs = [spec.launch_us(nbytes_, flops_) - spec.launch_overhead_us
                     for flops_, nbytes_ in nodes[1]]
            total = sum(costs)
            split = "cost" if total > 0 else "even"
            seen = set()
            for source, c in zip(nodes[0], costs):
                k = where(source)
                r = row(k)
                r["ops"] += 1
                r["device_us"] += dur * (c / total if total > 0 else 1 / len(costs))
                r["split"].add(split)
                if k not in seen:
                    seen.add(k)
                    r["launches"] += 1
    for rec in list(COUNTERS.compile_log):
        for k in {where(s) for s in rec.sources}:
            row(k)["compiles"] += 1
        if rec.input_source is not None:
            row(where(rec.input_source))["new_shapes"] += 1
    for site, n in COUNTERS.sync_sites.items():
        k = site.partition("@")[2]
        if k:
            row(k)["syncs"] += n
    out = sorted(rows.values(), key=lambda r: (-r["device_us"], -r["compiles"], r["line"]))
    for r in out:
        r["split"] = "+".join(sorted(r["split"])) or "-"
    return LineReport(out)


def short(line: str) -> str:
    path, _, n = line.rpartition(":")
    return f"{os.path.basename(path)}:{n}" if path else line


def table(rows: list[dict], n: int | None = 20) -> str:
    """The rows as text (the first `n`)."""
    total = sum(r["device_us"] for r in rows) or 1.0
    head = ["line", "ops", "launches", "device ms", "share", "compiles", "new shapes",
            "syncs", "split"]
    body = [[short(r["line"]), str(r["ops"]), str(r["launches"]),
             f"{r['device_us'] / 1e3:.3f}", f"{100 * r['device_us'] / total:.0f}%",
             str(r["compiles"]), str(r["new_shapes"]), str(r["syncs"]), r["split"]]
            for r in rows[:n]]
    if not body:
        return "no launches with user lines in this window"
    w = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    lines = ["  ".join(c.ljust(k) for c, k in zip(x, w)).rstrip() for x in [head] + body]
    lines.insert(1, "  ".join("-" * k for k in w))
    if len(rows) > len(body):
        lines.append(f"(+{len(rows) - len(body)} more lines)")
    lines.append("device time: each launch's time split among its ops by modeled cost "
                 "(split=cost), evenly where they have none (split=even)")
    return "\n".join(lines)


BUCKETS = {"multiple of 16": lambda n: -(-n // 16) * 16,
           "multiple of 32": lambda n: -(-n // 32) * 32,
           "multiple of 64": lambda n: -(-n // 64) * 64,
           "power of two": lambda n: 1 << max(0, (n - 1).bit_length())}


def churn(records=None, entries=None) -> dict | None:
    """The new-shape compiles' main cause and a what-if per bucketing (Note [Shape churn]).
    None if no compile was a new shape."""
    recs = list(COUNTERS.compile_log if records is None else records)
    if not any(r.dim is not None for r in recs):
        return None
    root = _root(recs, list(COUNTERS.entries if entries is None else entries))
    if root is not None:
        line, dim, sizes_at, explained = root
        sizes = sorted({n for n in sizes_at.values() if n is not None})
        whatif = {name: _whatif(recs, sizes_at, b) for name, b in BUCKETS.items()}
        return {"compiles": len(recs), "new_shapes": explained, "share": explained / len(recs),
                "dim": dim, "op": None, "input": None, "line": line, "entered": True,
                "sizes": sizes, "whatif": whatif}
    groups: dict = {}  # no tensor entered the device with those sizes: the group inputs'
    for r in recs:
        if r.dim is not None:
            k = (r.dim[2], r.dim[0], r.dim[1], where(r.input_source))
            groups.setdefault(k, []).append(r)
    (dim, op, arg, line), rs = max(groups.items(), key=lambda kv: len(kv[1]))
    per_seq: dict = {}  # op sequence -> sizes of that dim compiled
    for r in rs:
        per_seq.setdefault(r.name, set()).update(r.sizes)
    sizes = sorted(set().union(*per_seq.values()))
    total = len(recs)
    compiled = sum(len(s) for s in per_seq.values())  # one compile per size, per sequence
    whatif = {name: total - compiled + sum(len({b(n) for n in s}) for s in per_seq.values())
              for name, b in BUCKETS.items()}
    return {"compiles": total, "new_shapes": len(rs), "share": len(rs) / total, "dim": dim,
            "op": op, "input": arg, "line": line, "entered": False, "sizes": sizes,
            "whatif": whatif}


# Note [Shape churn]: the compiles' varied sizes are traced back to the tensor they come
# from, where it entered the device (COUNTERS.entries: each host-to-device copy's line and
# shape; each compile record keeps the number of the last entry before it). For each line
# and dimension whose size varied, the size current at each compile (that line's last entry
# before it) is its root size; a new-shape compile follows it if its new size is a multiple
# of that root size (B*T of a view, 4*T of a projection). A line and dim whose root size was
# the same at every compile is no cause (a model's parameters, moved by one line). The (line, dim) that the most
# new-shape compiles follow is the cause named ("dim 1 of the tensor from train.py:9").
# The what-if replays every compile record, under each bucketing of that root size: per op
# sequence, the compiles made while the root size was T count once per bucket (the most
# made at any one T of that bucket); records from before the first entry count as they
# are. This assumes the op sequences' compiles depend on the root size only (a flush whose
# partition moved with the size counts in the bucket of the sizes it was seen at). Without
# an entry to follow (tensors made on the device), the group input dim with the most
# new-shape compiles is named, with a what-if over its own sizes only.
def _root(recs, entries):
    """(line, dim, {record index: root size}, new-shape compiles following it), or None."""
    series: dict = {}  # (line, dim) -> [(entry number, size)]
    for n, source, shape in entries:
        k = where(source)
        for d, size in enumerate(shape):
            series.setdefault((k, d), []).append((n, size))
    best = None
    for (line, dim), s in series.items():
        if len({size for _, size in s}) < 2:
            continue  # a dim that never varied is no cause
        nums = [n for n, _ in s]
        at, follow = {}, 0
        for i, r in enumerate(recs):
            j = bisect.bisect_right(nums, r.entry) - 1
            at[i] = s[j][1] if j >= 0 else None
            if r.sizes is not None and at[i] and r.sizes[1] % at[i] == 0:
                follow += 1
        seen = len({t for t in at.values() if t is not None})
        if seen < 2:
            continue  # the same size at every compile (tensors of one line, before them)
        rank = (follow, seen)
        if follow and (best is None or rank > best[0]):
            best = (rank, (line, dim, at, follow))
    return best[1] if best else None


def _whatif(recs, sizes_at, bucket) -> int:
    made: dict = {}  # (op sequence, root size) -> compiles
    out = 0
    for i, r in enumerate(recs):
        t = sizes_at[i]
        if t is None:
            out += 1
        else:
            made[(r.name, t)] = made.get((r.name, t), 0) + 1
    most: dict = {}  # (op sequence, bucket) -> the most compiles at one size of it
    for (name, t), n in made.items():
        k = (name, bucket(t))
        most[k] = max(most.get(k, 0), n)
    return out + sum(most.values())


def churn_sentence(c: dict | None) -> str:
    if not c:
        return ""
    s = c["sizes"]
    w = ", ".join(f"{k}: {v}" for k, v in c["whatif"].items())
    what = (f"dim {c['dim']} of the tensor from {short(c['line'])}" if c.get("entered") else
            f"dim {c['dim']} of input {c['input']} of {c['op']} at {short(c['line'])}")
    return (f"{100 * c['share']:.0f}% of compiles ({c['new_shapes']} of {c['compiles']}) are "
            f"new shapes of {what} ({len(s)} distinct sizes, {s[0]}..{s[-1]}); padding that dim "
            f"would make the compiles: {w} (replayed from the compile records; the padding's "
            f"extra device time is not priced)")
