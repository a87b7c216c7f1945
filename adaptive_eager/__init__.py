"""adaptive-eager: a `neuron` device for PyTorch on a simulated NeuronCore, with an adaptive
eager mode that queues ops and fuses them (TORCH_NEURONX_ENABLE_CONCATENATION=1).

The package re-exports its public API (api.py); importing it registers the device. Layout:
engine/ (one core's dispatch, queue, replay), integration/ (what teaches torch and libraries
about the device), tools/ (demo, run, report); see README.md beside this file.

Note [Lazy package]: the API (api.py: torch, the engine, the device's registration) loads at
once when torch is already imported (`import torch; import adaptive_eager`, and torch's backend
autoload, _autoload.py); otherwise at the first use of one of the package's names, or right
after torch's import. So a module of the package can be imported without torch: the pytest
plugin (tools/pytest_entry.py, the `pytest11` entry point, imported by every pytest run where
the package is installed) leaves a run that does not use its fixture without torch. A module of
ours imported first (`import device`, `import adaptive_eager.errors`, an unpickled error) meets
torch's import half made, and the API needs it whole (`from device import COUNTERS` failed,
and torch refused the backend): while one is half made, torch's autoload and import load the
API once that module's import has run (`_load_when_whole`). Threads (first imports at once):
the API is imported after torch, never while holding the package's import lock waiting for
torch, since torch's import (its autoload) waits for the package: one thread's `import torch`
and another's `import adaptive_eager` had Python's deadlock detector break the circle, failing
torch's import (torch then ran twice). So the package, imported while another thread imports
torch, leaves the API to that import; `_load` imports torch before the API.
"""
import importlib as _importlib
import sys as _sys

from . import config  # the settings are read and checked at import, torch or not
from . import patches as _patches

__all__ = [  # api.py's, known before it loads (tests/tools/test_pytest_plugin.py: they agree)
    "Cost", "register_cost", "DeviceSpec", "Explanation", "FlushInterrupted",
    "NeuronFallbackError", "NeuronInductorError", "NeuronOutOfMemoryError", "NeuronRuntimeError",
    "Snapshot", "adaptive", "config", "explain", "is_adaptive", "core_metrics", "line_report",
    "metrics", "metrics_report", "native_hooks", "override", "reset_metrics", "save_trace",
    "pad_to_bucket", "bucketing_collate", "set_adaptive", "set_device_spec", "set_strategy",
    "strategy", "synchronize", "wait_for_compiles",
]


def _load():
    """Import the API (registering the device) and make its names the package's. (Torch's
    autoload, called by api's own `import torch`, finds the API half made: the outer call
    finishes it.) Torch first (Note [Lazy package]: the order torch's own import takes)."""
    import torch  # noqa: F401  (on another thread half made: waits for it, and its autoload)
    api = _importlib.import_module(f"{__name__}.api")
    if not getattr(api.__spec__, "_initializing", False):
        globals().update((name, getattr(api, name)) for name in __all__)
    return api


_OURS = ("adaptive_eager", "device", "fusion")


def _load_when_whole(_torch=None) -> None:
    """Note [Lazy package]: `_load()`, or, while a module of ours is half made (its import
    imported torch, whose autoload calls this), right after the outermost one's import ran.
    (This package's own module, at its last line, and the API's, finished by the outer call,
    are not waited for.)"""
    half = next((name for name, m in list(_sys.modules.items())
                 if name.partition(".")[0] in _OURS and name not in (__name__, f"{__name__}.api")
                 and getattr(getattr(m, "__spec__", None), "_initializing", False)), None)
    if half is None:
        _load()
    else:  # (sys.modules keeps the order imports began in: the first is the outermost)
        _patches.after_import(half, lambda _: _load())


def __getattr__(name):
    """An API name (or `ae.kernels`, api.__getattr__) before the API loaded. Other names
    (submodules, asked for by `from . import x` before their import) are not the API's."""
    if name in __all__ or name == "kernels":
        return getattr(_load(), name)
    raise AttributeError(f"module 'adaptive_eager' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


def _imported_elsewhere(module) -> bool:
    """`module`'s import is under way on another thread (half made, not on this stack)."""
    if not getattr(getattr(module, "__spec__", None), "_initializing", False):
        return False
    frame = _sys._getframe(1)
    while frame is not None and frame.f_globals is not module.__dict__:
        frame = frame.f_back
    return frame is None


if "torch" in _sys.modules and not _imported_elsewhere(_sys.modules["torch"]):
    _load_when_whole()
else:
    _TORCH_HOOK = _patches.after_import("torch", _load_when_whole)
