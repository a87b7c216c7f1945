"""TorchTitan's composition on neuron: a LLaMA-style model under FSDP2 x tensor parallel on a
2x2 mesh (4 ranks over gloo), per rank and per mode, and a projection to more ranks.

    python benchmarks/fsdp_tp_llama.py [--steps 2] [--out benchmarks/fsdp_tp_results.md]

The mesh is ("dp", "tp") = (2, 2): each block's attention projections and MLP are split by
TP (wq, wk, wv, w1, w3 by columns; wo, w2 by rows: an all-reduce each way per pair), and
fully_shard shards every block and the root over "dp" (all-gathers, reduce-scatters). Each
dp rank trains on its half of the global batch. Figures per step, after two warm-up steps:
launches, collectives and their bytes, collective time and how much of it was exposed (Note
[Overlap] in adaptive_eager/integration/distributed.py), and the step time on the simulated
clock.

Projection (not a measurement): TP stays at 2 ranks (inside an instance), data parallelism
grows to p/2. Each collective of rank 0's step is re-costed by device/interconnect.py: the
all-reduces (TP's) as they are; the all-gathers and reduce-scatters (FSDP's, over "dp") at p/2
ranks on two levels, a dp group holding ranks_per_instance/2 ranks per instance (TP takes the
other half). Weak scaling; communication beyond the measured one is counted as exposed.
"""
from __future__ import annotations

import argparse
import dataclasses
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

MODES = ["eager", "graph"]
PROJECTED_RANKS = (4, 64, 512)
D, HEADS, LAYERS, VOCAB, SEQ, BATCH = 64, 4, 2, 128, 32, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.ffn_norm = nn.RMSNorm(D), nn.RMSNorm(D)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(D, 4 * D, bias=False), nn.Linear(D, 4 * D, bias=False)
        self.w2 = nn.Linear(4 * D, D, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q, k, v = (w(h).view(b, t, -1, D // HEADS).transpose(1, 2)  # local heads under TP
                   for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(D)
        self.out = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.out(self.norm(x))


def build(mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    torch.manual_seed(0)
    model = Llama().to("neuron")
    plan = {n: ColwiseParallel() for n in ("wq", "wk", "wv", "w1", "w3")}
    plan.update({n: RowwiseParallel() for n in ("wo", "w2")})
    for blk in model.blocks:
        parallelize_module(blk, mesh["tp"], plan)
        fully_shard(blk, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def _rank(rank, world, port, steps, host_us, results):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    import adaptive_eager as ae
    from adaptive_eager.engine import engine as _engine
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group(rank=rank, world_size=world)
    if host_us is not None:
        ae.set_device_spec(dataclasses.replace(ae.DeviceSpec(), host_op_overhead_us=host_us))
    mesh = init_device_mesh("neuron", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)[dp * BATCH // 2:(dp + 1) * BATCH // 2]
    out = {}
    for mode in MODES:
        with (ae.adaptive(False) if mode == "eager" else ae.adaptive(strategy=mode)):
            model = build(mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
            inp, tgt = x[:, :-1].to("neuron"), x[:, 1:].to("neuron")
            dev = _engine.ENGINE.device
            for i in range(steps + 2):
                if i == 2:
                    ae.synchronize()
                    before, mark, t0 = ae.metrics(), len(dev.trace), dev.host_us
                opt.zero_grad()
                loss = F.cross_entropy(model(inp).flatten(0, 1), tgt.flatten())
                loss.backward()
                opt.step()
                loss.item()
            ae.synchronize()
            m = ae.metrics() - before
            coll = [(n, b) for n, kind, _, _, b, *_ in list(dev.trace)[mark:]
                    if kind == "collective"]
            out[mode] = {"launches": m.launches / steps, "collectives": m.collectives / steps,
                         "bytes": m.collective_bytes / steps, "coll_us": m.collective_us / steps,
                         "exposed_us": m.exposed_collective_us / steps,
                         "span_us": (dev.host_us - t0) / steps, "loss": loss.item(),
                         "last_step": coll[-round(m.collectives / steps):],
                         "fallbacks": sum(m.cpu_fallbacks.values())}
    dist.destroy_process_group()
    results[rank] = out


def project(fig, ranks):
    """(p, projected step time in us, weak-scaling efficiency) per rank count."""
    import adaptive_eager as ae
    from projection import collectives_us
    spec = ae.engine.engine.ENGINE.spec
    dp_spec = dataclasses.replace(spec, ranks_per_instance=max(spec.ranks_per_instance // 2, 1))

    def wire(p):  # TP's all-reduces over its 2 ranks; FSDP's collectives over dp = p / 2
        return collectives_us(fig["last_step"], lambda pattern: (
            (spec, 2) if pattern == "all_reduce" else (dp_spec, p // 2)))
    base = fig["span_us"] - wire(4)
    return [(p, base + wire(p), (base + wire(4)) / (base + wire(p))) for p in ranks]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--host-us", type=float, default=None,
                    help="DeviceSpec.host_op_overhead_us (0: a host that is never the bottleneck)")
    ap.add_argument("--out")
    a = ap.parse_args()
    from ranks import spawn
    results = spawn(_rank, 4, a.steps, a.host_us)
    lines = ["| mode | rank | launches | collectives | collective bytes | collectives (us) "
             "| exposed (us) | hidden | step time (us) | loss | CPU fallbacks |",
             "|---" * 11 + "|"]
    for mode in MODES:
        for r in range(4):
            f = results[r][mode]
            lines.append(f"| {mode} | {r} | {f['launches']:.0f} | {f['collectives']:.0f} | "
                         f"{f['bytes']:.0f} | {f['coll_us']:.1f} | {f['exposed_us']:.1f} | "
                         f"{1 - f['exposed_us'] / max(f['coll_us'], 1e-9):.0%} | "
                         f"{f['span_us']:.1f} | {f['loss']:.4f} | {f['fallbacks']} |")
    lines += ["", "Projection (TP stays 2, dp = p/2 on two levels; weak scaling; not a "
              "measurement):", "", "| mode | ranks | step time (us) | efficiency |",
              "|---|---|---|---|"]
    for mode in MODES:
        for p, t, eff in project(results[0][mode], PROJECTED_RANKS):
            lines.append(f"| {mode} | {p} | {t:.1f} | {eff:.1%} |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(f"# FSDP2 x TP LLaMA on a 2x2 mesh (`python benchmarks/fsdp_tp_llama.py "
                    f"--steps {a.steps}{'' if a.host_us is None else f' --host-us {a.host_us:g}'}`)"
                    f"\n\n{text}\n")


if __name__ == "__main__":
    main()
