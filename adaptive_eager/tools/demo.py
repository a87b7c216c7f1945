"""`python -m adaptive_eager demo`: train a small GPT in eager and adaptive eager, compare."""
from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

import adaptive_eager as ae
from adaptive_eager.tools import steps as steady_state
from adaptive_eager.tools.models import GPT, batches


def run_mode(name: str, steps: int, strategy: str | None, seed: int = 0,
             compiled: bool = False, kernels: bool = False, seq: int | None = None) -> dict:
    """Train a fresh GPT for `steps` steps in one mode; per-step figures after warm-up.
    `compiled`: the model runs through torch.compile(backend="neuron") (the optimizer in
    adaptive `strategy` mode, set process-wide: Dynamo skips frames under dispatch modes).
    `kernels`: attention through the kernel library's flash_attention. `seq`: tokens per
    sequence (None: 16, in a model made for 32)."""
    torch.manual_seed(seed)
    model = GPT(vocab=64, d=64, heads=4, layers=2, seq=seq or 32, kernels=kernels).to("neuron")
    forward = torch.compile(model, backend="neuron") if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=True)
    data = [(x.to("neuron"), y.to("neuron")) for x, y in batches("gpt", steps, seed, seq=seq or 16)]
    losses, per_step = [], []
    steady_state.install()  # Note [Time to steady state]: from this mode's first step
    scope = ae.adaptive(strategy=strategy) if strategy else ae.adaptive(False)
    if compiled:
        scope = _process_wide(strategy)
    with scope:
        for x, y in tqdm(data, desc=f"{name:>16}", unit="step", leave=True):
            before = ae.metrics()
            t0 = time.perf_counter()
            logits = forward(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())  # a sync point, as a real loop's logging
            wall = time.perf_counter() - t0
            per_step.append((ae.metrics() - before, wall))
    warm = per_step[1:] or per_step  # step 0 pays the compiles
    total = ae.metrics()
    steady = steady_state.summary()
    steady_state.uninstall()
    return {
        "mode": name, "losses": losses,
        "launches": sum(m.launches for m, _ in warm) / len(warm),
        "device_ms": sum(m.device_time_us for m, _ in warm) / len(warm) / 1e3,
        "ops": sum(m.ops for m, _ in warm) / len(warm),
        "host_us_per_op": sum(w for _, w in warm) / max(sum(m.ops for m, _ in warm), 1) * 1e6,
        "compiles": sum(m.compiles for m, _ in per_step),
        "hits": sum(m.cache_memory_hits + m.cache_disk_hits for m, _ in per_step),
        "fallbacks": sum(sum(m.cpu_fallbacks.values()) for m, _ in per_step),
        "group": (sum(m.mean_group_size for m, _ in warm) / len(warm)),
        "hbm_mb": sum(m.hbm_bytes for m, _ in warm) / len(warm) / 1e6,
        "kernel_launches": sum(m.kernel_launches for m, _ in warm) / len(warm),
        "total": total, "steady": steady,
    }


@contextlib.contextmanager
def _process_wide(strategy):
    ae.set_adaptive(strategy is not None)
    old = ae.strategy()
    if strategy is not None:
        ae.set_strategy(strategy)
    try:
        yield
    finally:
        ae.set_adaptive(False)
        ae.set_strategy(old)


def table(rows: list[dict]) -> str:
    base = rows[0]
    head = ("mode", "ops/step", "launches/step", "mean group", "device ms/step", "speed-up",
            "compiles", "cache hits", "fallbacks", "host us/op")
    lines = [head]
    for r in rows:
        lines.append((r["mode"], f"{r['ops']:.0f}", f"{r['launches']:.0f}", f"{r['group']:.1f}",
                      f"{r['device_ms']:.3f}", f"{base['device_ms'] / r['device_ms']:.2f}x",
                      str(r["compiles"]), str(r["hits"]), str(r["fallbacks"]),
                      f"{r['host_us_per_op']:.0f}"))
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    out = [" | ".join(c.rjust(w) for c, w in zip(row, widths)) for row in lines]
    out.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(out)


