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
import collections
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

MODES = ("cpu", "cpu-compile", "interpreter", "inductor", "auto", "ltc")
DEFAULT_MODES = MODES[:5]  # ltc (PyTorch's lazy tensors, TorchScript backend) on request
# What steady steps and the breakdown are timed with (--clock): `wall` (perf_counter), or
# `cpu` (process_time: this process's CPU time, all its threads; on a machine shared by
# other jobs it leaves out the time the process waits for a core)
CLOCK = [time.perf_counter]


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
    if mode == "ltc":
        from workloads import lazy_device
        yield lazy_device()
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


def timed_step(step) -> float:
    """The time of one step, ended at a sync (the loss read back, as a training loop)."""
    clock = CLOCK[0]
    t0 = clock()
    loss = step()
    if loss.device.type == "lazy":  # LTC: cut the trace and run its graph (mark_step)
        from workloads import ltc_sync
        ltc_sync()
    loss.item()
    return clock() - t0


def run_step(mode, step) -> float:
    """One step in its mode's scope. Entering the scope changes settings, so the engine
    flushes, reconfigures and forgets its replay traces (with another executor than the one
    before, its plans too): steady steps run inside one scope (`steady`)."""
    with scope(mode):
        return timed_step(step)


def _executor_figures() -> dict:
    m = ae.metrics()
    return {"compiled_groups": m.compiled_groups, "inductor_cache_hits": m.inductor_cache_hits,
            "inductor_compile_s": round(m.inductor_compile_s, 2),
            "compiled_launches": m.compiled_launches,
            "interpreted_launches": m.interpreted_launches, "tier_ups": m.tier_ups,
            "compile_failures": m.compile_failures}


def first_steps(mode, step, n) -> dict:
    """Time to first step (includes every compile it waits for), then the next steps."""
    if mode == "ltc":
        from workloads import ltc_counters
        times = [run_step(mode, step)]
        before = ltc_counters()
        times += [run_step(mode, step) for _ in range(n - 1)]
        after = ltc_counters()
        graphs = sum(after.get(k, 0) - before.get(k, 0) for k in ("CachedCompile",
                                                                  "UncachedCompile"))
        return {"first_step_s": round(times[0], 3),
                "next_steps_s": [round(t, 4) for t in times[1:]],
                "ltc_graphs_per_step": graphs / max(1, n - 1),
                "ltc_cpu_fallbacks": {k: v - before.get(k, 0) for k, v in after.items()
                                      if k.startswith("aten::") and v > before.get(k, 0)}}
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
    """Interleaved steady state: per mode, the median step time over all timed steps. Each
    round runs a mode's steps in one scope, after one untimed step (after a mode switch the
    engine rebuilds its plans and replay traces), as a training loop runs in one mode."""
    times = {m: [] for m in modes}
    for _ in range(rounds):
        for m in modes:
            with scope(m):
                timed_step(steps[m])
                times[m] += [timed_step(steps[m]) for _ in range(per_round)]
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


GEMMS = ("mm", "addmm", "bmm", "baddbmm")


@contextlib.contextmanager
def timed_gemms(acc, clock):
    """Inductor's extern GEMM calls (`extern_kernels.mm/addmm/bmm/baddbmm`, looked up at
    each call by the generated code) timed into acc["gemm"], counted in acc["gemm calls"]:
    CPU `torch.compile`'s code and the Inductor executor's make the same calls, so the step
    less its GEMMs compares what each adds around them (GEMMs are ~90% of the MLP step and
    move by several ms between modes of one run)."""
    from torch._inductor.select_algorithm import extern_kernels as ek
    saved = {n: getattr(ek, n) for n in GEMMS}

    def timed(fn):
        def gemm(*a, **k):
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                acc["gemm"] += clock() - t0
                acc["gemm calls"] += 1
        return gemm
    for n, f in saved.items():
        setattr(ek, n, timed(f))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(ek, n, f)


