"""`python -m adaptive_eager run [--modes eager,graph,matmul,compile] [--json OUT]
[--trace DIR] [--lines [N]] SCRIPT [ARGS...]`: run an unchanged script that uses device="neuron" once per
mode, each in its own process (its output passes through), then compare the modes in one
table and give advice drawn from the numbers.

Modes: eager (one launch per op), graph and matmul (adaptive eager with that fusion
strategy), compile (adaptive eager, and every top-level nn.Module whose parameters are on
neuron runs through torch.compile(module, backend="neuron")). The figures come from the
metrics files each process writes (TORCH_NEURONX_METRICS_ENABLED=1). The exit code is
non-zero when the script fails in any mode.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
import types

MODES = {  # mode -> environment of its process
    "eager": {"TORCH_NEURONX_ENABLE_CONCATENATION": "0"},
    "graph": {"TORCH_NEURONX_ENABLE_CONCATENATION": "1", "ADAPTIVE_EAGER_FUSION_STRATEGY": "graph"},
    "matmul": {"TORCH_NEURONX_ENABLE_CONCATENATION": "1",
               "ADAPTIVE_EAGER_FUSION_STRATEGY": "matmul"},
    "compile": {"TORCH_NEURONX_ENABLE_CONCATENATION": "1",
                "ADAPTIVE_EAGER_FUSION_STRATEGY": "graph"},
}


def parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m adaptive_eager run",
        description="Run SCRIPT once per mode (each in a subprocess, its output passing "
                    "through), then print one table comparing the modes (ops, launches, "
                    "mean group size, top flush reasons, simulated device time, compiles, "
                    "CPU fallbacks, peak HBM, wall time) and advice drawn from the numbers. "
                    "Exits non-zero when the script fails in any mode.",
        epilog="example: python -m adaptive_eager run --modes eager,graph train.py --epochs 1")
    p.add_argument("--modes", default="eager,graph,matmul,compile",
                   help="comma-separated, from: " + ", ".join(MODES) + " (default: all)")
    p.add_argument("--json", metavar="OUT", help="also write the figures and advice as JSON")
    p.add_argument("--trace", metavar="DIR",
                   help="write each mode's device timeline to DIR/trace_<mode>.json (Perfetto)")
    p.add_argument("--lines", metavar="N", type=int, nargs="?", const=10, default=0,
                   help="also print, per mode, the N source lines (default 10) with the most "
                        "device time: ops, launches, device time, compiles, syncs")
    p.add_argument("script", help="the Python script to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    a = p.parse_args(argv)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        p.error(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    a.modes = modes
    return a


def run_mode(mode: str, script: str, args: list[str], trace_dir: str | None) -> dict:
    """One process running the script in `mode`; returns its aggregated figures."""
    with tempfile.TemporaryDirectory(prefix=f"ae-run-{mode}-") as mdir:
        env = dict(os.environ, TORCH_NEURONX_METRICS_ENABLED="1",
                   TORCH_NEURONX_METRICS_DIR=mdir, **MODES[mode])
        trace = os.path.join(trace_dir, f"trace_{mode}.json") if trace_dir else ""
        cmd = [sys.executable, "-m", "adaptive_eager.tools.run", "--child", mode, trace, script,
               *args]
        print(f"=== adaptive_eager run: {mode} ===", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, env=env)
        wall = time.perf_counter() - t0
        from .metrics_file import read_all
        files = read_all(mdir)
    out = aggregate(files)
    out.update(mode=mode, returncode=rc, wall_s=wall, processes=len(files))
    return out


def aggregate(files: list[dict]) -> dict:
    """Sum the counters of every process of one mode (peak HBM: the largest)."""
    s = collections.Counter()
    flushes, fallbacks, sites, groups, causes = (collections.Counter() for _ in range(5))
    lines: dict = {}
    peak = 0
    for f in files:
        m = f["metrics"]
        for k in ("ops", "launches", "compiles", "device_time_us", "compile_time_us"):
            s[k] += m[k]
        s["dynamo_graphs"] += sum(f["compile"]["graphs"].values())
        flushes.update(m["flushes"])
        fallbacks.update(m["cpu_fallbacks"])
        sites.update(m.get("sync_sites", {}))
        groups.update({int(k): v for k, v in m["group_sizes"].items()})
        causes.update(m.get("compile_causes", {}))
        peak = max(peak, m["peak_memory_bytes"])
        for r in f.get("lines", ()):  # the same line in several processes: summed
            t = lines.setdefault(r["line"], dict(r, split=set()))
            if t is not r and t.get("_n"):
                for k in ("ops", "launches", "device_us", "compiles", "new_shapes", "syncs"):
                    t[k] += r[k]
            t["_n"] = True
            t["split"] |= set(r["split"].split("+")) - {"-"}
    rows = sorted(lines.values(), key=lambda r: (-r["device_us"], -r["compiles"], r["line"]))
    for r in rows:
        r.pop("_n", None)
        r["split"] = "+".join(sorted(r["split"])) or "-"
    n = sum(groups.values())
    return {**s, "flushes": dict(flushes), "cpu_fallbacks": dict(fallbacks),
            "sync_sites": dict(sites), "peak_memory_bytes": peak,
            "compile_causes": dict(causes), "lines": rows,
            "churns": [f.get("churn") for f in files],
            "steps": [f.get("steps") for f in files],
            "mean_group_size": sum(k * v for k, v in groups.items()) / n if n else 0.0}


def table(results: list[dict]) -> str:
    head = ["mode", "exit", "ops", "launches", "mean group", "top flushes", "device ms",
            "compiles (modeled ms)", "CPU fallbacks", "peak HBM", "wall s"]
    rows = [head]
    for r in results:
        top = collections.Counter(r.get("flushes", {})).most_common(5)
        fb = collections.Counter(r.get("cpu_fallbacks", {})).most_common(3)
        rows.append([
            r["mode"], str(r["returncode"]), str(r.get("ops", 0)), str(r.get("launches", 0)),
            f"{r.get('mean_group_size', 0):.1f}",
            ", ".join(f"{k}={v}" for k, v in top) or "-",
            f"{r.get('device_time_us', 0) / 1e3:.3f}",
            f"{r.get('compiles', 0)} ({r.get('compile_time_us', 0) / 1e3:.0f})"
            + (f" + {r['dynamo_graphs']} Dynamo graphs" if r.get("dynamo_graphs") else ""),
            ", ".join(f"{k}={v}" for k, v in fb) or "-",
            _bytes(r.get("peak_memory_bytes", 0)), f"{r['wall_s']:.1f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def advice(results: list[dict]) -> list[str]:
    """A few lines drawn from the numbers (only claims the figures support)."""
    out = []
    by = {r["mode"]: r for r in results}
    failed = [r["mode"] for r in results if r["returncode"] != 0]
    if failed:
        out.append(f"The script failed in: {', '.join(failed)} (exit codes "
                   f"{', '.join(str(by[m]['returncode']) for m in failed)}); see its output "
                   f"above.")
    lazy = next((by[m] for m in ("graph", "matmul", "compile") if m in by
                 and by[m]["returncode"] == 0 and by[m].get("flushes")), None)
    if lazy is not None:
        total = sum(lazy["flushes"].values())
        sites = collections.Counter(lazy["sync_sites"]).most_common(1)
        if sites and total:
            site, n = sites[0]
            reason, _, where = site.partition("@")
            out.append(
                f"{100 * n / total:.0f}% of flushes in {lazy['mode']} mode are `{reason}` at "
                f"{_short(where) or 'an unknown line'} ({n} times); removing that sync would "
                f"cut launches by up to {n} (each one ends a fused group early).")
    for r in results:
        for op, n in collections.Counter(r.get("cpu_fallbacks", {})).most_common(3):
            out.append(f"{op} fell back to CPU {n} times in {r['mode']} mode (each one is a "
                       f"sync and two host copies).")
        if r.get("cpu_fallbacks"):
            break  # the same ops fall back in every mode: say it once
    eager = by.get("eager")
    if eager and eager.get("launches"):
        best = min((r for r in results if r["mode"] != "eager" and r.get("launches")),
                   key=lambda r: r["device_time_us"], default=None)
        if best is not None:
            out.append(
                f"{best['mode']} launches {best['launches']} executables against eager's "
                f"{eager['launches']} ({100 * best['launches'] / eager['launches']:.0f}%), "
                f"simulated device time {best['device_time_us'] / 1e3:.3f} ms against "
                f"{eager['device_time_us'] / 1e3:.3f} ms.")
    for r in results:  # the process with the most new-shape compiles speaks for its mode
        churns = [c for c in r.get("churns", ()) if c]
        if churns:
            from .lines import churn_sentence
            out.append(f"{r['mode']}: " + churn_sentence(max(churns,
                                                              key=lambda c: c["new_shapes"])))
    from .steps import sentence
    for r in results:  # the process with the most steps speaks for its mode
        steps = [s for s in r.get("steps", ()) if s]
        if steps:
            out.append(f"{r['mode']}: " + sentence(max(steps, key=lambda s: s["steps"])))
    comp = by.get("compile")
    if comp and comp["returncode"] == 0 and not comp.get("dynamo_graphs"):
        out.append("compile mode captured no graph: no nn.Module with parameters on neuron "
                   "was called (or Dynamo skipped it under a dispatch mode scope).")
    return out


def _short(where: str) -> str:
    path, _, line = where.rpartition(":")
    return f"{os.path.basename(path)}:{line}" if path else where


def main(argv=None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    if a.trace:
        os.makedirs(a.trace, exist_ok=True)
    results = [run_mode(m, a.script, a.args, a.trace) for m in a.modes]
    print("\n=== adaptive_eager run: " + os.path.basename(a.script) + " ===")
    print(table(results))
    if a.lines:
        from .lines import table as line_table
        for r in results:
            print(f"\n--- {r['mode']}: top {a.lines} lines by device time ---")
            print(line_table(r.get("lines", []), a.lines))
    tips = advice(results)
    if tips:
        print()
        print("\n".join("- " + t for t in tips))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"script": a.script, "args": a.args, "modes": results, "advice": tips},
                      f, indent=1)
    return 1 if any(r["returncode"] != 0 for r in results) else 0


# -- the child process: one mode ---------------------------------------------------------
def _compile_top_level_modules() -> None:
    """Compile mode for an unchanged script: the outermost call of every nn.Module whose
    parameters are on neuron goes through torch.compile(module, backend="neuron")."""
    import threading

    import torch

    from .. import patches
    original = torch.nn.Module.__call__
    state = threading.local()

    def call(self, *args, **kwargs):
        if getattr(state, "inside", False):
            return original(self, *args, **kwargs)
        p = next(self.parameters(), None)
        if p is None or p.device.type != "neuron":
            return original(self, *args, **kwargs)
        compiled = self.__dict__.get("_ae_compiled")
        if compiled is None:
            compiled = self.__dict__["_ae_compiled"] = torch.compile(
                lambda *a, **k: original(self, *a, **k), backend="neuron")
        state.inside = True
        try:
            return compiled(*args, **kwargs)
        finally:
            state.inside = False

    patches.patch(torch.nn.Module, "__call__", call,
                  rests_on="nn.Module.__call__, in the child process of `run --mode compile`")


def child(argv: list[str]) -> None:
    mode, trace, script, *args = argv
    import runpy

    import adaptive_eager as ae
    if mode == "compile":
        _compile_top_level_modules()
    if trace:
        import atexit
        atexit.register(ae.save_trace, trace)
    sys.argv = [script, *args]
    path = os.path.abspath(script)
    sys.path[0] = os.path.dirname(path)
    if not os.path.isfile(path):  # a folder or zip with __main__.py: runpy's own handling
        runpy.run_path(script, run_name="__main__")
        return
    # as `python script.py`: __file__ (and tracebacks) absolute, sys.argv[0] as typed;
    # run_path would make both what it was given
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__ = path, __builtins__
    sys.modules["__main__"] = main  # pickling and multiprocessing find the script's names
    exec(code, main.__dict__)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2:])
    else:
        sys.exit(main())