def kernel_table(rows: list[dict]) -> str:
    """HBM bytes and kernel launches per step (the kernel library's rows beside the others)."""
    lines = [("mode", "HBM MB/step", "kernel launches/step", "device ms/step")]
    lines += [(r["mode"], f"{r['hbm_mb']:.2f}", f"{r['kernel_launches']:.0f}",
               f"{r['device_ms']:.3f}") for r in rows]
    widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
    out = [" | ".join(c.rjust(w) for c, w in zip(row, widths)) for row in lines]
    out.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m adaptive_eager demo", description=__doc__)
    p.add_argument("--steps", type=int, default=6, help="training steps per mode (default 6)")
    p.add_argument("--strategy", default="graph", choices=["graph", "matmul", "none", "all"],
                   help="adaptive fusion strategy to compare with eager ('all': each)")
    p.add_argument("--trace", metavar="PATH", help="write the device timeline (Perfetto JSON)")
    p.add_argument("--graph", metavar="PATH",
                   help="write the last flush's fused graph (.dot, or .svg/.png with Graphviz)")
    p.add_argument("--kernels", action="store_true",
                   help="also run the model with its attention through the kernel library's "
                        "flash_attention (ae.kernels), in eager and adaptive mode")
    p.add_argument("--seq", type=int, default=None,
                   help="tokens per sequence (default 16; try 512 with --kernels)")
    p.add_argument("--compile", action="store_true",
                   help="also run torch.compile(model, backend=\"neuron\") (its first step "
                        "pays Dynamo's capture)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    strategies = ["graph", "matmul"] if args.strategy == "all" else [args.strategy]
    if args.seq is not None and args.seq < 1:
        p.error(f"--seq must be at least 1, got {args.seq}")
    print(f"Training a 2-layer GPT (d=64, seq={args.seq or 32}, batch=4) for {args.steps} "
          f"steps per mode on the simulated NeuronCore.\n")
    rows = [run_mode("eager", args.steps, None, seq=args.seq)]
    for s in strategies:
        rows.append(run_mode(f"adaptive {s}", args.steps, s, seq=args.seq))
    if args.kernels:
        rows.append(run_mode("eager+kernels", args.steps, None, kernels=True, seq=args.seq))
        for s in strategies:
            rows.append(run_mode(f"adaptive {s}+kernels", args.steps, s, kernels=True,
                                 seq=args.seq))
    if args.compile:
        rows.append(run_mode("compile", args.steps, "graph", compiled=True, seq=args.seq))
    print()
    print(table(rows))
    if args.kernels:
        print()
        print(kernel_table(rows))
    same = all(r["losses"] == rows[0]["losses"] for r in rows
               if r["mode"] != "compile" and "kernels" not in r["mode"])
    close = all(torch.allclose(torch.tensor(r["losses"]), torch.tensor(rows[0]["losses"]),
                               rtol=1e-4, atol=1e-5) for r in rows)
    same = same and close
    verdict = "DIFFER between modes"
    if same:
        verdict = ("identical in every eager and adaptive mode" if args.compile or args.kernels
                   else "identical in every mode")
        inexact = [w for w, on in (("compile", args.compile), ("kernels", args.kernels)) if on]
        if inexact:
            verdict += f"; {' and '.join(inexact)} within float32 tolerance"
    print("\ntime to steady state (modeled: compiles, host overhead and device time):")
    for r in rows:
        print(f"  {r['mode']}: {steady_state.sentence(r['steady'])}")
    print(f"\nlosses: {', '.join(f'{v:.4f}' for v in rows[0]['losses'])} ({verdict})")
    print("launches, device time: simulated NeuronCore (see device/spec.py for the figures); "
          "host us/op: this machine's wall clock.")
    if args.graph:
        path = ae.explain().save(args.graph)
        print(f"fused graph of the last flush -> {path}")
    if args.trace:
        ae.save_trace(args.trace)
        print(f"device timeline -> {args.trace} (open in https://ui.perfetto.dev)")
    return 0 if same else 1
