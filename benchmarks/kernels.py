"""The kernel library (adaptive_eager.kernels) against the ATen ops each kernel replaces:
launches, simulated device time and modeled HBM bytes per call, in eager and adaptive (graph)
mode, in one run. Attention over sequence 128..8192 (forward; forward + backward to 2048),
RMSNorm and the MoE MLP at a few sizes.

    python benchmarks/kernels.py            # writes benchmarks/kernels.md and kernels.png

Figures are the simulated device's (deterministic); no wall clock is reported.
"""
from __future__ import annotations

import os
import sys

import torch

import adaptive_eager as ae
from adaptive_eager import kernels as K

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("eager", "adaptive")


def measure(fn, inputs, mode: str, backward: bool = False) -> dict:
    """One call of `fn(*inputs)` (neuron tensors, made before: their copies are not counted)
    after one warm-up call (compiles, plans): launches, device time, HBM bytes of the
    measured call (and of the backward, with `backward`)."""
    def once():
        for t in inputs:
            t.grad = None
        out = fn(*inputs)
        if backward:
            out.sum().backward()
        ae.synchronize()
    with ae.adaptive(strategy="graph") if mode == "adaptive" else ae.override():
        once()
        ae.reset_metrics()
        once()
        m = ae.metrics()
    return {"launches": m.launches, "device_us": m.device_time_us, "hbm_bytes": m.hbm_bytes,
            "kernel_launches": m.kernel_launches, "fallbacks": sum(m.cpu_fallbacks.values())}


def _inputs(shapes, grad, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * sc).to("neuron").requires_grad_(grad)
            for s, sc in shapes]


def _rows(kernel, size, impls, shapes, backward_too=True, **kw):
    rows = []
    for bwd in (False, True) if backward_too else (False,):
        ins = _inputs(shapes, bwd)
        for impl, f in impls:
            for mode in MODES:
                rows.append({"kernel": kernel, "size": size, "pass": "fwd+bwd" if bwd
                             else "fwd", "impl": impl, "mode": mode,
                             **measure(lambda *a: f(*a, **kw), ins, mode, bwd)})
        del ins
    return rows


def attention_rows(seqs=(128, 256, 512, 1024, 2048, 4096, 8192), heads=1, d=64,
                   backward_max=2048) -> list[dict]:
    rows = []
    for s in seqs:
        rows += _rows("attention", s, (("aten", K.attention_reference),
                                       ("kernel", K.flash_attention)),
                      [((1, heads, s, d), 1.0)] * 3, backward_too=s <= backward_max)
    return rows


def rms_rows(sizes=((512, 1024), (2048, 4096))) -> list[dict]:
    rows = []
    for r, n in sizes:
        rows += _rows("rms_norm", f"{r}x{n}", (("aten", K.rms_norm_reference),
                                                ("kernel", K.rms_norm)),
                      [((r, n), 1.0), ((n,), 1.0)])
    return rows


def moe_rows(sizes=((256, 256, 512, 8), (1024, 512, 1024, 8))) -> list[dict]:
    rows = []
    for t, d, f, e in sizes:
        rows += _rows("moe_mlp", f"T{t} d{d} f{f} E{e} k2", (("aten", K.moe_reference),
                                                              ("kernel", K.moe_mlp)),
                      [((t, d), 1.0), ((t, e), 1.0), ((e, f, d), 0.05), ((e, f, d), 0.05),
                       ((e, d, f), 0.05)], top_k=2)
    return rows


def table(rows) -> str:
    """One line per (kernel, size, pass, mode): ATen vs kernel, and their ratios."""
    out = ["| kernel | size | pass | mode | ATen launches | kernel launches | ATen device "
           "µs | kernel device µs | time ratio | ATen HBM MB | kernel HBM MB | HBM ratio |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    key = lambda r: (r["kernel"], str(r["size"]), r["pass"], r["mode"])  # noqa: E731
    by = {}
    for r in rows:
        by.setdefault(key(r), {})[r["impl"]] = r
    for (kern, size, p, mode), d in by.items():
        a, k = d["aten"], d["kernel"]
        out.append(f"| {kern} | {size} | {p} | {mode} | {a['launches']} | {k['launches']} | "
                   f"{a['device_us']:.1f} | {k['device_us']:.1f} | "
                   f"{k['device_us'] / a['device_us']:.3f} | {a['hbm_bytes'] / 1e6:.2f} | "
                   f"{k['hbm_bytes'] / 1e6:.2f} | {k['hbm_bytes'] / a['hbm_bytes']:.4f} |")
    return "\n".join(out)


def plot(rows, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for impl, mode, style in (("aten", "eager", "o-"), ("aten", "adaptive", "s-"),
                              ("kernel", "eager", "^-"), ("kernel", "adaptive", "v--")):
        sel = [r for r in rows if r["kernel"] == "attention" and r["pass"] == "fwd"
               and r["impl"] == impl and r["mode"] == mode]
        xs = [r["size"] for r in sel]
        label = f"{'ATen ops' if impl == 'aten' else 'flash_attention'} ({mode})"
        axes[0].plot(xs, [r["device_us"] for r in sel], style, label=label)
        axes[1].plot(xs, [r["hbm_bytes"] / 1e6 for r in sel], style, label=label)
    for ax, title in zip(axes, ("device time per call (µs, simulated)",
                                "HBM bytes per call (MB, modeled)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (1 head, d=64, forward)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    rows = attention_rows() + rms_rows() + moe_rows()
    md = ["# Kernel library vs the ATen ops it replaces", "",
          "`python benchmarks/kernels.py` (simulated device figures, one call after a warm-up "
          "call; adaptive = graph strategy). Ratios are kernel / ATen: below 1, the kernel "
          "is cheaper.", "", table(rows), ""]
    fallbacks = sum(r["fallbacks"] for r in rows)
    md += [f"CPU fallbacks over all rows: {fallbacks}.", "",
           "How to read it: the ATen attention is `matmul, mul, softmax, matmul` "
           "(`K.attention_reference`, no mask); the MoE reference (`K.moe_reference`) is "
           "dense over experts (every expert computes every token, weighted by a routing "
           "matrix that is zero off the top-k: no data-dependent shapes), so its FLOPs and "
           "bytes exceed a routed loop's; a kernel is a launch of its own in adaptive mode "
           "(a fusion boundary), so where adaptive fusion already keeps a pattern on chip "
           "(attention up to ~1k, RMSNorm of small rows) the kernel saves nothing forward "
           "and its boundaries cost launches in forward + backward. Plot: kernels.png."]
    with open(os.path.join(HERE, "kernels.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    plot(rows, os.path.join(HERE, "kernels.png"))
    print("\n".join(md))


if __name__ == "__main__":
    sys.exit(main())
