"""Launch overhead per mode and workload, in one run (pytest-benchmark).

Smoke run (CI): `python -m pytest benchmarks` (benchmarks disabled: each step runs once).
Full run: see the README ("Benchmarks")."""
import pytest

from measure import inductor_kernels, step_figures, sync
from modes import COMPILED, MODES, mode_scope
from workloads import WORKLOADS


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_step(benchmark, request, workload, mode):
    benchmark.group = workload
    realtime = request.config.getoption("--realtime") and mode != "cpu"
    extra = {"realtime": True} if realtime else {}
    with mode_scope(mode, **extra) as device:
        step = WORKLOADS[workload](device, compiled=mode in COMPILED)
        benchmark.extra_info.update(step_figures(step, device))
        benchmark.extra_info["mode"] = mode
        benchmark.extra_info["workload"] = workload
        if mode == "cpu" and request.config.getoption("--inductor"):
            benchmark.extra_info["inductor_kernels"] = inductor_kernels(WORKLOADS[workload])
        benchmark.pedantic(lambda: (step(), sync(device)), rounds=20, warmup_rounds=2)
