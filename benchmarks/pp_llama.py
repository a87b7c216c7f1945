"""TorchTitan's composition with a pipeline dimension: the LLaMA-style model of
fsdp_tp_llama.py cut into 2 pipeline stages, each stage sharded by FSDP2 (or split by tensor
parallelism) over the other mesh dimension: 4 ranks over gloo, per rank and per mode.

    python benchmarks/pp_llama.py [--inner dp|tp] [--schedule gpipe|1f1b] [--microbatches 4]
                                  [--steps 2] [--host-us 0] [--out benchmarks/pp_fsdp_results.md]

Mesh ("pp", inner) = (2, 2): stage 0 is the embedding and block 0, stage 1 block 1, the final
norm and the output projection; hand-built `PipelineStage`s (as TorchTitan builds them),
ScheduleGPipe or Schedule1F1B over `--microbatches` microbatches. `--inner dp`: fully_shard
of each stage over "dp" (each dp rank its half of the global batch); `--inner tp`: the TP plan
of fsdp_tp_llama.py over "tp" (both tp ranks see the same batch). 8 ranks (PP x FSDP x TP)
would be the full composition; 8 processes on this 2-core machine are too heavy, so the two
4-rank pairs are measured instead.

Figures per step, after two warm-up steps: launches, collectives (FSDP's or TP's) and P2P
transfers (the pipeline's sends and receives) with their bytes, collective time and how much of
it was exposed, the rank's own step time on its simulated clock, and the pipeline's step time.

Note [Pipeline step time]: each process has its own simulated clock, and a receive does not
wait for the sender's clock (the clocks are never exchanged: adaptive_eager/LIMITS.md), so a
rank's own step time leaves out the pipeline's bubble: the time stage 1 waits for stage 0's
activations and stage 0 for stage 1's gradients. The pipeline step time is reconstructed after
the run from the ranks' timelines: the k-th send from one stage to its peer is the peer's k-th
receive (gloo keeps each pair's order), a receive ends no earlier than its send began plus its
own transfer time, and a rank's later events move by the wait (the schedules wait for a
receive before the compute that uses it: `_wait_batch_p2p`). The moves are relaxed to a fixed
point; the step is the latest rank's end. Assumed: the measured window starts at the same
moment on every rank (each syncs first). Collectives inside a stage's group are not aligned
(the ranks of a group run the same schedule, so their clocks move alike).

Each run is also checked against one CPU process training the unsplit model on the global
batch (the loss of the last step).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import spawn  # noqa: E402
from fsdp_tp_llama import SEQ, VOCAB, Llama  # noqa: E402

MODES = ["eager", "graph"]
WORLD = 4
BATCH = 8  # the global batch: 4 microbatches of one sequence per dp rank
WARMUP = 2


class Stage(nn.Module):
    """The part of a Llama one pipeline stage runs (its first or second half)."""

    def __init__(self, model: Llama, index: int):
        super().__init__()
        self.index = index
        half = len(model.blocks) // 2
        if index == 0:
            self.tok, self.blocks = model.tok, nn.ModuleList(model.blocks[:half])
        else:
            self.blocks = nn.ModuleList(model.blocks[half:])
            self.norm, self.out = model.norm, model.out

    def forward(self, x):
        if self.index == 0:
            x = self.tok(x)
        for blk in self.blocks:
            x = blk(x)
        return x if self.index == 0 else self.out(self.norm(x))


def loss_fn(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def data(steps):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(steps)]


def cpu_losses(steps):
    """The reference: the unsplit model, one CPU process, the global batch, AdamW."""
    torch.manual_seed(0)
    model = Llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    losses = []
    for x in data(steps):
        opt.zero_grad()
        loss = loss_fn(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def build(mesh, inner, pp_rank):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    torch.manual_seed(0)
    stage = Stage(Llama(), pp_rank).to("neuron")
    if inner == "tp":  # fsdp_tp_llama.py's plan
        plan = {n: ColwiseParallel() for n in ("wq", "wk", "wv", "w1", "w3")}
        plan.update({n: RowwiseParallel() for n in ("wo", "w2")})
        for blk in stage.blocks:
            parallelize_module(blk, mesh["tp"], plan)
        return stage
    for blk in stage.blocks:
        fully_shard(blk, mesh=mesh["dp"])
    return fully_shard(stage, mesh=mesh["dp"])


def _rank(rank, world, port, a, results):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    import adaptive_eager as ae
    from adaptive_eager.engine import engine as _engine
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    dist.init_process_group(rank=rank, world_size=world)
    if a.host_us is not None:
        ae.set_device_spec(dataclasses.replace(ae.DeviceSpec(), host_op_overhead_us=a.host_us))
    mesh = init_device_mesh("neuron", (2, 2), mesh_dim_names=("pp", a.inner))
    pp, inner = mesh["pp"].get_local_rank(), mesh[a.inner].get_local_rank()
    steps = WARMUP + a.steps
    batches = data(steps)
    if a.inner == "dp":  # each dp rank its half of the global batch
        batches = [x[inner * BATCH // 2:(inner + 1) * BATCH // 2] for x in batches]
    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[a.schedule]
    out = {"pp": pp, "inner": inner}
    for mode in MODES:
        with (ae.adaptive(False) if mode == "eager" else ae.adaptive(strategy=mode)):
            module = build(mesh, a.inner, pp)
            stage = PipelineStage(module, pp, 2, torch.device("neuron"),
                                  group=mesh["pp"].get_group())
            sched = schedule(stage, a.microbatches, loss_fn=loss_fn)
            # under TP alone a stage mixes DTensors and plain tensors (embedding, norms),
            # which one foreach call refuses (DTensor's rule, on any device)
            opt = torch.optim.AdamW(module.parameters(), lr=1e-3, foreach=a.inner == "dp")
            dev = _engine.ENGINE.device
            losses = []
            for i, x in enumerate(batches):
                if i == WARMUP:
                    ae.synchronize()
                    before, mark, t0 = ae.metrics(), len(dev.trace), dev.host_us
                opt.zero_grad()
                if pp == 0:
                    sched.step(x[:, :-1].to("neuron"))
                else:
                    micro = []
                    sched.step(target=x[:, 1:].to("neuron"), losses=micro)
                    losses.append(sum(v.item() for v in micro) / len(micro))
                opt.step()
            ae.synchronize()
            m = ae.metrics() - before
            events = [(n, kind, s - t0, d, b)
                      for n, kind, s, d, b, *_ in list(dev.trace)[mark:]]
            p2p = [e for e in events if e[1] == "collective" and _is_p2p(e[0])]
            out[mode] = {"launches": m.launches / a.steps,
                         "collectives": (m.collectives - len(p2p)) / a.steps,
                         "bytes": (m.collective_bytes - sum(e[4] for e in p2p)) / a.steps,
                         "p2p": len(p2p) / a.steps, "p2p_bytes": sum(e[4] for e in p2p) / a.steps,
                         "coll_us": m.collective_us / a.steps,
                         "exposed_us": m.exposed_collective_us / a.steps,
                         "span_us": (dev.host_us - t0) / a.steps, "total_us": dev.host_us - t0,
                         "events": events, "losses": losses,
                         "fallbacks": sum(m.cpu_fallbacks.values()),
                         "compiles": m.compiles / a.steps, "causes": m.compile_causes,
                         "dims": m.compile_dims}
    dist.destroy_process_group()
    results[rank] = out


def _is_p2p(name: str) -> bool:
    return name.split("::")[-1] in ("send", "recv_", "recv_any_source_")


def pipeline_delays(ranks: dict, peer) -> dict:
    """Note [Pipeline step time]: for each rank (`ranks`: rank -> its events, in order), how
    long it waited for its pipeline peer (`peer(r)`) before each of its events, in us."""
    sends = {r: [i for i, e in enumerate(ev) if e[1] == "collective" and e[0].endswith("send")]
             for r, ev in ranks.items()}
    delay = {r: [0.0] * (len(ev) + 1) for r, ev in ranks.items()}  # delay[r][i]: before event i
    for _ in range(10 * sum(len(ev) for ev in ranks.values()) + 1):
        changed = False
        for r, ev in ranks.items():
            q, k, d = peer(r), 0, [0.0]
            for name, kind, start, dur, _b in ev:
                wait = 0.0
                if kind == "collective" and _is_p2p(name) and not name.endswith("send"):
                    i = sends[q][k]  # the peer's k-th send is this k-th receive
                    k += 1
                    _n, _kind, s_start, s_dur, _sb = ranks[q][i]
                    wait = max(0.0, s_start + delay[q][i] + s_dur - (start + d[-1] + dur))
                d.append(d[-1] + wait)
            if d != delay[r]:
                delay[r], changed = d, True
        if not changed:
            return delay
    raise RuntimeError("the pipeline's waits did not settle (sends and receives do not pair)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--inner", choices=["dp", "tp"], default="dp")
    ap.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--host-us", type=float, default=None,
                    help="DeviceSpec.host_op_overhead_us (0: a host that is never the bottleneck)")
    ap.add_argument("--out")
    ap.add_argument("--append", action="store_true", help="add to --out (another section)")
    a = ap.parse_args()
    results = spawn(_rank, WORLD, a)
    ref = cpu_losses(WARMUP + a.steps)[-1]
    ranks = sorted(results)
    peer = {r: next(q for q in ranks if results[q]["pp"] != results[r]["pp"]
                    and results[q]["inner"] == results[r]["inner"]) for r in ranks}
    lines = ["| mode | rank | stage | launches | collectives | collective bytes | P2P "
             "| P2P bytes | collectives + P2P (us) | exposed (us) | hidden "
             "| own step time (us) | waits for its peer (us) | compiles | CPU fallbacks |",
             "|---" * 15 + "|"]
    summary, causes = [], []
    for mode in MODES:
        delays = pipeline_delays({r: results[r][mode]["events"] for r in ranks}, peer.get)
        step = max((results[r][mode]["total_us"] + delays[r][-1]) / a.steps for r in ranks)
        last = [results[r][mode]["losses"][-1] for r in ranks if results[r][mode]["losses"]]
        loss = sum(last) / len(last) if a.inner == "dp" else last[0]
        summary.append(f"| {mode} | {step:.1f} | {loss:.6f} | {ref:.6f} | "
                       f"{abs(loss - ref):.1e} |")
        for r in ranks:
            f = results[r][mode]
            lines.append(f"| {mode} | {r} | {results[r]['pp']} | {f['launches']:.0f} | "
                         f"{f['collectives']:.0f} | {f['bytes']:.0f} | {f['p2p']:.0f} | "
                         f"{f['p2p_bytes']:.0f} | {f['coll_us']:.1f} | {f['exposed_us']:.1f} | "
                         f"{max(0.0, 1 - f['exposed_us'] / max(f['coll_us'], 1e-9)):.0%} | "
                         f"{f['span_us']:.1f} | {delays[r][-1] / a.steps:.1f} | "
                         f"{f['compiles']:.0f} | {f['fallbacks']} |")
            if f["causes"]:  # a compile in the steady state: why (Note [Compile causes])
                causes.append(f"{mode}, rank {r}: {f['causes']} {f['dims']}")
    lines += ["", "Pipeline step time (Note [Pipeline step time]) and the last step's loss "
              "against one CPU process on the global batch:", "",
              "| mode | pipeline step time (us) | loss | CPU loss | difference |",
              "|---|---|---|---|---|", *summary]
    if causes:
        lines += ["", "Compiles in the measured steps, by cause:", ""] + [f"- {c}" for c in causes]
    text = "\n".join(lines)
    print(text)
    if a.out:
        cmd = " ".join(["python benchmarks/pp_llama.py"] + sys.argv[1:])
        inner = "FSDP2" if a.inner == "dp" else "TP"
        head = (f"# PP x {inner} LLaMA, 2 stages x 2, {a.schedule}, {a.microbatches} "
                f"microbatches (`{cmd}`)")
        with open(a.out, "a" if a.append else "w") as f:
            f.write(("\n" if a.append else "") + f"{head}\n\n{text}\n")


if __name__ == "__main__":
    main()
