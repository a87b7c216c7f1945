"""What each rank of tests/integration/test_distributed.py runs (a module, so spawned processes can
import it). Every scenario returns plain data; the parent process asserts on it."""
from __future__ import annotations

import datetime
import os
import traceback
import warnings

import torch
import torch.distributed as dist

import adaptive_eager as ae

MODES = ["eager", "graph", "matmul"]
STEPS = 3
GLOBAL_BATCH = 8


def _mode(mode):
    return ae.adaptive(False) if mode == "eager" else ae.adaptive(strategy=mode)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def make_data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g))
            for _ in range(STEPS)]


def train(model, data, device="neuron", rank=0, world=1, inputs_on_host=False):
    """SGD over `data`, every scenario's loop: with `world` ranks each trains on its shard of
    the global batch and the loss of a step is the ranks' mean (an all_reduce); with one, on
    the whole batch. `inputs_on_host`: the model is fed CPU batches (DDP copies them)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shard = GLOBAL_BATCH // world
    losses = []
    for x, y in data:
        x, y = x[rank * shard:(rank + 1) * shard], y[rank * shard:(rank + 1) * shard]
        opt.zero_grad()
        out = model(x if inputs_on_host else x.to(device))
        loss = torch.nn.functional.mse_loss(out, y.to(device))
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def cpu_losses():
    """The reference: one process, CPU, the whole global batch."""
    model = make_model()
    return train(model, make_data(), "cpu"), [p.detach().clone() for p in model.parameters()]


def _train_sharded(model, rank, world):
    """Data-parallel SGD: each rank trains on its shard; the global loss is the ranks' mean."""
    return train(model, make_data(), "neuron", rank, world)


def ddp_losses(rank, world, **options):
    """DDP on neuron: each rank trains on its shard; the global loss is the ranks' mean.
    `options`: DDP's (find_unused_parameters and static_graph pin a host buffer: the native
    hooks' pinned allocator, issue 25)."""
    model = torch.nn.parallel.DistributedDataParallel(make_model().to("neuron"), **options)
    losses = _train_sharded(model, rank, world)
    return losses, [p.detach().cpu() for p in model.parameters()]


def ddp_on_own_core(rank, world):
    """The torchrun habit: set_device(local_rank), then `.to("neuron")` and DDP given
    device_ids=[local_rank] (the native hooks resolve an index-less "neuron" to the current
    core, issue 25). Each rank's model lands on neuron:rank."""
    torch.neuron.set_device(rank)
    try:
        model = make_model().to("neuron")
        where = str(next(model.parameters()).device)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
        losses = _train_sharded(ddp, rank, world)
        return where, losses, [p.detach().cpu() for p in ddp.parameters()]
    finally:
        torch.neuron.set_device(0)


def _full(p):
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()


def _fully_shard(model, mesh, layers):
    """FSDP2: fully_shard per layer, then at the root."""
    from torch.distributed.fsdp import fully_shard
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def fsdp2_losses(rank, world, mesh):
    """FSDP2 (fully_shard per layer and at the root): data parallel over sharded params."""
    model = make_model().to("neuron")
    _fully_shard(model, mesh, (model[0], model[2]))
    losses = _train_sharded(model, rank, world)
    return losses, [_full(p) for p in model.parameters()]


def tp_losses(rank, world, mesh):
    """Tensor parallel: the first Linear split by columns, the second by rows; every rank
    sees the whole batch."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    model = make_model().to("neuron")
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return train(model, make_data()), [_full(p) for p in model.parameters()]


def dtensor_values(rank, world, mesh):
    """A DTensor sharded by rows: its local shard, a redistribution, a reduction."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    x = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    d = distribute_tensor(x.to("neuron"), mesh, [Shard(0)])
    full = d.redistribute(mesh, [Replicate()]).to_local()
    return {"local": d.to_local().cpu(), "full": full.cpu(),
            "sum": (d * 2).sum().full_tensor().item()}


