"""Pattern substitution (Note [Substitution] in fusion/substitute.py) on the suite's GPT step
and a LLaMA-style step (tools.models.GPT, tools.models.Llama: hand-written attention, LLaMA's
RMSNorm written out), with ADAPTIVE_EAGER_SUBSTITUTE off and on, in adaptive (graph) mode:
launches, simulated device time and modeled HBM bytes per step, after one warm-up step.

    python benchmarks/substitution.py        # writes benchmarks/substitution.md

Inference: a no_grad forward and .item(). Training: forward, cross-entropy, backward (no
optimizer); in the purely lazy policy the forward and backward are one flush, and attention's
forward and backward become flash_attention_fwd and _bwd. Policy: the default idle threshold
(15) and purely lazy (0). Figures are the simulated device's (deterministic); no wall clock
is reported.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

import adaptive_eager as ae
from adaptive_eager.tools.models import GPT, Llama, batches

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = {"GPT": GPT, "LLaMA": Llama}


def step_metrics(model: str, seq: int, train: bool, substitute: bool, threshold: int = 15):
    """(loss or output sum, launches, device us, HBM bytes, substitutions) of one step."""
    torch.manual_seed(0)
    m = MODELS[model](seq=seq).to("neuron")
    x, y = batches("gpt", 1, seq=seq)[0]
    x, y = x.to("neuron"), y.to("neuron")

    def step():
        if train:
            out = m(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            loss.backward()
            for p in m.parameters():
                p.grad = None
            return loss.item()
        with torch.no_grad():
            return m(x).sum().item()
    with ae.override(substitute=substitute, queue_low_threshold=threshold), \
            ae.adaptive(strategy="graph"):
        step()
        ae.reset_metrics()
        value = step()
        s = ae.metrics()
    return value, s.launches, s.device_time_us, s.hbm_bytes, dict(s.substitutions)


def rows(seqs=(16, 256, 1024), thresholds=(15, 0)):
    out = []
    for model in MODELS:
        for seq in seqs:
            for train in (False, True):
                for th in thresholds:
                    off = step_metrics(model, seq, train, False, th)
                    on = step_metrics(model, seq, train, True, th)
                    out.append({"model": model, "seq": seq,
                                "pass": "training" if train else "inference",
                                "threshold": th, "off": off, "on": on})
    return out


def table(rs) -> str:
    lines = ["| model | seq | pass | idle threshold | launches off → on | device µs off → on "
             "| ratio | HBM MB off → on | substituted | \\|Δ value\\| |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        off, on = r["off"], r["on"]
        subs = ", ".join(f"{k.split('::')[1].removesuffix('_fwd')}×{v}"
                         for k, v in sorted(on[4].items())) or "-"
        lines.append(f"| {r['model']} | {r['seq']} | {r['pass']} | {r['threshold']} | "
                     f"{off[1]} → {on[1]} | {off[2]:.1f} → {on[2]:.1f} | "
                     f"{on[2] / off[2]:.3f} | {off[3] / 1e6:.2f} → {on[3] / 1e6:.2f} | {subs} | "
                     f"{abs(on[0] - off[0]):.2g} |")
    return "\n".join(lines)


if __name__ == "__main__":
    rs = rows()
    text = ("# Pattern substitution on the GPT and LLaMA-style steps\n\n"
            "`python benchmarks/substitution.py` (one run; simulated device figures). "
            "`ADAPTIVE_EAGER_SUBSTITUTE` off → on, adaptive `graph` mode, one step after a "
            "warm-up. GPT: `tools.models.GPT` (d=32, 4 heads, 2 layers, hand-written "
            "attention with an additive causal mask, LayerNorm); LLaMA: `tools.models.Llama` "
            "(d=32, 4 heads, 2 layers, LlamaRMSNorm written out, Transformers' eager "
            "attention, SwiGLU). |Δ value|: the step's loss (training) or output sum "
            "(inference), on against off. Training: attention's forward and its backward "
            "are replaced together (flash_attention_fwd+bwd) when both are in one flush, "
            "which is the purely lazy policy (idle threshold 0); at the default threshold "
            "the forward is flushed before the backward while autograd keeps the softmax "
            "output, so nothing is replaced (Note [Substitution]). RMSNorm's backward is "
            "not matched.\n\n" + table(rs) + "\n")
    with open(os.path.join(HERE, "substitution.md"), "w") as f:
        f.write(text)
    print(text)
