"""Per-step figures of one mode: what `benchmark.extra_info` carries."""
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import adaptive_eager as ae


class CountOps(TorchDispatchMode):
    """Counts ATen ops (the CPU reference's 'intercepted ops')."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def sync(device):
    if device != "cpu":
        torch.neuron.synchronize()


def _timed(step, device) -> float:
    t0 = time.perf_counter()
    step()
    sync(device)  # a step ends at a sync point (a training loop's loss.item())
    return time.perf_counter() - t0


def step_figures(step, device, steps=10) -> dict:
    """Run `steps` warm steps: mean simulated figures per step, and the best wall time of a
    step (as timeit: the noisy machine only ever adds time) for the host time per op."""
    first = ae.metrics() if device != "cpu" else None
    t0 = time.perf_counter()
    step()
    sync(device)  # warm-up: compiles (Dynamo's and ours), plans
    first_ms = (time.perf_counter() - t0) * 1e3
    step()  # and the second step, the first with the optimizer's state made (Adam's zeros,
    sync(device)  # step counts): steady state starts at the third (order-independent)
    if device == "cpu":
        wall = min(_timed(step, device) for _ in range(steps))
        with CountOps() as c:  # after the timing: the mode's own cost stays out of it
            step()
        return {"ops_per_step": c.n, "host_us_per_op": wall / c.n * 1e6}
    before = ae.metrics()
    warm = before - first
    wall = min(_timed(step, device) for _ in range(steps))
    m = ae.metrics() - before
    return {
        "ops_per_step": m.ops / steps,
        "launches_per_step": m.launches / steps,
        "mean_group_size": round(m.mean_group_size, 3),
        "device_us_per_step": m.device_time_us / steps,
        "host_us_per_op": wall / (m.ops / steps) * 1e6,
        "compiles": m.compiles,
        "cache_hits": m.cache_memory_hits + m.cache_disk_hits,
        "plan_hits": m.plan_hits,
        "hbm_bytes_per_step": m.hbm_bytes / steps,
        "bytes_saved_per_step": m.bytes_saved / steps,
        "cpu_fallbacks": sum(m.cpu_fallbacks.values()),
        # first call (wall: Dynamo + AOTAutograd + ours) against a steady step; modeled
        # compile time of the device's executables during the two warm-up steps
        "first_step_ms": first_ms,
        "steady_step_ms": wall * 1e3,
        "first_step_compile_ms_modeled": warm.compile_time_us / 1e3,
    }


def inductor_kernels(make) -> int:
    """Kernels TorchInductor generates for the same step on CPU (torch.compile).

    Counted with torch._inductor.metrics.generated_kernel_count: Inductor's own generated
    (C++) kernels for every graph of the step (forward, backward, optimizer), not counting
    extern calls such as mm, which Inductor hands to a library."""
    import torch._dynamo
    from torch._inductor import metrics
    torch._dynamo.reset()
    metrics.reset()
    step = torch.compile(make("cpu"))
    step()
    return metrics.generated_kernel_count
