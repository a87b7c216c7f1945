"""The public API (re-exported by the package): modes, metrics, explain, traces. Importing
it registers the `neuron` device."""
from __future__ import annotations

import atexit
import json

import torch

from torch._C._dynamo.eval_frame import set_eval_frame as _set_eval_frame
from torch._C import _len_torch_dispatch_stack
from torch._ops import HigherOrderOperator, OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

from .integration import registration as _registration
from .errors import FlushInterrupted, NeuronFallbackError, NeuronInductorError, NeuronRuntimeError
from .engine import engine as _engine, handlers
from .integration import neuron as _neuron
from .engine.tensor import NeuronTensor, engine_of
from .config import config
from .engine.engine import override
from .explain import Explanation
from .engine.source import lines as _lines
# report as _report: importing the `adaptive_eager.tools.report` submodule (the CLI) rebinds the
# package attribute `report` to that module.
from .metrics import Snapshot, report as _report, snapshot
from .integration.native import loaded as native_hooks  # Note [Native hooks]: loaded?
from device import COUNTERS
from device import DeviceSpec, NeuronOutOfMemoryError
from fusion.kernels import Cost, register_cost

__all__ = [
    "Cost", "register_cost", "DeviceSpec", "Explanation", "FlushInterrupted", "NeuronFallbackError",
    "NeuronInductorError", "NeuronOutOfMemoryError", "NeuronRuntimeError", "Snapshot", "adaptive", "config", "explain", "is_adaptive",
    "core_metrics", "line_report", "metrics", "metrics_report", "native_hooks", "override",
    "reset_metrics", "save_trace", "pad_to_bucket", "bucketing_collate",
    "set_adaptive", "set_device_spec", "set_strategy", "strategy", "synchronize",
    "wait_for_compiles",
]

_registration.register()
from .tools import metrics_file as _metrics_file  # noqa: E402
from .tools import lines as _lines_report  # noqa: E402
from .tools.bucketing import bucketing_collate, pad_to_bucket  # noqa: E402,F401
_metrics_file.install()  # TORCH_NEURONX_METRICS_ENABLED=1: a JSON file at exit


def metrics() -> Snapshot:
    """Counters since the last reset_metrics(), totals over every core (see Snapshot for the
    fields; memory in use is summed over the cores, the peak is the largest core's;
    `core_metrics(k)` has each core's)."""
    return snapshot([eng.device.hbm for eng in _engine.ENGINES])


def core_metrics(device=None) -> dict:
    """One core's share of the device figures since the last reset_metrics(): launches, DMAs
    and simulated device time (they add up to metrics()'s), and its HBM now and at peak."""
    dev = _engine.core(_neuron._check(device)).device
    return {"launches": dev.stats["launches"], "dmas": dev.stats["dmas"],
            "device_time_us": dev.stats["device_time_us"], "memory_bytes": dev.hbm.used,
            "peak_memory_bytes": dev.hbm.peak}


def reset_metrics() -> None:
    """Zero every counter (in place: the counters object is never replaced). Queued ops are
    launched first, so that every later launch is counted with its ops: the counters after a
    reset describe only what was issued after it."""
    with _engine._LOCK:
        _engine.flush_all("metrics reset")
        COUNTERS.reset()
        for eng in _engine.ENGINES:
            eng.device.stats.clear()
        _lines_report.mark(_engine.ENGINES)


def line_report():
    """Where the device time and the compiles went, by the user's source lines, since the
    last reset_metrics(): per line, ops, launches, device time (a fused launch's time split
    by its ops' modeled cost, or evenly), compiles, new-shape compiles, syncs
    (Note [Line report] in adaptive_eager/tools/lines.py). `.rows` has the figures; str()
    is a table."""
    with _engine._LOCK:
        for eng in list(_engine.ENGINES):
            eng.flush("line report")
        return _lines_report.line_report(list(_engine.ENGINES))


def metrics_report() -> str:
    """A readable table of metrics(), and what causes most new-shape compiles (with what
    padding that dimension to a bucket would leave)."""
    text = _report(metrics())
    why = _lines_report.churn_sentence(_lines_report.churn())
    return text + ("\n" + why if why else "")