def _compile_breakdown(step, repeats) -> dict:
    """`breakdown` of CPU `torch.compile`'s step: the step and its GEMMs only."""
    acc, rows = collections.Counter(), []
    timed_step(step)
    with timed_gemms(acc, CLOCK[0]):
        for _ in range(repeats):
            acc.clear()
            total = timed_step(step)
            rows.append({"step": total, "gemm": acc["gemm"], "gemm calls": acc["gemm calls"]})
    return {k: statistics.median(r[k] for r in rows) * (1 if k == "gemm calls" else 1e3)
            for k in rows[0]}


def breakdown(mode, step, repeats=3, rescope=False) -> dict:
    """Where one steady step's wall time goes (ms per step, the median of `repeats` steps):
    `compiled` (TorchInductor's code), `copies` (its inputs and outputs at the group's edges:
    `FxGroup.args` and `store`), `fused interpreted` (groups of 2+ ops the interpreter runs),
    `single ops` (one-op launches), `flush` (planning and launch bookkeeping: the flushes'
    time less their launches'), and `host` (the rest: dispatch, queueing, autograd, the
    optimizer's Python), of which `dispatch` is the per-op host path (the neuron tensor's
    `__torch_dispatch__`, outermost calls, less the flushes run inside it; `ops
    dispatched` counts them). `gemm`: of `compiled`, Inductor's extern GEMM calls
    (`timed_gemms`; for `cpu-compile`, only `step` and `gemm` are measured). Timers wrap the
    engine's flush, the device's submit, the FX group's copies, the GEMMs and the dispatch, so
    the figures carry a little of their own overhead (about 1 us per op dispatched). `rescope`: every
    timed step enters the mode's scope anew (how steady steps were measured before: the
    engine then forgets its replay traces, and with the Inductor executor its plans, at
    every step)."""
    if mode == "cpu-compile":
        return _compile_breakdown(step, repeats)
    from fusion.executors.fx import FxGroup
    from adaptive_eager.engine.tensor import NeuronTensor
    eng = ae.engine.engine.ENGINE
    acc = collections.Counter()
    clock = CLOCK[0]
    depth = [0]

    def timed_dispatch(fn):
        """The per-op host path: __torch_dispatch__ calls, outermost only, less the flushes
        they run (a device-idle flush inside an op)."""
        def dispatch(cls, func, types, args=(), kwargs=None):
            if depth[0]:
                return fn(cls, func, types, args, kwargs)
            depth[0] += 1
            f0, t0 = acc["flush"], clock()
            try:
                return fn(cls, func, types, args, kwargs)
            finally:
                acc["dispatch"] += clock() - t0 - (acc["flush"] - f0)
                acc["ops dispatched"] += 1
                depth[0] -= 1
        return classmethod(dispatch)

    def timed(key, fn):
        def wrapper(*a, **k):
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                acc[key] += clock() - t0
        return wrapper

    rows = []
    with scope(mode):
        timed_step(step)  # after the switch: plans rebuilt, untimed
    # rescope: as run_step, each timed step enters the scope from outside it
    with scope(mode) if not rescope else contextlib.nullcontext():
        if not rescope:
            timed_step(step)
        dev = eng.device
        submit, flush = dev.submit, eng.flush
        args, store = FxGroup.args, FxGroup.store

        def timed_submit(launch):
            run = launch.run
            if run is not None and launch.kind in ("launch", "kernel"):
                ops = len(launch.nodes[1]) if launch.nodes else 1
                key = ("compiled" if getattr(run, "compiled", False) else
                       "fused interpreted" if ops > 1 else "single ops")
                acc[key + " launches"] += 1
                launch.run = timed(key, run)
            return timed("submit", submit)(launch)
        dev.submit, eng.flush = timed_submit, timed("flush", flush)
        FxGroup.args, FxGroup.store = timed("copies", args), timed("copies", store)
        td = NeuronTensor.__dict__["__torch_dispatch__"]
        NeuronTensor.__torch_dispatch__ = timed_dispatch(td.__func__)
        try:
            for _ in range(repeats):
                acc.clear()
                with scope(mode) if rescope else contextlib.nullcontext(), \
                        timed_gemms(acc, clock):
                    total = timed_step(step)
                a = dict(acc)
                runs = sum(a.get(k, 0.0) for k in ("compiled", "fused interpreted",
                                                     "single ops"))
                rows.append({
                    "step": total,
                    "compiled": a.get("compiled", 0.0) - a.get("copies", 0.0),
                    "copies": a.get("copies", 0.0),
                    "fused interpreted": a.get("fused interpreted", 0.0),
                    "single ops": a.get("single ops", 0.0),
                    "flush": a.get("flush", 0.0) - runs,
                    "host": total - a.get("flush", 0.0),
                    "dispatch": a.get("dispatch", 0.0),
                    "gemm": a.get("gemm", 0.0),
                    **{k: v for k, v in a.items()
                       if k.endswith(("launches", "calls")) or k == "ops dispatched"}})
        finally:
            del dev.submit, eng.flush
            FxGroup.args, FxGroup.store = args, store
            NeuronTensor.__torch_dispatch__ = td
    keys = rows[0].keys() | {k for r in rows for k in r}
    return {k: (statistics.median(r.get(k, 0) for r in rows) * (
        1 if k.endswith(("launches", "calls")) or k == "ops dispatched" else 1e3))
        for k in keys}


