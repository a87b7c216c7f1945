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


def churn(records=None) -> dict | None:
    """The new-shape compiles' main cause: the (input dim, line reading it) with the most of
    them, its share of all compiles, its distinct sizes, and a what-if per bucketing: the
    compiles if that dim were padded up to a bucket, replayed from the records (per op
    sequence, one compile per distinct bucket instead of per distinct size). None if no
    compile was a new shape. Sizes are of the group's input as the device sees it (a view
    folded into it: `x.view(B*T, C)` varies in B*T)."""
    recs = list(COUNTERS.compile_log if records is None else records)
    groups: dict = {}
    for r in recs:
        if r.dim is not None:
            k = (r.dim[2], r.dim[0], r.dim[1], where(r.input_source))
            groups.setdefault(k, []).append(r)
    if not groups:
        return None
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
            "op": op, "input": arg, "line": line, "sizes": sizes, "whatif": whatif}


def churn_sentence(c: dict | None) -> str:
    if not c:
        return ""
    s = c["sizes"]
    w = ", ".join(f"{k}: {v}" for k, v in c["whatif"].items())
    return (f"{100 * c['share']:.0f}% of compiles ({c['new_shapes']} of {c['compiles']}) are "
            f"new shapes of dim {c['dim']} of input {c['input']} of {c['op']} at "
            f"{short(c['line'])} ({len(s)} distinct sizes, {s[0]}..{s[-1]}); padding that dim "
            f"would make the compiles: {w} (replayed from the compile records; the padding's "
            f"extra device time is not priced)")