def _check_on(on) -> None:
    if not isinstance(on, bool):
        raise TypeError(f"adaptive takes True or False, got {on!r}"
                        + (" (a strategy is named with strategy=...)" if isinstance(on, str)
                           else ""))


def set_adaptive(on: bool) -> None:
    """Turn adaptive eager on or off for the process, on every core (flushes)."""
    _check_on(on)
    with _engine._LOCK:
        for eng in _engine.ENGINES:
            eng.set_adaptive(on)


def is_adaptive() -> bool:
    return _engine.ENGINE.is_lazy()


def set_strategy(name: str) -> None:
    """Fusion strategy for adaptive mode: 'graph' (default), 'matmul' or 'none'."""
    with _engine._LOCK:
        for eng in _engine.ENGINES:
            eng.set_strategy(name)


def strategy() -> str:
    return _engine.ENGINE.strategy_name


def set_device_spec(spec: DeviceSpec) -> None:
    """Replace the simulated device's figures, on every core (flushes and synchronizes
    first). Checked before anything changes: a wrong type, or HBM smaller than what a core
    holds now, is refused and leaves the device as it was."""
    if not isinstance(spec, DeviceSpec):
        raise TypeError(f"set_device_spec() takes an ae.DeviceSpec, got "
                        f"{type(spec).__name__} ({spec!r}); e.g. "
                        f"dataclasses.replace(ae.DeviceSpec(), hbm_bytes=...)")
    with _engine._LOCK:
        for eng in _engine.ENGINES:
            eng.flush("device spec")
            eng.synchronize()
            used = eng.device.hbm.used
            if spec.hbm_bytes < used:
                raise ValueError(
                    f"DeviceSpec(hbm_bytes={spec.hbm_bytes}) is smaller than the "
                    f"{used} bytes neuron:{eng.index} holds now: free tensors first "
                    f"(del, then torch.neuron.empty_cache())")
        for eng in _engine.ENGINES:
            eng.reconfigure(spec)


def synchronize() -> None:
    """Wait for every core; raise the earliest deferred error (core by core)."""
    for eng in list(_engine.ENGINES):
        eng.sync("synchronize")


def _set_mode(values: dict) -> None:
    if "strategy" in values and values["strategy"] != strategy():
        set_strategy(values["strategy"])  # validates first: a bad name changes nothing
    if "adaptive" in values:
        set_adaptive(values["adaptive"])


_MODE_SCOPES = _engine.Scopes(
    lambda k: _engine.ENGINE.adaptive if k == "adaptive" else _engine.ENGINE.strategy_name,
    _set_mode)


