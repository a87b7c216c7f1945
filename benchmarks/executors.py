"""Executors on realistic-size training steps: wall-clock step times, first step, compiles,
and the cost model's calibration against the compiled groups' measured CPU time.

Modes, in one process: plain CPU eager (`cpu`), CPU `torch.compile` (`cpu-compile`), and
adaptive eager on neuron with each executor (`interpreter`, `inductor`, `auto`).
Steady-state step times are measured interleaved (round-robin over the modes, each round a
few steps per mode after one untimed step), and the median is reported.

Full run (minutes: Inductor compiles every group; see the README, "Executors"):

    rm -rf /tmp/ae-exec-cache
    TORCH_NEURONX_NEFF_CACHE_DIR=/tmp/ae-exec-cache python benchmarks/executors.py --out R.json
    # warm cache, new process: time to first step and compiles with nothing to compile
    TORCH_NEURONX_NEFF_CACHE_DIR=/tmp/ae-exec-cache python benchmarks/executors.py \
        --modes inductor --rounds 0 --out R-warm.json

The CI smoke run (tests/test_executors.py) runs this module at a tiny size.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

if __name__ == "__main__":  # the Inductor caches go with ours, before torch is imported
    _d = os.environ.setdefault("TORCH_NEURONX_NEFF_CACHE_DIR", "/tmp/ae-exec-cache")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_d, "inductor"))
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn as nn
import torch.nn.functional as F

import adaptive_eager as ae
from adaptive_eager.tools.models import GPT

MODES = ("cpu", "cpu-compile", "interpreter", "inductor", "auto")


# -- workloads: each maker returns a step (forward, loss, backward, AdamW) --------------
class MLPBlock(nn.Module):
    """Pre-norm MLP block: x + fc2(gelu(fc1(ln(x))))."""

    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def _step(model, x, y, loss_fn):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    def step():
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def mlp_train(device, d=512, tokens=1024):
    """2 pre-norm MLP blocks, d model, `tokens` tokens, MSE loss, AdamW."""
    torch.manual_seed(0)
    model = nn.Sequential(MLPBlock(d), MLPBlock(d)).to(device)
    x, y = torch.randn(tokens, d).to(device), torch.randn(tokens, d).to(device)
    return _step(model, x, y, F.mse_loss)


def gpt_train(device, d=256, seq=128, batch=8, vocab=512, layers=2):
    """GPT decoder (pre-LN blocks, causal attention), next-token cross entropy, AdamW."""
    torch.manual_seed(0)
    model = GPT(vocab=vocab, d=d, heads=4, layers=layers, seq=seq).to(device)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    y = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    return _step(model, x, y, lambda out, t: F.cross_entropy(out.reshape(-1, vocab),
                                                             t.reshape(-1)))


WORKLOADS = {"mlp_train": mlp_train, "gpt_train": gpt_train}
TINY = {"mlp_train": {"d": 32, "tokens": 16},
        "gpt_train": {"d": 32, "seq": 8, "batch": 2, "vocab": 16, "layers": 1}}


# -- modes ------------------------------------------------------------------------------
@contextlib.contextmanager
def scope(mode):
    if mode.startswith("cpu"):
        yield "cpu"
        return
    with ae.override(executor=mode):
        ae.set_adaptive(True)
        try:
            yield "neuron"
        finally:
            ae.set_adaptive(False)


def make(mode, workload, size):
    with scope(mode) as device:
        step = WORKLOADS[workload](device, **size)
    if mode == "cpu-compile":
        step = torch.compile(step)
    return step


def run_step(mode, step) -> float:
    """Wall time of one step, ended at a sync (the loss read back, as a training loop)."""
    with scope(mode):
        t0 = time.perf_counter()
        step().item()
        return time.perf_counter() - t0


def _executor_figures() -> dict:
    m = ae.metrics()
    return {"compiled_groups": m.compiled_groups, "inductor_cache_hits": m.inductor_cache_hits,
            "inductor_compile_s": round(m.inductor_compile_s, 2),
            "compiled_launches": m.compiled_launches,
            "interpreted_launches": m.interpreted_launches, "tier_ups": m.tier_ups,
            "compile_failures": m.compile_failures}


def first_steps(mode, step, n) -> dict:
    """Time to first step (includes every compile it waits for), then the next steps."""
    if not mode.startswith("cpu"):
        with scope(mode):
            ae.reset_metrics()
    times = [run_step(mode, step) for _ in range(n)]
    out = {"first_step_s": round(times[0], 3), "next_steps_s": [round(t, 4) for t in times[1:]]}
    if mode == "cpu-compile":
        from torch._dynamo.utils import counters
        out["dynamo_graphs"] = counters["stats"]["unique_graphs"]
    elif not mode.startswith("cpu"):
        with scope(mode):
            if mode == "auto":
                t0 = time.perf_counter()
                ae.wait_for_compiles()
                out["auto_wait_for_compiles_s"] = round(time.perf_counter() - t0, 2)
            out.update(_executor_figures())
    return out


def steady(modes, steps, rounds, per_round) -> dict:
    """Interleaved steady state: per mode, the median step time over all timed steps."""
    times = {m: [] for m in modes}
    for _ in range(rounds):
        for m in modes:
            run_step(m, steps[m])  # after a mode switch the engine rebuilds its plans
            times[m] += [run_step(m, steps[m]) for _ in range(per_round)]
    return {m: {"median_s": statistics.median(t), "min_s": min(t), "n": len(t)}
            for m, t in times.items() if t}


def calibrate(mode, step, repeats=3) -> list[dict]:
    """Per launch of a step: simulated device time beside the measured wall time of the
    launch's work on CPU (the best of `repeats` steps), marked compiled or not."""
    eng = ae.engine.engine.ENGINE
    rows: list[list] = []
    with scope(mode):
        dev = eng.device
        spec, submit = dev.spec, dev.submit

        def timed_submit(launch):
            run = launch.run
            if run is not None and launch.kind == "launch":
                def timed():
                    t0 = time.perf_counter()
                    try:
                        run()
                    finally:
                        rows[-1].append((launch.name, spec.launch_us(
                            launch.nbytes, launch.flops, launch.low_precision),
                            (time.perf_counter() - t0) * 1e6,
                            getattr(run, "compiled", False), launch.nbytes, launch.flops))
                launch.run = timed
            return submit(launch)
        dev.submit = timed_submit
        try:
            for _ in range(repeats):
                rows.append([])
                step().item()
        finally:
            del dev.submit
    best = []
    for per_launch in zip(*rows):
        name, sim, _, compiled, nbytes, flops = per_launch[0]
        best.append({"name": name, "simulated_us": round(sim, 2),
                     "wall_us": round(min(r[2] for r in per_launch), 1),
                     "compiled": compiled, "bytes": nbytes, "flops": flops})
    return best


