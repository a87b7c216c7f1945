"""Launch overhead per mode and workload, in one run (pytest-benchmark, through the package's
`neuron_benchmark` fixture: the modes are --neuron-modes, every mode by default here).

Smoke run (CI): `python -m pytest benchmarks` (benchmarks disabled: each step runs once after
the warm-up rounds). Full run: see the README ("Benchmarks")."""
import time

import pytest
import torch

from workloads import WORKLOADS


def inductor_kernels(make) -> int:
    """Kernels TorchInductor generates for the same step on CPU (torch.compile).

    Counted with torch._inductor.metrics.generated_kernel_count: Inductor's own generated
    (C++) kernels for every graph of the step (forward, backward, optimizer), not counting
    extern calls such as mm, which Inductor hands to a library."""
    import torch
    import torch._dynamo
    from torch._inductor import metrics
    torch._dynamo.reset()
    metrics.reset()
    step = torch.compile(make("cpu"))
    step()
    return metrics.generated_kernel_count


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_step(neuron_benchmark, request, workload):
    nb = neuron_benchmark
    nb.group = workload
    nb.extra_info["workload"] = workload
    # the workloads compile what they should themselves (the model, not AdamW's step)
    step = WORKLOADS[workload](nb.device, compile=nb.compile)
    if nb.mode == "cpu" and request.config.getoption("--inductor"):
        nb.extra_info["inductor_kernels"] = inductor_kernels(WORKLOADS[workload])
    nb.pedantic(step, rounds=20)


# Workloads LTC cannot run (torch 2.13, TorchScript backend), and why.
LTC_CANNOT = {
    "gpt_train": "LTC's matmul of the attention's transposed views (split -> view -> "
                 "transpose) returns a CPU tensor, and the next op refuses it",
}


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_ltc_step(benchmark, workload):
    """PyTorch's lazy tensors (`torch._lazy`, TorchScript backend) on the same step: a round
    is the step, `mark_step()` and `wait_device_ops()`. `launches_per_step` is LTC's graph
    executions (its compile-cache lookups, `CachedCompile` + `UncachedCompile`): the
    TorchScript backend then runs each graph's ops one by one on CPU (it fuses nothing on
    CPU). What the measured rounds computed is checked against CPU."""
    from adaptive_eager.tools.pytest_plugin import CountOps
    from workloads import lazy_device, ltc_counters, ltc_sync
    benchmark.group = workload
    make = WORKLOADS[workload]
    device = lazy_device()
    if workload in LTC_CANNOT:
        with pytest.raises(RuntimeError, match="not a lazy tensor"):
            make(device)()
        pytest.xfail(LTC_CANNOT[workload])
    step = make(device)
    state = {"n": 0, "best": float("inf")}

    def round_():
        t0 = time.perf_counter()
        out = step()
        ltc_sync()
        state["best"] = min(state["best"], time.perf_counter() - t0)
        state["n"] += 1
        return out

    t0 = time.perf_counter()
    round_()
    first_ms = (time.perf_counter() - t0) * 1e3
    round_()
    before = ltc_counters()
    state["n"], state["best"] = 0, float("inf")
    out = benchmark.pedantic(round_, rounds=20)
    n, after = state["n"], ltc_counters()
    delta = {k: v - before.get(k, 0) for k, v in after.items()}
    cpu_step = make("cpu")  # the same rounds on CPU: 2 warm-up rounds, then n
    for _ in range(n + 2):
        expected = cpu_step()
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-5)
    with CountOps() as c:  # one more step (after the check): CPU's ATen ops per step
        cpu_step()
    graphs = delta.get("CachedCompile", 0) + delta.get("UncachedCompile", 0)
    if benchmark.stats is not None:  # pytest-benchmark's timer (--benchmark-timer), as the
        state["best"] = benchmark.stats.stats.min  # report's wall column

    benchmark.extra_info.update(
        mode="ltc", device="lazy", workload=workload, rounds=n,
        steady_step_ms=state["best"] * 1e3, first_step_ms=first_ms,
        ops_per_step=c.n, host_us_per_op=state["best"] / c.n * 1e6,
        launches_per_step=graphs / n,
        cpu_fallbacks_per_step={k: v / n for k, v in delta.items() if k.startswith("aten::")})