class adaptive(TorchDispatchMode):
    """`with ae.adaptive():` adaptive eager inside the block (or `adaptive(False)`: eager).

    A TorchDispatchMode that passes every op through, so it nests and composes with other
    modes (FlopCounterMode, ...); entering and leaving switch the mode and flush."""

    def __init__(self, on: bool = True, strategy: str | None = None):
        super().__init__()
        _check_on(on)
        self.on = on
        self.strategy = strategy
        self._tokens = []

    def __enter__(self):
        values = {"adaptive": self.on}
        if self.strategy is not None:
            values["strategy"] = self.strategy
        self._tokens.append(_MODE_SCOPES.enter(values))  # Note [Scopes across threads]
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _MODE_SCOPES.leave(self._tokens.pop())

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile compiles under this mode (it only passes ops through): Dynamo turns
        the mode off while it captures and on again while the compiled graphs run."""
        return True

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Note [The scope's dispatch]: TorchDispatchMode wraps a subclass's
        `__torch_dispatch__` in torch._disable_dynamo unless this says False; ours turns
        Dynamo off itself, at a fraction of the cost."""
        return False

    # Higher-order operators (torch.cond, map, while_loop, scan, and what compiled graphs
    # hold) come here with this mode already off the stack; its settings still hold
    # (they are scopes, not the stack), so they run as outside it.
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Note [The scope's dispatch]: this runs per op, so it is what the op would cost
        # under set_adaptive(True) plus as little as can be. What torch._disable_dynamo
        # does around a mode's dispatch (Dynamo's frame callback off for the call, so that
        # a compiled function's callback never traces the engine; with a `None` callback
        # no stance changes anything), done with one C call each way instead of two
        # Python wrappers (they cost as much as the op's whole engine path). Then a neuron
        # op, with no other mode on the stack, goes to its engine at once: the engine of
        # the first argument when it is a neuron tensor, as NeuronTensor's dispatch finds
        # it (engine_of's flattening of every argument only when it is not). The checks are
        # C calls: an OpOverload's exact type is no HigherOrderOperator (whose isinstance
        # runs a Python __instancecheck__), and the mode stack is empty when its length is
        # 0 (torch's _get_current_dispatch_mode_stack builds a list in two Python frames).
        prior = _set_eval_frame(None)
        try:
            if type(func) is not OpOverload and isinstance(func, HigherOrderOperator):
                return func(*args, **(kwargs or {}))
            if types == (NeuronTensor,) and not _len_torch_dispatch_stack():
                # The only mode: go straight to the engine (what func() would reach
                # anyway). Under other modes, redispatch so that they see the op too.
                a = args[0] if args else None
                eng = a._engine if type(a) is NeuronTensor else engine_of(args, kwargs)
                return eng.dispatch(func, args, kwargs or {})
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if handlers.writes_foreach(func) and args[0] and type(args[0][0]) is not NeuronTensor:
                # Under any dispatch mode, CPU's in-place foreach kernels bump no version of
                # what they write (outside one, each per-tensor op does): autograd would
                # miss the write (a silently wrong gradient). Neuron's handler bumps its own.
                torch.autograd.graph.increment_version(list(args[0]))
            return out
        finally:
            _set_eval_frame(prior)


def wait_for_compiles() -> None:
    """Block until the background TorchInductor compiles queued so far are done (executor
    `auto`; a no-op for the others). Benchmarks and tests use it to reach the steady state."""
    ex = _engine.ENGINE.runner.executor
    if ex is not None:
        ex.wait()


def explain(device=None) -> Explanation:
    """What the last flush on a core (the current one by default) did: groups, boundary
    reasons, launches and bytes saved; and the last training step's communication, exposed
    and hidden (`communication`)."""
    eng = _engine.core(_neuron._check(device))
    r = eng.last_report
    if r is None:
        raise RuntimeError("nothing has been flushed yet: run some ops on a neuron tensor")
    return Explanation(r, eng.device.step_communication())


def save_trace(path: str) -> None:
    """Write the device timeline as a Chrome / Perfetto trace (JSON). Each launch's args
    name its ops' user lines: {"file:line": ops from it}."""
    events = []
    for eng in list(_engine.ENGINES):
        eng.sync("trace")
    for eng in _engine.ENGINES:  # one process row per core (pid = core index)
        events += eng.device.chrome_trace(pid=eng.index, lines=_launch_lines)["traceEvents"]
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def _launch_lines(ops) -> dict:
    return _lines(ops[0])  # (sources, costs): Device.trace


@atexit.register
def _flush_at_exit():  # nothing queued is lost at process exit
    # Note [Threads] at exit: the engine lock is taken for good, so a daemon thread's next op
    # waits on it in Python; the daemon threads that use the engine are let on to that point
    # (`park_daemon_threads`). A thread stuck holding the lock is not waited for long.
    _engine._LOCK.acquire(timeout=10)
    _engine.park_daemon_threads(timeout=0.5)
    try:
        for eng in list(_engine.ENGINES):
            eng.sync("exit")
    except Exception as e:  # report, never crash the interpreter's shutdown
        import sys
        print(f"adaptive_eager: error at exit: {e}", file=sys.stderr)


def __getattr__(name):
    """`ae.kernels` (and `from adaptive_eager import kernels`): the kernel library
    (integration/kernels.py), imported on first use, so its custom ops are registered only
    for those who use them."""
    if name == "kernels":
        import importlib
        return importlib.import_module("adaptive_eager.integration.kernels")
    raise AttributeError(f"module 'adaptive_eager' has no attribute {name!r}")
