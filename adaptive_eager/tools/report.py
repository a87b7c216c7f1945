"""`python -m adaptive_eager report BENCH.json`: a saved pytest-benchmark run of
benchmarks/ -> a Markdown table of ratios between modes, and a PNG chart."""
from __future__ import annotations

import argparse
import collections
import json

MODES = ["cpu", "eager", "graph", "matmul", "whole-graph", "compile"]


def load(path: str) -> dict:
    """{workload: {mode: extra_info + wall-clock mean (us)}}"""
    with open(path) as f:
        data = json.load(f)
    out: dict = collections.defaultdict(dict)
    for b in data["benchmarks"]:
        e = dict(b["extra_info"])
        if "workload" not in e:  # the tiny chain (host_table)
            continue
        e["wall_us"] = b["stats"]["mean"] * 1e6
        out[e["workload"]][e["mode"]] = e
    return out


def markdown(res: dict) -> str:
    head = ("workload", "mode", "launches/step", "vs eager", "mean group", "device us/step",
            "vs eager", "host us/op", "vs CPU", "HBM KiB/step", "saved KiB/step",
            "wall us/step", "first step ms (compile ms modeled)")
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for wl, modes in res.items():
        eager, cpu = modes.get("eager", {}), modes.get("cpu", {})
        for mode in MODES:
            e = modes.get(mode)
            if e is None:
                continue
            if mode == "cpu":
                k = e.get("inductor_kernels")
                rows.append(f"| {wl} | cpu (inductor kernels: {k if k is not None else 'n/a'}) "
                            f"| | | | | | {e['host_us_per_op']:.1f} | 1.00x | | | "
                            f"{e['wall_us']:.0f} | |")
                continue
            rows.append(
                f"| {wl} | {mode} | {e['launches_per_step']:.1f} | "
                f"{e['launches_per_step'] / eager['launches_per_step']:.1%} | "
                f"{e['mean_group_size']:.1f} | {e['device_us_per_step']:.1f} | "
                f"{e['device_us_per_step'] / eager['device_us_per_step']:.1%} | "
                f"{e['host_us_per_op']:.1f} | "
                f"{e['host_us_per_op'] / cpu['host_us_per_op']:.1f}x | "
                f"{e['hbm_bytes_per_step'] / 1024:.1f} | {e['bytes_saved_per_step'] / 1024:.1f}"
                f" | {e['wall_us']:.0f} | {_first(e)} |")
    return "\n".join(rows)


def host_table(path: str) -> str:
    """The tiny chain of benchmarks/test_host_overhead.py, if the run has it: host time per op
    against plain CPU torch and against the do-nothing dispatch floor (medians)."""
    with open(path) as f:
        data = json.load(f)
    med = {b["extra_info"]["mode"]: (b["stats"]["median"], b["extra_info"]["ops_per_step"])
           for b in data["benchmarks"] if b.get("group") == "tiny_chain"}
    if "cpu" not in med or "floor" not in med:
        return ""
    cpu, floor = med["cpu"][0], med["floor"][0]
    rows = ["| tiny chain mode | ms/step | host us/op | vs CPU | vs floor |", "|---|---|---|---|---|"]
    for mode in ("cpu", "floor", "graph", "eager"):
        if mode in med:
            t, n = med[mode]
            rows.append(f"| {mode} | {t * 1e3:.2f} | {t / n * 1e6:.2f} | {t / cpu:.1f}x | "
                        f"{t / floor:.1f}x |")
    return "\n".join(rows)


def _first(e: dict) -> str:
    if "first_step_ms" not in e:  # a run saved before these figures existed
        return ""
    return f"{e['first_step_ms']:.0f} ({e['first_step_compile_ms_modeled']:.0f})"


def chart(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    modes = [m for m in MODES if m != "cpu"]
    wls = list(res)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(modes)
    for ax, key, title in ((axes[0], "launches_per_step", "launches per step"),
                           (axes[1], "device_us_per_step", "simulated device time per step (us)")):
        for i, m in enumerate(modes):
            vals = [res[w].get(m, {}).get(key, 0) for w in wls]
            ax.bar([x + i * width for x in range(len(wls))], vals, width, label=m)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(wls))])
        ax.set_xticklabels(wls, rotation=20, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m adaptive_eager report", description=__doc__)
    p.add_argument("json", help="pytest-benchmark JSON (--benchmark-json=...)")
    p.add_argument("--md", default="benchmarks/results.md", help="Markdown table to write")
    p.add_argument("--png", default="benchmarks/results.png", help="chart to write")
    args = p.parse_args(argv)
    try:
        res = load(args.json)
    except (KeyError, TypeError, ValueError) as e:  # (json's errors are ValueErrors)
        p.error(f"{args.json} is not pytest-benchmark's JSON of this suite "
                f"({type(e).__name__}: {e}); make one with --benchmark-json=FILE")
    table = markdown(res)
    host = host_table(args.json)
    if host:
        table += "\n\nHost time per op on an 800-op chain of tiny pointwise ops (floor: a " \
                 "do-nothing `__torch_dispatch__` subclass):\n\n" + host
    with open(args.md, "w") as f:
        f.write(table + "\n")
    print(table)
    try:
        chart(res, args.png)
    except ImportError:
        print(f"\n-> {args.md} (no chart: matplotlib is missing; pip install -e '.[test]')")
        return 1
    print(f"\n-> {args.md}, {args.png}")
    return 0
