"""Data-parallel training on neuron with torch.distributed (DDP over gloo).

    torchrun --nproc-per-node 2 benchmarks/train_ddp.py [--adaptive] [--out losses.json]

Each rank trains a small MLP on its shard of a fixed global batch; the printed loss is the
mean over ranks, which equals a single-process run of the whole batch. Rank r runs on
neuron:LOCAL_RANK, one NeuronCore of the chip each (Note [Cores] in
adaptive_eager/integration/neuron.py).
"""
import argparse
import json
import os

import torch
import torch.distributed as dist

import adaptive_eager as ae

STEPS, GLOBAL_BATCH = 3, 8


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--adaptive", action="store_true", help="adaptive eager (graph strategy)")
    p.add_argument("--out", help="rank 0 writes the losses and metrics here (JSON)")
    a = p.parse_args()
    dist.init_process_group()  # no backend: gloo, neuron's default
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("neuron", int(os.environ.get("LOCAL_RANK", 0)))  # this rank's core
    torch.neuron.set_device(device)
    ae.set_adaptive(a.adaptive)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = torch.nn.parallel.DistributedDataParallel(model.to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g))
            for _ in range(STEPS)]
    shard = GLOBAL_BATCH // world
    ae.reset_metrics()
    losses = []
    for x, y in data:
        x, y = x[rank * shard:(rank + 1) * shard], y[rank * shard:(rank + 1) * shard]
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if rank == 0:
            print(f"loss {losses[-1]:.6f}", flush=True)
    assert all(p.device == device for p in model.parameters())  # each rank on its own core
    m = ae.metrics()
    if rank == 0 and a.out:
        with open(a.out, "w") as f:
            json.dump({"losses": losses, "world": world,
                       "device_count": torch.neuron.device_count(),
                       "devices": sorted({str(p.device) for p in model.parameters()}),
                       "collectives": m.collectives, "cpu_fallbacks": m.cpu_fallbacks}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
