"""`ae.line_report()`: where the device time and the compiles go, by the user's own lines.

Note [Line report]: read from what is kept anyway, only when asked: each core's timeline
(Device.trace: every launch with its ops, fusion.ir.Node, whose sources are resolved to
file:line here) since the last `reset_metrics()` (or the oldest event the bounded timeline
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
            if not nodes or kind != "launch":
                continue
            costs = [spec.launch_us(n.in_bytes + n.out_bytes, n.flops)
                     - spec.launch_overhead_us for n in nodes]
            total = sum(costs)
            split = "cost" if total > 0 else "even"
            seen = set()
            for n, c in zip(nodes, costs):
                k = where(n.source)
                r = row(k)
                r["ops"] += 1
                r["device_us"] += dur * (c / total if total > 0 else 1 / len(nodes))
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