def optimizer_step(modes, d=512, tokens=1024, steps=12, warm=3) -> dict:
    """AdamW's step alone on the MLP workload's parameters (ms per step, the median after
    `warm` steps; the backward before it synced and untimed): the 8 foreach ops that CPU
    `torch.compile` fuses into one loop (Note [Elementwise groups stream], Note [Scalars as
    graph inputs] in fusion/executors/fx.py). `cpu-compile` compiles `opt.step`."""
    out = {}
    clock = CLOCK[0]
    for mode in modes:
        if mode == "ltc":
            continue
        with scope(mode) as device:
            torch.manual_seed(0)
            model = nn.Sequential(MLPBlock(d), MLPBlock(d)).to(device)
            x = torch.randn(tokens, d).to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
            step = torch.compile(opt.step) if mode == "cpu-compile" else opt.step
            sync = torch.neuron.synchronize if device == "neuron" else (lambda: None)
            times = []
            for _ in range(steps):
                model(x).square().mean().backward()
                sync()
                t0 = clock()
                step()
                sync()
                times.append(clock() - t0)
                opt.zero_grad()
            out[mode] = statistics.median(times[warm:]) * 1e3
    return out


BREAKDOWN_KEYS = ("compiled", "copies", "fused interpreted", "single ops", "flush", "host",
                  "dispatch")
_HEADS = {"dispatch": "host: of it, dispatch"}


def breakdown_table(results) -> str:
    lines = ["| workload | mode | step (ms) | GEMM (Inductor's extern calls) | step - GEMM | " +
             " | ".join(_HEADS.get(k, k) for k in BREAKDOWN_KEYS) +
             " | ops dispatched | launches (compiled/fused interp./single) |",
             "|---|---|---|---|---|" + "---|" * len(BREAKDOWN_KEYS) + "---|---|"]
    for r in results:
        for m, b in r.get("breakdown", {}).items():
            if m == "cpu-compile":  # its step and GEMMs only (`_compile_breakdown`)
                rest = " | ".join("-" for _ in BREAKDOWN_KEYS) + " | - | - |"
            else:
                rest = (" | ".join(f"{b.get(k, 0):.1f}" for k in BREAKDOWN_KEYS) +
                        f" | {b.get('ops dispatched', 0):.0f}"
                        f" | {b.get('compiled launches', 0):.0f}/"
                        f"{b.get('fused interpreted launches', 0):.0f}/"
                        f"{b.get('single ops launches', 0):.0f} |")
            lines.append(f"| {r['workload']} | {m} | {b['step']:.1f} | {b.get('gemm', 0):.1f} | "
                         f"{b['step'] - b.get('gemm', 0):.1f} | " + rest)
    return "\n".join(lines)


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


