import os
import sys
import tempfile

os.environ.setdefault("TORCH_NEURONX_NEFF_CACHE_DIR", tempfile.mkdtemp(prefix="ae-bench-"))
sys.path.insert(0, os.path.dirname(__file__))


def pytest_addoption(parser):
    parser.addoption("--realtime", action="store_true",
                     help="each launch also takes its modeled time on the wall clock, so "
                          "pytest-benchmark's timings show the launch overhead")
    parser.addoption("--inductor", action="store_true",
                     help="also count the kernels torch.compile generates per workload "
                          "(slow: compiles each workload with TorchInductor)")
