import os
import sys
import tempfile

os.environ.setdefault("TORCH_NEURONX_NEFF_CACHE_DIR", tempfile.mkdtemp(prefix="ae-bench-"))
sys.path.insert(0, os.path.dirname(__file__))

if "adaptive_eager.tools.pytest_entry" not in sys.modules:
    # The package's pytest plugin (neuron_benchmark, --neuron-modes, --neuron-realtime) comes
    # through its pytest11 entry point once the package is installed; a checkout run without
    # installing it (or with -p no:adaptive_eager) takes the plugin's hooks here.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from adaptive_eager.tools.pytest_entry import (  # noqa: F401
        neuron_benchmark, pytest_addoption as _plugin_options, pytest_configure as _configure,
        pytest_generate_tests)
else:
    _plugin_options = _configure = None

# every mode of the suite, in one run (the report's ratios are to the first neuron mode)
SUITE_MODES = "cpu,eager,graph,matmul,whole-graph,compile"


def pytest_addoption(parser):
    if _plugin_options is not None:
        _plugin_options(parser)
    parser.addoption("--inductor", action="store_true",
                     help="also count the kernels torch.compile generates per workload "
                          "(slow: compiles each workload with TorchInductor)")


def pytest_configure(config):
    if config.getoption("neuron_modes") is None:  # the suite's default: every mode
        config.option.neuron_modes = SUITE_MODES
    if _configure is not None:
        _configure(config)
