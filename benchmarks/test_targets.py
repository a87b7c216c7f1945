"""The suite's targets that are deterministic (simulated launches and device time): checked
on every run. Wall-clock targets are reported by the full run, never asserted. The figures
are neuron_benchmark's (adaptive_eager/tools/pytest_plugin.py), per step after two warm-up steps."""
import pytest

from adaptive_eager.tools.pytest_plugin import compiler, figures, mode_scope
from workloads import WORKLOADS


@pytest.fixture(scope="module")
def gpt():
    out = {}
    for mode in ("eager", "graph", "matmul", "whole-graph", "compile"):
        with mode_scope(mode) as device:
            step = WORKLOADS["gpt_train"](device, compile=compiler(mode))
            out[mode] = figures(step, device)
    return out


def test_graph_launches_at_most_15_percent_of_eager_and_below_matmul(gpt):
    assert gpt["graph"]["launches_per_step"] <= 0.15 * gpt["eager"]["launches_per_step"]
    assert gpt["graph"]["launches_per_step"] < gpt["matmul"]["launches_per_step"]


def test_graph_device_time_at_most_35_percent_of_eager_and_near_whole_graph(gpt):
    g = gpt["graph"]["device_us_per_step"]
    assert g <= 0.35 * gpt["eager"]["device_us_per_step"]
    assert g <= 1.15 * gpt["whole-graph"]["device_us_per_step"]


def test_compile_launches_no_more_than_graph(gpt):
    assert gpt["compile"]["launches_per_step"] <= gpt["graph"]["launches_per_step"]
    assert gpt["compile"]["device_us_per_step"] <= 1.15 * gpt["whole-graph"]["device_us_per_step"]


def test_steady_state_compiles_nothing(gpt):
    for mode in ("graph", "matmul", "whole-graph", "compile"):
        assert gpt[mode]["compiles_per_step"] == 0, mode
        assert gpt[mode]["plan_hits_per_step"] > 0, mode