def _ranks(v) -> list[float]:
    order = sorted(range(len(v)), key=v.__getitem__)
    r = [0.0] * len(v)
    i = 0
    while i < len(v):  # ties share their mean rank
        j = i
        while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2
        i = j + 1
    return r


def spearman(xs, ys) -> float:
    """Spearman's rank correlation: Pearson's r of the ranks."""
    a, b = _ranks(xs), _ranks(ys)
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    var = (sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b)) ** 0.5
    return cov / var if var else float("nan")


def run(workload, size, modes, rounds, per_round, first_n, do_calibrate=True) -> dict:
    steps, firsts = {}, {}
    for m in modes:  # cold start per mode: builds, compiles
        steps[m] = make(m, workload, size)
        firsts[m] = first_steps(m, steps[m], first_n)
        print(f"  {workload} {m}: first step {firsts[m]['first_step_s']} s", flush=True)
    res = {"workload": workload, "size": size, "first": firsts,
           "steady": steady(modes, steps, rounds, per_round) if rounds else {}}
    if do_calibrate and "inductor" in modes:
        rows = calibrate("inductor", steps["inductor"])
        if "interpreter" in modes:  # the same launches (same plan), run interpreted
            interp = calibrate("interpreter", steps["interpreter"])
            if [r["name"] for r in interp] == [r["name"] for r in rows]:
                for r, i in zip(rows, interp):
                    r["interpreted_wall_us"] = i["wall_us"]
        comp = [r for r in rows if r["compiled"]]
        res["calibration"] = rows
        if len(comp) >= 3:
            res["spearman_compiled"] = spearman([r["simulated_us"] for r in comp],
                                                [r["wall_us"] for r in comp])
    return res


def table(results) -> str:
    lines = ["| workload | mode | steady step (median) | vs cpu eager | vs cpu compile | "
             "first step | compiled groups (Inductor cache hits) | Inductor compile (wall) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        st, fi = r["steady"], r["first"]
        for m, f in fi.items():
            s = st.get(m, {}).get("median_s")
            rel = lambda k: f"{s / st[k]['median_s']:.2f}x" if s and k in st else "-"  # noqa
            groups = (f"{f['compiled_groups']} ({f['inductor_cache_hits']})"
                      if "compiled_groups" in f else f"{f.get('dynamo_graphs', '-')} graphs"
                      if m == "cpu-compile" else "-")
            comp = f"{f['inductor_compile_s']} s" if "inductor_compile_s" in f else "-"
            lines.append(f"| {r['workload']} | {m} | "
                         f"{(s * 1e3):.1f} ms | {rel('cpu')} | {rel('cpu-compile')} | "
                         f"{f['first_step_s']:.2f} s | {groups} | {comp} |" if s else
                         f"| {r['workload']} | {m} | - | - | - | {f['first_step_s']:.2f} s | "
                         f"{groups} | {comp} |")
    return "\n".join(lines)


def plot(results, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for r, mk in zip(results, "os^"):
        comp = [c for c in r.get("calibration", []) if c["compiled"]]
        if comp:
            ax.scatter([c["simulated_us"] for c in comp], [c["wall_us"] for c in comp],
                       marker=mk, label=f"{r['workload']} (Spearman "
                                        f"{r.get('spearman_compiled', float('nan')):.2f})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("simulated device time per launch (us, cost model)")
    ax.set_ylabel("measured CPU wall time, Inductor-compiled group (us)")
    ax.set_title("Cost model vs compiled groups on CPU (one point per group)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--per-round", type=int, default=3)
    p.add_argument("--first", type=int, default=6, help="steps timed from a cold start")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (CI smoke run)")
    p.add_argument("--out", help="write the results as JSON")
    p.add_argument("--plot", help="write the calibration plot (PNG)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads for every mode, set "
                   "before anything compiles (a shared machine: fewer threads, less noise)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    results = []
    for w in a.workloads:
        size = TINY[w] if a.tiny else {}
        results.append(run(w, size, a.modes, a.rounds, a.per_round, a.first))
    print(table(results))
    for r in results:
        if "spearman_compiled" in r:
            print(f"{r['workload']}: Spearman rank correlation, simulated vs measured, "
                  f"compiled groups: {r['spearman_compiled']:.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    if a.plot:
        plot(results, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