def collectives(rank, world):
    """Each collective and P2P op once, on neuron tensors: values and what they cost."""
    out = {}
    dev = "neuron"
    before = ae.metrics()
    x = torch.arange(4, dtype=torch.float32, device=dev) + 10 * rank
    dist.all_reduce(x)
    out["all_reduce"] = x.cpu()
    y = torch.full((4,), float(rank + 1), device=dev)
    work = dist.all_reduce(y, op=dist.ReduceOp.MAX, async_op=True)
    work.wait()
    out["all_reduce_async_max"] = y.cpu()
    gathered = [torch.empty(2, device=dev) for _ in range(world)]
    dist.all_gather(gathered, torch.full((2,), float(rank), device=dev))
    out["all_gather"] = [t.cpu() for t in gathered]
    flat = torch.empty(2 * world, device=dev)
    dist.all_gather_single(flat, torch.full((2,), float(rank), device=dev))
    out["all_gather_into_tensor"] = flat.cpu()
    rs = torch.empty(2, device=dev)
    dist.reduce_scatter_single(rs, torch.arange(2 * world, dtype=torch.float32, device=dev))
    out["reduce_scatter_tensor"] = rs.cpu()
    b = torch.full((3,), float(rank + 5), device=dev)
    dist.broadcast(b, src=1)
    out["broadcast"] = b.cpu()
    a2a = torch.empty(world, device=dev)
    dist.all_to_all_single(a2a, torch.arange(world, dtype=torch.float32, device=dev) + 10 * rank)
    out["all_to_all_single"] = a2a.cpu()
    if rank == 0:
        dist.send(torch.tensor([1.0, 2.0], device=dev), dst=1)
        out["send_recv"] = None
    else:
        r = torch.zeros(2, device=dev)
        dist.recv(r, src=0)
        out["send_recv"] = r.cpu()
    dist.barrier(device_ids=[0])
    m = ae.metrics() - before
    out["collectives"] = m.collectives
    out["collective_bytes"] = m.collective_bytes
    out["cpu_fallbacks"] = m.cpu_fallbacks
    return out


def ddp_device_ids_losses(rank, world):
    """DDP(device_ids=[rank]) with the model on neuron:rank, fed CPU batches: DDP copies each
    to the device on a side stream and calls `record_stream` (Note [Streams] in neuron.py)."""
    device = torch.device("neuron", rank)
    model = torch.nn.parallel.DistributedDataParallel(make_model().to(device),
                                                      device_ids=[rank])
    losses = train(model, make_data(), device, rank, world, inputs_on_host=True)
    return losses, [p.detach().cpu() for p in model.parameters()]


def neuron_backend(rank, world):
    """accelerate's multi-process neuron path: `PartialState()` calls
    `init_process_group(backend="neuron")` (Note [The neuron backend] in distributed.py), then
    its barrier with `device_ids`; DDP and object collectives run in that group."""
    import accelerate.state
    # accelerate finds neuron by the reference's import name (issue 24's other half): here
    # its answer is given, so the test is about the backend
    accelerate.state.is_neuron_available = lambda *args, **kwargs: True
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    state = accelerate.state.PartialState(timeout=datetime.timedelta(seconds=60))
    out = {"backend": dist.get_backend(), "accelerate": (state.distributed_type.value,
                                                          str(state.device))}
    out["backend_class"] = type(dist.group.WORLD._get_backend(torch.device("neuron"))).__name__
    state.wait_for_everyone()
    objs = [f"from {rank}"]
    dist.broadcast_object_list(objs, src=1)  # CPU tensors through the same group
    out["object"] = objs[0]
    before = ae.metrics()
    for mode in MODES:
        with _mode(mode):
            out[("ddp", mode)] = ddp_device_ids_losses(rank, world)
    out["cpu_fallbacks"] = (ae.metrics() - before).cpu_fallbacks
    state.destroy_process_group()
    return out


def adaptive_boundary(rank, world):
    """In adaptive mode the queue before a collective is flushed under 'collective'."""
    with ae.adaptive(strategy="graph"):
        before = ae.metrics()
        x = torch.ones(4, device="neuron")
        y = (x * 2 + 1).relu()
        dist.all_reduce(y)
        flushes = (ae.metrics() - before).flushes
        last = ae.explain()
        value = y.cpu()
    return {"flushes": flushes, "reason": last.report.reason, "ops": last.report.n_ops,
            "launches": last.launches, "value": value}


