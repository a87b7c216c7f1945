import os
import tempfile

# Settings are read once at import: give the whole test session its own disk cache before
# torch (whose entry point imports adaptive_eager) is imported.
os.environ["TORCH_NEURONX_NEFF_CACHE_DIR"] = tempfile.mkdtemp(prefix="ae-test-cache-")
for var in ("TORCH_NEURONX_ENABLE_CONCATENATION", "NEURON_LAUNCH_BLOCKING",
            "ADAPTIVE_EAGER_FUSION_STRATEGY"):
    os.environ.pop(var, None)

import pytest  # noqa: E402

import adaptive_eager as ae  # noqa: E402


@pytest.fixture(autouse=True)
def _clean_engine():
    """Each test starts in eager mode with fresh counters and leaves nothing queued."""
    ae.set_adaptive(False)
    ae.set_strategy("graph")
    ae.reset_metrics()
    yield
    ae.set_adaptive(False)
    try:
        ae.synchronize()
    except ae.NeuronRuntimeError:
        pass


MODES = ["eager", "graph", "matmul"]


@pytest.fixture(params=MODES)
def mode(request):
    """Run the test body in eager mode and in adaptive mode with each strategy."""
    if request.param == "eager":
        yield "eager"
        return
    with ae.adaptive(strategy=request.param):
        yield request.param


def pytest_addoption(parser):
    parser.addoption("--inductor-all", action="store_true",
                     help="model tests under the Inductor executor for every model (slow)")
