"""`python -m adaptive_eager report BENCH.json [--md FILE] [--png FILE]`: a pytest-benchmark
run saved with --benchmark-json, of tests using the `neuron_benchmark` fixture (a user's, or
benchmarks/ of this project) -> one table comparing the modes of each test: launches and
simulated device time per step, compiles, host time per op and wall time, each with its ratio
to the run's first mode that has the figure (eager in the default run); and a chart of
launches and device time per mode (--png, needs matplotlib)."""
from __future__ import annotations

import argparse
import collections
import json


def load(path: str) -> dict:
    """{test (pytest-benchmark's group): {mode: extra_info + the fastest round's wall time
    (us)}}, in the run's order."""
    with open(path) as f:
        data = json.load(f)
    out: dict = collections.defaultdict(dict)
    for b in data["benchmarks"]:
        e = dict(b["extra_info"])
        if "host_us_per_op" not in e:  # not neuron_benchmark's (tiny chain: host_table)
            continue
        e["wall_us"] = b["stats"]["min"] * 1e6  # as timeit: noise only ever adds time
        # a run saved before the fixture named the workload in extra_info
        out[e.get("workload") or b.get("group") or b["name"]][e["mode"]] = e
    return dict(out)


def modes(res: dict) -> list:
    """The run's modes in the order they ran."""
    return list(dict.fromkeys(m for per_mode in res.values() for m in per_mode))


def _ratio(a, b) -> str:
    if a is None or not b:
        return ""
    return f"{a / b:.2f}x" if a / b >= 0.1 else f"{a / b:.2g}x"


def _num(v, fmt: str) -> str:
    return "" if v is None else format(v, fmt)


def _kib(v) -> str:
    return "" if v is None else f"{v / 1024:.1f}"


