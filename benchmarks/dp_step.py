"""A 2-rank data-parallel training step on neuron (DDP over gloo), per mode and per rank,
and a projection to more ranks from the same cost model.

    python benchmarks/dp_step.py [--steps 5] [--out benchmarks/dp_results.md]

Each rank runs the suite's GPT training step (benchmarks/workloads.py: the same model,
AdamW, one batch per rank) wrapped in DistributedDataParallel, in buckets of --bucket-mb
(several all-reduces per step). Figures per step, after two warm-up steps: launches,
collectives and their bytes, simulated device time (launches and collectives, as
`ae.metrics().device_time_us`), the part spent in collectives, how much of it the compute
stream waited for (exposed) and what ran under compute or host work (hidden: Note [Overlap]
in adaptive_eager/integration/distributed.py), and the step time on the simulated clock.
`--host-us 0` makes the host free, so only compute can hide communication.

Note [DP projection]: each collective of one step of rank 0 is re-costed at p ranks with
its own pattern by device/interconnect.py, on two levels (NeuronLink inside an instance of
`ranks_per_instance` ranks, EFA across; the algorithm each level takes is printed). Weak
scaling: the per-rank batch and its compute stay the same. Two columns: with no overlap
(the rest of the device time plus every collective: an upper bound on device time), and
with the measured overlap, assuming the compute that hid collectives at 2 ranks hides the
same time at p ranks and every added microsecond of communication is exposed (the step time
at 2 ranks plus the growth of the collectives).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import spawn  # noqa: E402

MODES = ["eager", "graph", "matmul"]
PROJECTED_RANKS = (2, 8, 64, 128, 512)


def ddp_gpt_step(rank, bucket_mb, style="ddp"):
    """The suite's GPT training step (workloads.gpt_train), under DDP, on this rank's batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from adaptive_eager.tools.models import GPT, batches
    from workloads import _train_step
    torch.manual_seed(0)
    model = GPT(vocab=64, d=64, heads=4, layers=2, seq=32).to("neuron")
    if style == "fsdp2":  # per block and at the root: all-gathers prefetched, reduce-scatters
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        model = fully_shard(model)
    else:  # buckets of bucket_mb MB: several per step (the default 25 MB holds the model)
        model = DDP(model, bucket_cap_mb=bucket_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x, y = batches("gpt", 1, seed=rank)[0]
    return _train_step(model, opt, x.to("neuron"), y.to("neuron"))


def _rank(rank, world, port, steps, bucket_mb, host_us, style, results):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    import adaptive_eager as ae
    from adaptive_eager.engine import engine as _engine
    dist.init_process_group(rank=rank, world_size=world)
    if host_us is not None:  # the host's time per op (0: only compute can hide a collective)
        import dataclasses
        ae.set_device_spec(dataclasses.replace(ae.DeviceSpec(), host_op_overhead_us=host_us))
    out = {}
    for mode in MODES:
        with (ae.adaptive(False) if mode == "eager" else ae.adaptive(strategy=mode)):
            step = ddp_gpt_step(rank, bucket_mb, style)
            for _ in range(2):  # warm-up: compiles; DDP rebuilds its buckets at step 2
                step().item()
            ae.synchronize()
            trace = _engine.ENGINE.device.trace
            mark = len(trace)
            before = ae.metrics()
            t0 = _engine.ENGINE.device.host_us
            for _ in range(steps):
                step().item()
            ae.synchronize()
            m = ae.metrics() - before
            span = (_engine.ENGINE.device.host_us - t0) / steps
            coll = [(name, dur, nbytes) for name, kind, _, dur, nbytes, _, _ in list(trace)[mark:]
                    if kind == "collective"]
            out[mode] = {
                "launches": m.launches / steps, "collectives": m.collectives / steps,
                "collective_bytes": m.collective_bytes / steps,
                "device_us": m.device_time_us / steps,
                "collective_us": sum(d for _, d, _ in coll) / steps,
                "exposed_us": m.exposed_collective_us / steps,
                "hidden_us": m.hidden_collective_us / steps,
                "span_us": span,  # simulated step time: host clock, sync to sync
                # the last step's collectives (every measured step issues the same ones):
                # DDP's gradient all-reduces and its broadcast of module buffers
                "last_step": [(n, b) for n, _, b in coll][-round(m.collectives / steps):],
                "fallbacks": sum(m.cpu_fallbacks.values()),
            }
    dist.destroy_process_group()
    results[rank] = out


def project(fig: dict, ranks) -> list[tuple]:
    """Per rank count: (p, step device time with no overlap, its weak-scaling efficiency,
    step time with the measured overlap, its efficiency, the all-reduce's algorithm)
    (Note [DP projection])."""
    import adaptive_eager as ae
    from device.interconnect import collective_plan
    from projection import collectives_us
    spec = ae.engine.engine.ENGINE.spec

    def wire(p):  # each collective of the step with its own pattern (ring, tree...)
        return collectives_us(fig["last_step"], lambda pattern: (spec, p))

    def algo(p):
        sizes = [b for name, b in fig["last_step"] if "allreduce" in name]
        return collective_plan(spec, "all_reduce", max(sizes), p)[1] if sizes else "-"
    rest = fig["device_us"] - wire(2)
    span = fig["span_us"]
    return [(p, rest + wire(p), (rest + wire(1)) / (rest + wire(p)),
             span + wire(p) - wire(2), (span + wire(1) - wire(2)) / (span + wire(p) - wire(2)),
             algo(p)) for p in ranks]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=0.1,
                    help="DDP's bucket_cap_mb (0.1: 5 buckets of the model's 0.44 MB)")
    ap.add_argument("--host-us", type=float, default=None,
                    help="DeviceSpec.host_op_overhead_us (0: a host that is never the bottleneck)")
    ap.add_argument("--style", choices=["ddp", "fsdp2"], default="ddp",
                    help="DDP, or FSDP2 (fully_shard per block and at the root)")
    ap.add_argument("--out", help="also write the tables (markdown) to this file")
    a = ap.parse_args()
    results = spawn(_rank, 2, a.steps, a.bucket_mb, a.host_us, a.style)
    lines = ["| mode | rank | launches | collectives | collective bytes | device time (us) "
             "| of which collectives (us) | exposed (us) | hidden | step time (us) "
             "| CPU fallbacks |", "|---" * 11 + "|"]
    for mode in MODES:
        for r in (0, 1):
            f = results[r][mode]
            lines.append(f"| {mode} | {r} | {f['launches']:.0f} | {f['collectives']:.0f} | "
                         f"{f['collective_bytes']:.0f} | {f['device_us']:.1f} | "
                         f"{f['collective_us']:.1f} | {f['exposed_us']:.1f} | "
                         f"{f['hidden_us'] / max(f['collective_us'], 1e-9):.0%} | "
                         f"{f['span_us']:.1f} | {f['fallbacks']} |")
    import adaptive_eager as ae
    spec = ae.engine.engine.ENGINE.spec
    lines += ["", "Projection (Note [DP projection]: each collective of rank 0's step re-costed "
              f"at p ranks on two levels, {spec.ranks_per_instance} ranks per instance at "
              f"{spec.interconnect_gbps:.0f} GB/s and {spec.interconnect_latency_us} us per "
              f"hop, EFA across at {spec.inter_instance_gbps:.0f} GB/s per instance and "
              f"{spec.inter_instance_latency_us} us per hop; weak scaling):", "",
              "| mode | ranks | device time, no overlap (us) | efficiency | step time, "
              "measured overlap (us) | efficiency | largest all-reduce's algorithm |",
              "|---|---|---|---|---|---|---|"]
    for mode in MODES:
        for p, t, eff, t2, eff2, how in project(results[0][mode], PROJECTED_RANKS):
            lines.append(f"| {mode} | {p} | {t:.1f} | {eff:.1%} | {t2:.1f} | {eff2:.1%} "
                         f"| {how} |")
    step = ", ".join(f"{n} of {b} B" for n, b in results[0]["graph"]["last_step"])
    lines += ["", f"Collectives of one step (rank 0): {step}."]
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(f"# 2-rank data-parallel step (`python benchmarks/dp_step.py --steps "
                    f"{a.steps}`)\n\n{text}\n")


if __name__ == "__main__":
    main()
