"""adaptive-eager: a `neuron` device for PyTorch on a simulated NeuronCore, with an adaptive
eager mode that queues ops and fuses them (TORCH_NEURONX_ENABLE_CONCATENATION=1)."""
from __future__ import annotations

import atexit
import json

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as _dispatch_mode_stack

from . import _registration
from .errors import NeuronFallbackError, NeuronRuntimeError
from . import _engine
from .config import config
from ._engine import override
from .explain import Explanation
# report as _report: importing the `adaptive_eager.report` submodule (the CLI) rebinds the
# package attribute `report` to that module.
from .metrics import Snapshot, report as _report, snapshot
from device import COUNTERS
from device import DeviceSpec, NeuronOutOfMemoryError

__all__ = [
    "DeviceSpec", "Explanation", "NeuronFallbackError", "NeuronOutOfMemoryError",
    "NeuronRuntimeError", "Snapshot", "adaptive", "config", "explain", "is_adaptive",
    "metrics", "metrics_report", "override", "reset_metrics", "save_trace",
    "set_adaptive", "set_device_spec", "set_strategy", "strategy", "synchronize",
    "wait_for_compiles",
]

_registration.register()
from . import metrics_file as _metrics_file  # noqa: E402
_metrics_file.install()  # TORCH_NEURONX_METRICS_ENABLED=1: a JSON file at exit


def metrics() -> Snapshot:
    """Counters since the last reset_metrics() (see Snapshot for the fields)."""
    return snapshot(_engine.ENGINE.device.hbm)


def reset_metrics() -> None:
    """Zero every counter (in place: the counters object is never replaced)."""
    COUNTERS.reset()


def metrics_report() -> str:
    """A readable table of metrics()."""
    return _report(metrics())


def set_adaptive(on: bool) -> None:
    """Turn adaptive eager on or off for the process (flushes)."""
    _engine.ENGINE.set_adaptive(on)


def is_adaptive() -> bool:
    return _engine.ENGINE.is_lazy()


def set_strategy(name: str) -> None:
    """Fusion strategy for adaptive mode: 'graph' (default), 'matmul' or 'none'."""
    _engine.ENGINE.set_strategy(name)


def strategy() -> str:
    return _engine.ENGINE.strategy_name


def set_device_spec(spec: DeviceSpec) -> None:
    """Replace the simulated device's figures (flushes and synchronizes first)."""
    _engine.ENGINE.reconfigure(spec)


def synchronize() -> None:
    _engine.ENGINE.sync("synchronize")


class adaptive(TorchDispatchMode):
    """`with ae.adaptive():` adaptive eager inside the block (or `adaptive(False)`: eager).

    A TorchDispatchMode that passes every op through, so it nests and composes with other
    modes (FlopCounterMode, ...); entering and leaving switch the mode and flush."""

    def __init__(self, on: bool = True, strategy: str | None = None):
        super().__init__()
        self.on = on
        self.strategy = strategy
        self._saved = []

    def __enter__(self):
        eng = _engine.ENGINE
        saved = (eng.adaptive, eng.strategy.name)
        if self.strategy is not None and self.strategy != saved[1]:
            eng.set_strategy(self.strategy)  # validates first: a bad name changes nothing
        eng.set_adaptive(self.on)
        self._saved.append(saved)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            eng = _engine.ENGINE
            was_on, was_strategy = self._saved.pop()
            eng.set_adaptive(was_on)
            if was_strategy != eng.strategy.name:
                eng.set_strategy(was_strategy)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile compiles under this mode (it only passes ops through): Dynamo turns
        the mode off while it captures and on again while the compiled graphs run."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _dispatch_mode_stack() and types == (_engine.NeuronTensor,):
            # The only mode: go straight to the engine (what func() would reach anyway).
            # Under other modes, redispatch so that they see the op too.
            return _engine.ENGINE.dispatch(func, args, kwargs)
        return func(*args, **kwargs)


def wait_for_compiles() -> None:
    """Block until the background TorchInductor compiles queued so far are done (executor
    `auto`; a no-op for the others). Benchmarks and tests use it to reach the steady state."""
    ex = _engine.ENGINE.runner.executor
    if ex is not None:
        ex.wait()


def explain() -> Explanation:
    """What the last flush did: groups, boundary reasons, launches and bytes saved."""
    r = _engine.ENGINE.last_report
    if r is None:
        raise RuntimeError("nothing has been flushed yet: run some ops on a neuron tensor")
    return Explanation(r)


def save_trace(path: str) -> None:
    """Write the device timeline as a Chrome / Perfetto trace (JSON)."""
    _engine.ENGINE.sync("trace")
    with open(path, "w") as f:
        json.dump(_engine.ENGINE.device.chrome_trace(), f)


@atexit.register
def _flush_at_exit():  # nothing queued is lost at process exit
    try:
        _engine.ENGINE.sync("exit")
    except Exception as e:  # report, never crash the interpreter's shutdown
        import sys
        print(f"adaptive_eager: error at exit: {e}", file=sys.stderr)