def run(rank, world, port, results, port2=None):
    """One rank: every scenario in every mode; results (or the traceback) into `results`."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    mine = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            # no backend: neuron's default; a short timeout, so a rank that failed cannot
            # leave the other one waiting in a collective for gloo's default 30 minutes
            dist.init_process_group(rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=60))
            mine["backend"] = type(dist.group.WORLD._get_backend(torch.device("neuron"))).__name__
            mine["backend_config"] = dist.get_backend_config()
            mine["device_types"] = [str(d) for d in dist.group.WORLD._device_types]
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("neuron", (world,))
            for mode in MODES:
                with _mode(mode):
                    mine[("collectives", mode)] = collectives(rank, world)
                    mine[("ddp", mode)] = ddp_losses(rank, world)
                    if mode != "matmul" and ae.native_hooks():  # issue 25
                        mine[("ddp_unused", mode)] = ddp_losses(
                            rank, world, find_unused_parameters=True)
                        mine[("ddp_static", mode)] = ddp_losses(rank, world, static_graph=True)
                        mine[("ddp_own_core", mode)] = ddp_on_own_core(rank, world)
                    mine[("fsdp2", mode)] = fsdp2_losses(rank, world, mesh)
                    mine[("tp", mode)] = tp_losses(rank, world, mesh)
                    mine[("dtensor", mode)] = dtensor_values(rank, world, mesh)
            mine["fallbacks"] = ae.metrics().cpu_fallbacks
            mine["boundary"] = adaptive_boundary(rank, world)
            dist.destroy_process_group()
            os.environ["MASTER_PORT"] = str(port2)
            try:
                mine["neuron_backend"] = neuron_backend(rank, world)
            except BaseException:  # its own tests report it; the others' results stand
                mine["neuron_backend"] = {"error": traceback.format_exc()}
        except BaseException:
            mine["error"] = traceback.format_exc()
    mine["warnings"] = [str(w.message) for w in caught]
    results[rank] = mine


# -- issue 30: the rest of the reference's list ----------------------------------------------
def fully_shard_cpu_built(rank, world, mesh):
    """FSDP2 of a module built on the CPU: fully_shard moves it (`tensor.data = t.to(dev)`)."""
    model = make_model()  # on the CPU
    _fully_shard(model, mesh, (model[0], model[2]))
    devices = sorted({p.device.type for p in model.parameters()})
    losses = _train_sharded(model, rank, world)
    return losses, [_full(p) for p in model.parameters()], devices


def pipeline_stages(rank, world):
    """pipeline() splits the model in two; build_stage puts stage r on this rank's neuron;
    GPipe over 2 micro-batches of the global batch."""
    from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline
    model = make_model()
    data = make_data()
    pipe = pipeline(model, mb_args=(data[0][0][:GLOBAL_BATCH // 2],),
                    split_spec={"2": SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, torch.device("neuron"))
    params = list(stage.submod.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    sched = ScheduleGPipe(stage, 2, loss_fn=torch.nn.functional.mse_loss)
    losses = []
    for x, y in data:
        opt.zero_grad()
        if rank == 0:
            sched.step(x.to("neuron"))
        else:
            micro = []
            sched.step(target=y.to("neuron"), losses=micro)
            losses.append(sum(v.item() for v in micro) / len(micro))
        opt.step()
    return losses, [p.detach().cpu() for p in params], sorted({p.device.type for p in params})


def async_checkpoint(rank, world, mesh, path):
    """dcp.async_save of an FSDP2 model's sharded state, then dcp.load into another one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard
    model = fully_shard(make_model().to("neuron"), mesh=mesh)
    dcp.async_save(model.state_dict(), checkpoint_id=path).result()
    torch.manual_seed(5)
    other = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    other = fully_shard(other.to("neuron"), mesh=mesh)
    state = other.state_dict()
    dcp.load(state, checkpoint_id=path)
    other.load_state_dict(state)
    return [_full(p) for p in other.parameters()]


def make_bn_model(sync):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                                torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(64, 2))
    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) if sync else model


def bn_data():
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(GLOBAL_BATCH, 3, 6, 6, generator=g),
             torch.randn(GLOBAL_BATCH, 2, generator=g)) for _ in range(STEPS)]


def bn_train(model, rank, world, device):
    losses = train(model, bn_data(), device, rank, world)
    inner = getattr(model, "module", model)
    return losses, [t.detach().cpu() for t in list(inner.parameters()) + list(inner.buffers())]


def cpu_bn_losses():
    """The reference: plain BatchNorm, one process, CPU, the whole global batch."""
    return bn_train(make_bn_model(False), 0, 1, "cpu")


def sync_batch_norm(rank, world):
    """SyncBatchNorm under DDP: each rank normalizes with the statistics of the global batch."""
    model = torch.nn.parallel.DistributedDataParallel(make_bn_model(True).to("neuron"))
    return bn_train(model, rank, world, "neuron")