def run(workload, size, modes, rounds, per_round, first_n, do_calibrate=True,
        do_breakdown=True) -> dict:
    steps, firsts, failed = {}, {}, {}
    for m in modes:  # cold start per mode: builds, compiles
        steps[m] = make(m, workload, size)
        try:
            firsts[m] = first_steps(m, steps[m], first_n)
        except RuntimeError as e:
            if m != "ltc":
                raise
            # (gpt_train: LTC's matmul of the attention's transposed views returns a CPU
            # tensor, which the next op refuses: "Input tensor is not a lazy tensor")
            failed[m] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            print(f"  {workload} {m}: cannot run: {failed[m]}", flush=True)
            continue
        print(f"  {workload} {m}: first step {firsts[m]['first_step_s']} s", flush=True)
    modes = [m for m in modes if m not in failed]
    res = {"workload": workload, "size": size, "first": firsts, "failed": failed,
           "steady": steady(modes, steps, rounds, per_round) if rounds else {}}
    if do_breakdown:
        ours = [m for m in modes if m not in ("cpu", "cpu-compile", "ltc")]
        res["breakdown"] = {m: breakdown(m, steps[m]) for m in ours + [
            m for m in modes if m == "cpu-compile"]}
        if do_breakdown == "rescope":  # how the steady steps were measured before
            res["breakdown"].update({f"{m}, scope per step": breakdown(m, steps[m], rescope=True)
                                     for m in ours})
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
                      if m == "cpu-compile" else
                      f"{f['ltc_graphs_per_step']:g} LTC graphs/step" if m == "ltc" else "-")
            comp = f"{f['inductor_compile_s']} s" if "inductor_compile_s" in f else "-"
            lines.append(f"| {r['workload']} | {m} | "
                         f"{(s * 1e3):.1f} ms | {rel('cpu')} | {rel('cpu-compile')} | "
                         f"{f['first_step_s']:.2f} s | {groups} | {comp} |" if s else
                         f"| {r['workload']} | {m} | - | - | - | {f['first_step_s']:.2f} s | "
                         f"{groups} | {comp} |")
        for m, why in r.get("failed", {}).items():
            lines.append(f"| {r['workload']} | {m} | cannot run: {why} | | | | | |")
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
    p.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=MODES)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--per-round", type=int, default=3)
    p.add_argument("--first", type=int, default=6, help="steps timed from a cold start")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (CI smoke run)")
    p.add_argument("--out", help="write the results as JSON")
    p.add_argument("--plot", help="write the calibration plot (PNG)")
    p.add_argument("--no-calibrate", action="store_true", help="skip the calibration")
    p.add_argument("--no-breakdown", action="store_true", help="skip the time breakdown")
    p.add_argument("--rescope", action="store_true", help="also break down steps that each "
                   "enter their mode's scope anew (the method before the steady state ran "
                   "in one scope per round)")
    p.add_argument("--optimizer", action="store_true", help="also time AdamW's step alone "
                   "on the MLP's parameters, per mode")
    p.add_argument("--threads", type=int, help="torch.set_num_threads for every mode, set "
                   "before anything compiles (a shared machine: fewer threads, less noise)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time steady steps and the breakdown by wall clock (default) or by "
                   "the process's CPU time (a loaded machine)")
    a = p.parse_args(argv)
    CLOCK[0] = time.process_time if a.clock == "cpu" else time.perf_counter
    if a.threads:
        torch.set_num_threads(a.threads)
    results = []
    for w in a.workloads:
        size = TINY[w] if a.tiny else {}
        results.append(run(w, size, a.modes, a.rounds, a.per_round, a.first,
                           not a.no_calibrate,
                           not a.no_breakdown and ("rescope" if a.rescope else True)))
    print(table(results))
    if a.optimizer:
        opt = optimizer_step(a.modes, **({"d": 32, "tokens": 16, "steps": 4, "warm": 1}
                                         if a.tiny else {}))
        print("\nAdamW's step alone, MLP parameters (ms, median): " +
              ", ".join(f"{m} {t:.2f}" for m, t in opt.items()))
        results.append({"workload": "adamw_step", "optimizer_ms": opt})
    if not a.no_breakdown:
        print("\nWhere a steady step's time goes (ms, median of 3 steps):")
        print(breakdown_table(results))
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
