"""`ae.explain()`: what the last flush did, and why each boundary fell where it did."""
from __future__ import annotations

import shutil
import subprocess

import networkx as nx

from .engine.source import lines as source_lines


class Explanation:
    def __init__(self, report, communication: dict | None = None):
        self.report = report
        self._communication = communication

    @property
    def communication(self) -> dict | None:
        """The last training step's collectives (steps end at optimizer steps; before the
        first, the collectives so far): `collectives`, `bytes`, `collective_us`,
        `exposed_us` (the compute stream waited for them), `hidden_us` (they ran under
        compute or host work), `pending` (still running: their exposure may grow), `step`,
        `complete`. Note [Collective stream] in device/core.py."""
        return self._communication

    @property
    def groups(self) -> list[dict]:
        """Per group: name, ops, bytes, flops, level, compiled, and `lines`: its ops' user
        lines, {"file:line": ops from it} (resolved now, not when the ops were recorded)."""
        out, nodes = self.report.groups, self.report.nodes
        start = 0
        for g in out:
            if nodes is not None:
                g["lines"] = source_lines(n.source for n in nodes[start:start + g["ops"]])
            start += g["ops"]
        return out

    @property
    def compiled(self) -> list[bool]:
        """Per group: did it run TorchInductor's compiled code (executor inductor/auto)?"""
        return [g["compiled"] for g in self.report.groups]

    @property
    def boundaries(self) -> list[str]:
        return self.report.boundaries

    @property
    def launches(self) -> int:
        return self.report.launches

    @property
    def launches_saved(self) -> int:
        """Against eager mode, where every op is a launch."""
        return self.report.n_ops - self.report.launches

    def __str__(self) -> str:
        r = self.report
        lines = [f"last flush: {r.n_ops} ops -> {r.launches} launches "
                 f"(eager: {r.n_ops}, saved {self.launches_saved}); reason: {r.reason}; "
                 f"strategy: {r.strategy}; plan {'reused' if r.plan_hit else 'built'}; "
                 f"bytes not written back: {r.bytes_saved}"]
        for i, g in enumerate(self.groups):
            if i:
                lines.append(f"  -- boundary: {r.boundaries[i - 1]}")
            name = g["name"] if len(g["name"]) <= 70 else g["name"][:67] + "..."
            ran = "  [compiled]" if g.get("compiled") else ""  # TorchInductor's code ran
            ran += "  [custom kernel]" if g.get("kernel") else ""
            lines.append(f"  [{i}] {g['ops']:3d} ops  {g['bytes']:>10d} B  {name}{ran}")
            if g.get("lines"):
                lines_ = ", ".join(f"{_short(k)} x{v}" if v > 1 else _short(k)
                                   for k, v in list(g["lines"].items())[:4])
                more = len(g["lines"]) - 4
                lines.append(f"      from {lines_}" + (f" (+{more} lines)" if more > 0 else ""))
            if g.get("bad"):
                lines.append(f"      ran op by op: its fused compile failed ({g['bad'][:100]})")
        lines += self._substitutions()
        c = self._communication
        if c and c["collectives"]:
            when = "last step" if c["complete"] else "so far (no optimizer step yet)"
            hidden = c["hidden_us"] / c["collective_us"] if c["collective_us"] else 0.0
            lines.append(f"communication, {when}: {c['collectives']} collectives, "
                         f"{c['bytes']} B, {c['collective_us']:.1f} us; exposed "
                         f"{c['exposed_us']:.1f} us, hidden {c['hidden_us']:.1f} us ({hidden:.0%})"
                         + (f"; {c['pending']} still running (exposure may grow)"
                            if c["pending"] else ""))
        return "\n".join(lines)

    @property
    def substitutions(self) -> list[dict]:
        """Note [Substitution]: per pattern found in this flush, the kernel, the ops, the
        user's line, whether it was replaced, and what replacing it saves in this flush
        (launches, modeled device time in us, HBM bytes; negative: what it would cost, the
        reason a pattern is declined)."""
        r = self.report
        out = []
        for s in list(r.substitutions) + list(r.declined):
            row = {"kernel": s.kernel, "ops": list(s.ops), "line": source_lines([s.source]),
                   "replaced": s in r.substitutions}
            if s.saved is not None:
                row.update(launches_saved=s.saved[0], device_us_saved=s.saved[1],
                           hbm_bytes_saved=s.saved[2])
            out.append(row)
        return out

    def _substitutions(self) -> list[str]:
        r = self.report
        if not r.substitutions and not r.declined:
            return []
        lines = [f"  substitution (ADAPTIVE_EAGER_SUBSTITUTE): {len(r.substitutions)} "
                 f"pattern(s) replaced, {len(r.declined)} declined"]
        for s in self.substitutions:
            where = ", ".join(_short(k) for k in s["line"])
            saved = ("" if "launches_saved" not in s else
                     f": saves {s['launches_saved']} launches, {s['device_us_saved']:.1f} us, "
                     f"{s['hbm_bytes_saved']} B")
            what = "replaced" if s["replaced"] else "declined (the flush costs less without)"
            lines.append(f"    {s['kernel']} for {'|'.join(s['ops'])} ({where}) {what}{saved}")
        if r.unsubstituted is not None:
            t, u = r.plan.totals, r.unsubstituted
            lines.append(f"    this flush: {t[0]} launches, {t[1]:.1f} us, {t[2]} B; with no "
                         f"pattern replaced: {u[0]} launches, {u[1]:.1f} us, {u[2]} B")
        return lines

    __repr__ = __str__

    def to_dot(self) -> str:
        """Graphviz DOT of the grouped dependency graph (one cluster per group)."""
        g = self.report.graph.copy()
        group_of = {}
        start = 0
        for gi, grp in enumerate(self.report.groups):
            for i in range(start, start + grp["ops"]):
                group_of[i] = gi
            start += grp["ops"]
        for i, data in g.nodes(data=True):
            data.clear()
            data["label"] = f"{i}: {self.report.graph.nodes[i]['name']}"
            data["group"] = group_of.get(i, -1)
        for _, _, data in g.edges(data=True):
            data["label"] = data.pop("kind", "")
        lines = ["digraph flush {", "  rankdir=TB;", "  node [shape=box, fontsize=10];"]
        for gi, grp in enumerate(self.report.groups):
            members = [i for i, d in g.nodes(data=True) if d["group"] == gi]
            lines.append(f"  subgraph cluster_{gi} {{")
            lines.append(f'    label="group {gi} ({grp["ops"]} ops)";')
            for i in members:
                lines.append(f'    n{i} [label="{g.nodes[i]["label"]}"];')
            lines.append("  }")
        for u, v, d in g.edges(data=True):
            lines.append(f'  n{u} -> n{v} [label="{d["label"]}", fontsize=8];')
        lines.append("}")
        return "\n".join(lines)

    def to_networkx(self) -> nx.DiGraph:
        return self.report.graph

    def save(self, path: str) -> str:
        """Write DOT (or SVG/PNG, rendered by Graphviz's `dot` when installed). Returns path."""
        dot = self.to_dot()
        fmt = path.rsplit(".", 1)[-1].lower()
        if fmt in ("svg", "png", "pdf") and shutil.which("dot"):
            subprocess.run(["dot", f"-T{fmt}", "-o", path], input=dot.encode(), check=True)
            return path
        if fmt in ("svg", "png", "pdf"):
            path = path.rsplit(".", 1)[0] + ".dot"
        with open(path, "w") as f:
            f.write(dot)
        return path


def _short(where: str) -> str:
    """"file.py:12" of "/path/to/file.py:12"."""
    path, _, line = where.rpartition(":")
    return f"{path.rsplit('/', 1)[-1]}:{line}" if path else where