def fsdp1(rank, world, use_orig_params):
    """FSDP1 (FullyShardedDataParallel), one unit per Linear and one at the root, this rank
    on neuron:rank. With `use_orig_params=False` the module is built on the CPU and FSDP1
    moves it (`device_id`). Returns losses, full parameters, and whether every unit freed
    its unsharded flat parameter after the step (`_typed_storage()._resize_(0)`)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    device = torch.device("neuron", rank)
    torch.neuron.set_device(rank)  # FSDP1's root unit (no parameters of its own) asks for it
    try:
        module = make_model() if not use_orig_params else make_model().to(device)
        model = FSDP(module, use_orig_params=use_orig_params, device_id=device,
                     auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}))
        return _train_fsdp1(model, rank, world, device)
    finally:
        torch.neuron.set_device(0)


def _train_fsdp1(model, rank, world, device):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    losses = train(model, make_data(), device, rank, world)
    handles = model._all_handles
    freed = len(handles) == 2 and all(
        h.flat_param._full_param_padded.untyped_storage().nbytes() == 0 for h in handles)
    with FSDP.summon_full_params(model):
        params = [p.detach().cpu() for p in model.parameters()]
    return losses, params, freed


def run_rest(rank, world, port, path, results):
    """One rank of tests/test_distributed_rest.py: issue 30's paths, per mode."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    mine = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            # async_save needs a CPU backend (PyTorch's rule): "gloo" covers cpu and neuron
            # ("cpu:gloo,neuron:gloo" would too, but SyncBatchNorm then asks the group's
            # backend name, no longer "gloo", and takes NCCL's all-gather, which gloo refuses)
            dist.init_process_group("gloo", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=60))
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("neuron", (world,))
            before = ae.metrics()
            for mode in REST_MODES:
                with _mode(mode):
                    mine[("fully_shard_cpu", mode)] = fully_shard_cpu_built(rank, world, mesh)
                    mine[("pipeline", mode)] = pipeline_stages(rank, world)
                    mine[("async_checkpoint", mode)] = async_checkpoint(
                        rank, world, mesh, os.path.join(path, mode))
                    mine[("sync_batch_norm", mode)] = sync_batch_norm(rank, world)
                    for orig in (True, False):
                        mine[("fsdp1", orig, mode)] = fsdp1(rank, world, orig)
            for mode in REST_MODES:
                with _mode(mode):
                    mine[("ddp_overlap", mode)] = ddp_overlap(rank, world)
                    mine[("fsdp2_overlap", mode)] = fsdp2_overlap(rank, world, mesh)
            mine["fallbacks"] = (ae.metrics() - before).cpu_fallbacks
            dist.destroy_process_group()
        except BaseException:
            mine["error"] = traceback.format_exc()
    mine["warnings"] = [str(w.message) for w in caught]
    results[rank] = mine


REST_MODES = ["eager", "graph"]


def _overlap(build, steps=2, host_us=0.0):
    """Communication exposed and hidden over the last of `steps` training steps of
    `build()`, with the host's time per op set to `host_us` (0: only compute can hide a
    collective). Also: does a collective's span on the timeline cross a launch's?"""
    import dataclasses

    from adaptive_eager.engine import engine as _engine
    old = _engine.ENGINE.spec
    ae.set_device_spec(dataclasses.replace(old, host_op_overhead_us=host_us))
    try:
        model = build()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(8, 64).to("neuron")
        for i in range(steps):
            if i == steps - 1:
                ae.synchronize()
                before, mark = ae.metrics(), len(_engine.ENGINE.device.trace)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        ae.synchronize()
        m = ae.metrics() - before
        events = list(_engine.ENGINE.device.trace)[mark:]
        step = ae.explain().communication  # the last step's, as explain() reports it
    finally:
        ae.set_device_spec(old)
    colls = [(s, s + d) for _, kind, s, d, *_ in events if kind == "collective"]
    launches = [(s, s + d) for _, kind, s, d, *_ in events if kind in ("launch", "dma")]
    crossed = sum(1 for a, b in colls if any(s < b and a < e for s, e in launches))
    return {"collectives": m.collectives, "collective_us": m.collective_us,
            "exposed_us": m.exposed_collective_us, "hidden_us": m.hidden_collective_us,
            "crossing": crossed, "explain": step}


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])


def ddp_overlap(rank, world):
    """DDP in buckets of ~1.5 layers (bucket_cap_mb=0.025: 4 all-reduces a step)."""
    return _overlap(lambda: torch.nn.parallel.DistributedDataParallel(
        _mlp().to("neuron"), bucket_cap_mb=0.025))


def fsdp2_overlap(rank, world, mesh):
    """FSDP2 per layer: it prefetches the next layer's all-gather, reduce-scatters by layer."""

    def build():
        model = _mlp().to("neuron")
        return _fully_shard(model, mesh, model)
    return _overlap(build)