def markdown(res: dict) -> str:
    order = modes(res)
    # launches and device time are the neuron modes' (ltc, PyTorch's lazy tensors in
    # benchmarks/, counts its graph executions as launches and has no device time)
    neuron = [m for m in order if m not in ("cpu", "ltc")]
    ref = neuron[0] if neuron else None
    wref = order[0] if order else None
    head = ["test", "mode", "launches/step", f"vs {ref}", "mean group", "device us/step",
            f"vs {ref}", "compiles warm-up (ms modeled) / step", "host us/op"]
    cpu = "cpu" in order
    if cpu:
        head.append("vs cpu")
    head += ["HBM KiB/step", "saved KiB/step", "wall us/step (min)", f"vs {wref}", "first step ms"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for test, per_mode in res.items():
        r, w = per_mode.get(ref, {}), per_mode.get(wref, {})
        c = per_mode.get("cpu", {})
        for mode in order:
            e = per_mode.get(mode)
            if e is None:
                continue
            g = e.get
            label = mode
            if mode == "cpu" and "inductor_kernels" in e:
                label = f"cpu (inductor kernels: {e['inductor_kernels']})"
            compiles = ""
            if "warmup_compiles" in e:
                compiles = (f"{e['warmup_compiles']} ({e['warmup_compile_ms_modeled']:.0f}) / "
                            f"{e.get('compiles_per_step', 0):g}")
            cells = [test, label,
                     _num(g("launches_per_step"), ".1f"),
                     _ratio(g("launches_per_step"), r.get("launches_per_step")),
                     _num(g("mean_group_size"), ".1f"),
                     _num(g("device_us_per_step"), ".1f"),
                     _ratio(g("device_us_per_step"), r.get("device_us_per_step")),
                     compiles if mode != "cpu" else "",
                     _num(g("host_us_per_op"), ".1f")]
            if cpu:
                cells.append(_ratio(g("host_us_per_op"), c.get("host_us_per_op")))
            cells += [_kib(g("hbm_bytes_per_step")), _kib(g("bytes_saved_per_step")),
                      _num(e["wall_us"], ".0f"), _ratio(e["wall_us"], w.get("wall_us")),
                      _num(g("first_step_ms"), ".0f")]
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def host_table(path: str) -> str:
    """The tiny chain of benchmarks/test_host_overhead.py, if the run has it: host time per op
    against plain CPU torch and against the do-nothing dispatch floor (medians); then its
    slow-path programs, if the run has them, host time per op against CPU and the chain."""
    with open(path) as f:
        data = json.load(f)
    med = {b["extra_info"]["mode"]: (b["stats"]["median"], b["extra_info"]["ops_per_step"])
           for b in data["benchmarks"] if b.get("group") == "tiny_chain"}
    if "cpu" not in med or "floor" not in med:
        return ""
    cpu, floor = med["cpu"][0], med["floor"][0]
    rows = ["| tiny chain mode | ms/step | host us/op | vs CPU | vs floor |",
            "|---|---|---|---|---|"]
    for mode in _HOST_MODES:
        if mode in med:
            t, n = med[mode]
            rows.append(f"| {mode} | {t * 1e3:.2f} | {t / n * 1e6:.2f} | {t / cpu:.1f}x | "
                        f"{t / floor:.1f}x |")
    slow: dict = {}
    for b in data["benchmarks"]:
        if b.get("group", "").startswith("slow_path:"):
            e = b["extra_info"]
            slow.setdefault(e["program"], {})[e["mode"]] = b["stats"]["median"] / e["ops_per_step"]
    if slow:
        rows += ["", "| slow path: host us/op (vs CPU, vs the chain's) | "
                 + " | ".join(_SLOW_MODES) + " |", "|---" * (len(_SLOW_MODES) + 1) + "|"]
        for program, per in slow.items():
            cells = []
            for mode in _SLOW_MODES:
                if mode not in per or "cpu" not in per:
                    cells.append("")
                    continue
                t = per[mode] * 1e6
                chain = med[mode][0] / med[mode][1] * 1e6 if mode in med else None
                cells.append(f"{t:.1f} ({per[mode] / per['cpu']:.0f}x"
                             + (f", {t / chain:.1f}x" if chain else "") + ")")
            rows.append(f"| {program} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


# cpu, the dispatch floor's entry and the floor, PyTorch's lazy tensors, process-wide adaptive, scoped, eager
_HOST_MODES = ("cpu", "entry", "floor", "ltc", "graph", "scoped", "eager")
_SLOW_MODES = tuple(m for m in _HOST_MODES if m != "entry")  # (the entry runs the chain only)


def chart(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    order = [m for m in modes(res) if m != "cpu"]
    tests = list(res)
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(tests) + 4), 4.5))
    width = 0.8 / max(1, len(order))
    for ax, key, title in ((axes[0], "launches_per_step", "launches per step"),
                           (axes[1], "device_us_per_step", "simulated device time per step (us)")):
        for i, m in enumerate(order):
            vals = [res[t].get(m, {}).get(key, 0) for t in tests]
            ax.bar([x + i * width for x in range(len(tests))], vals, width, label=m)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(tests))])
        ax.set_xticklabels(tests, rotation=20, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m adaptive_eager report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="pytest-benchmark's JSON (pytest --benchmark-json=FILE)")
    p.add_argument("--md", help="also write the table (Markdown) to this file")
    p.add_argument("--png", help="also draw launches and device time per mode to this PNG")
    args = p.parse_args(argv)
    try:
        res = load(args.json)
        host = host_table(args.json)
    except (KeyError, TypeError, ValueError) as e:  # (json's errors are ValueErrors)
        p.error(f"{args.json} is not pytest-benchmark's JSON of tests using neuron_benchmark "
                f"({type(e).__name__}: {e}); make one with --benchmark-json=FILE")
    if not res and not host:
        p.error(f"{args.json} holds no benchmark of a test using neuron_benchmark (were "
                f"benchmarks disabled? pytest-benchmark saves none with --benchmark-disable)")
    table = markdown(res) if res else ""
    if host:
        table += ("\n\n" if table else "") + "Host time per op on an 800-op chain of tiny " \
                 "pointwise ops (floor: a do-nothing `__torch_dispatch__` subclass):\n\n" + host
    print(table)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table + "\n")
        print(f"\n-> {args.md}")
    if args.png and res:
        try:
            chart(res, args.png)
        except ImportError:
            print("no chart: matplotlib is missing (pip install 'adaptive-eager[bench]')")
            return 1
        print(f"-> {args.png}")
    return 0
