"""pytest plugin of adaptive-eager (the `pytest11` entry point): the `neuron_benchmark`
fixture, pytest-benchmark's `benchmark` run once per mode of the simulated neuron device.

    def test_train_step(neuron_benchmark):
        model = MyModel().to(neuron_benchmark.device)
        x = torch.randn(8, 128, device=neuron_benchmark.device)
        neuron_benchmark(train_step, model, x)

`pytest --neuron-modes eager,graph,matmul,compile,cpu` (default eager,graph) runs each such
test once per mode, in its own scope; each records launches, device time, compiles... per
round in `benchmark.extra_info` (adaptive_eager/tools/pytest_plugin.py), and the test is its
modes' group, so pytest-benchmark's table compares them. `python -m adaptive_eager report
BENCH.json` tables a run saved with --benchmark-json.

This module imports no torch, nor the package's API: pytest imports it in every run where the
package is installed (Note [Benchmark plugin] in adaptive_eager/tools/pytest_plugin.py, Note
[Lazy package] in adaptive_eager/__init__.py)."""
import sys

import pytest

# Note [Lazy package]: pytest's import of this plugin is not a user's `import adaptive_eager`,
# so torch's import does not load the API for it (torch's backend autoload still does, as in
# any process; with TORCH_DEVICE_BACKEND_AUTOLOAD=0 a run not using the fixture stays as torch
# leaves it)
_hook = vars(sys.modules["adaptive_eager"]).get("_TORCH_HOOK")
if _hook in sys.meta_path:
    sys.meta_path.remove(_hook)

MODES = ("eager", "graph", "matmul", "compile", "cpu", "whole-graph")
DEFAULT_MODES = "eager,graph"


def pytest_addoption(parser):
    group = parser.getgroup("neuron", "adaptive-eager benchmarks (the neuron_benchmark fixture)")
    group.addoption(
        "--neuron-modes", default=None, metavar="MODES",
        help="comma-separated modes each test using neuron_benchmark runs in, from: "
             f"{', '.join(MODES)} (default: {DEFAULT_MODES})")
    group.addoption(
        "--neuron-realtime", action="store_true",
        help="each launch also takes its modeled time on the wall clock, so that "
             "pytest-benchmark's timings include the launch overhead")


def modes(config) -> list:
    """The modes of --neuron-modes, checked, in their order (duplicates dropped)."""
    raw = config.getoption("neuron_modes") or DEFAULT_MODES
    names = list(dict.fromkeys(m.strip() for m in raw.split(",") if m.strip()))
    bad = [m for m in names if m not in MODES]
    if bad or not names:
        raise pytest.UsageError(f"--neuron-modes {raw!r}: unknown mode(s) {', '.join(bad)}; "
                                f"choose from {', '.join(MODES)}")
    return names


def pytest_configure(config):
    if config.getoption("neuron_modes") is not None:
        modes(config)  # a typo fails the run before collection


def pytest_generate_tests(metafunc):
    if "neuron_benchmark" in metafunc.fixturenames:
        names = modes(metafunc.config)
        metafunc.parametrize("neuron_benchmark", names, indirect=True, ids=names)


def _group(node) -> str:
    """The test without its mode: the modes of one test (and its other parameters) share
    pytest-benchmark's group."""
    callspec = getattr(node, "callspec", None)
    others = [str(v) for k, v in (callspec.params.items() if callspec else ())
              if k != "neuron_benchmark"]
    name = getattr(node, "originalname", node.name)
    return f"{name}[{'-'.join(others)}]" if others else name


@pytest.fixture
def neuron_benchmark(request, benchmark):
    """pytest-benchmark's `benchmark` in one neuron mode (see this module's docstring)."""
    from .pytest_plugin import NeuronBenchmark
    mode = getattr(request, "param", None) or modes(request.config)[0]
    nb = NeuronBenchmark(benchmark, mode, realtime=request.config.getoption("neuron_realtime"),
                         group=_group(request.node))
    with nb.scope():
        yield nb
