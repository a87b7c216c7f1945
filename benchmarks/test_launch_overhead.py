"""Launch overhead per mode and workload, in one run (pytest-benchmark, through the package's
`neuron_benchmark` fixture: the modes are --neuron-modes, every mode by default here).

Smoke run (CI): `python -m pytest benchmarks` (benchmarks disabled: each step runs once after
the warm-up rounds). Full run: see the README ("Benchmarks")."""
import pytest

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
