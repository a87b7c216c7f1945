"""The `neuron_benchmark` fixture's work: the modes, their scopes, and the figures of a
benchmarked function's rounds, recorded in pytest-benchmark's `benchmark.extra_info`.

Note [Benchmark plugin]: the pytest plugin is `tools/pytest_entry.py` (the `pytest11` entry
point names it), not this module: pytest imports every installed plugin in every run, and
this module imports torch. That module holds only the options, the parametrization over
`--neuron-modes` and the fixture, which imports this module when a test uses it; the
package's `__init__` it runs first loads no torch (Note [Lazy package] in __init__.py). A round is one call of the function and a sync (`ae.synchronize()`, the sync point
a training loop's `loss.item()` gives); `warmup_rounds` rounds (2: compiles and plans, then
the first step with an optimizer's state made) run before any is measured. The figures are
deltas of `ae.metrics()` over the measured rounds divided by their count: pytest-benchmark
decides how many rounds it runs (calibration included, and one when benchmarks are disabled),
so the rounds are counted where they run, in `Rounds`."""
from __future__ import annotations

import contextlib
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import adaptive_eager as ae

# mode -> (device, settings of its ae.override scope; None: plain CPU torch)
MODES = {
    "eager": ("neuron", {"adaptive": False}),
    "graph": ("neuron", {"adaptive": True, "strategy": "graph"}),
    "matmul": ("neuron", {"adaptive": True, "strategy": "matmul"}),
    # torch.compile(backend="neuron") around the benchmarked function (or what the test gives
    # NeuronBenchmark.compile), the rest in adaptive `graph` mode
    "compile": ("neuron", {"adaptive": True, "strategy": "graph"}),
    # the compiled-graph bound of our partitioner: purely lazy, no sync inside a round
    "whole-graph": ("neuron", {"adaptive": True, "strategy": "graph", "queue_low_threshold": 0}),
    "cpu": ("cpu", None),
}


@contextlib.contextmanager
def mode_scope(mode: str, realtime: bool = False):
    """The mode for the block (process-wide, as TORCH_NEURONX_ENABLE_CONCATENATION=1 sets it;
    the settings before it are restored on exit); yields its device."""
    device, settings = MODES[mode]
    if settings is None:
        yield device
        return
    with ae.override(**settings, **({"realtime": True} if realtime else {})):
        yield device


def sync(device: str) -> None:
    if device != "cpu":
        ae.synchronize()


class CountOps(TorchDispatchMode):
    """Counts ATen ops (plain CPU torch's figure for ops per round)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


class Rounds:
    """`fn` and a sync: one round per call. Counts the calls and keeps the fastest's time."""

    def __init__(self, fn, device: str):
        self.fn, self.device = fn, device
        self.n, self.best_s = 0, float("inf")

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.fn(*args, **kwargs)
        sync(self.device)
        self.best_s = min(self.best_s, time.perf_counter() - t0)
        self.n += 1
        return out


def _per(d: dict, n: int) -> dict:
    return {k: v / n for k, v in sorted(d.items())}


def measure(fn, args, kwargs, device: str, warmup_rounds: int, run) -> tuple[object, dict]:
    """Warm `fn` up, then `run(rounds)` (which calls `rounds(*args, **kwargs)` as often as it
    likes); returns run's result and the figures per measured round."""
    rounds = Rounds(fn, device)
    t0 = time.perf_counter()
    first = ae.metrics()
    for _ in range(warmup_rounds):
        rounds(*args, **kwargs)
        if rounds.n == 1:
            first_ms = (time.perf_counter() - t0) * 1e3
    ae.wait_for_compiles()  # the executor `auto`'s background compiles
    warm = ae.metrics() - first
    rounds.n, rounds.best_s = 0, float("inf")
    before = ae.metrics()
    result = run(rounds)
    m = ae.metrics() - before
    n = rounds.n
    if n == 0:
        raise RuntimeError("neuron_benchmark: the benchmark ran no round of the function")
    info = {"rounds": n, "steady_step_ms": rounds.best_s * 1e3}
    if warmup_rounds:
        info.update(first_step_ms=first_ms, warmup_compiles=warm.compiles,
                    warmup_compile_ms_modeled=warm.compile_time_us / 1e3)
    if device == "cpu":
        with CountOps() as c:  # one more round, after the timing: the counting stays out of it
            rounds(*args, **kwargs)
        info.update(ops_per_step=c.n, host_us_per_op=rounds.best_s / c.n * 1e6 if c.n else None)
        return result, info
    ops = m.ops / n
    info.update(
        ops_per_step=ops,
        launches_per_step=m.launches / n,
        mean_group_size=round(m.mean_group_size, 3),
        flushes_per_step=_per(m.flushes, n),
        device_us_per_step=m.device_time_us / n,
        compiles_per_step=m.compiles / n,
        compile_ms_modeled_per_step=m.compile_time_us / 1e3 / n,
        cache_hits_per_step=(m.cache_memory_hits + m.cache_disk_hits) / n,
        plan_hits_per_step=m.plan_hits / n,
        cpu_fallbacks_per_step=_per(m.cpu_fallbacks, n),
        host_us_per_op=rounds.best_s / ops * 1e6 if ops else None,
        hbm_bytes_per_step=m.hbm_bytes / n,
        bytes_saved_per_step=m.bytes_saved / n,
    )
    return result, info


def figures(fn, device: str, rounds: int = 10, warmup_rounds: int = 2, args=(),
            kwargs=None) -> dict:
    """The figures `neuron_benchmark` records, without pytest-benchmark: `rounds` measured
    rounds of `fn` on `device`, inside a mode_scope (benchmarks/test_targets.py)."""
    def run(r):
        for _ in range(rounds):
            r(*args, **(kwargs or {}))
    return measure(fn, args, kwargs or {}, device, warmup_rounds, run)[1]


def compiler(mode: str):
    """What `neuron_benchmark.compile` does in `mode`: torch.compile(backend="neuron") in the
    compile mode, nothing in the others."""
    if mode != "compile":
        return lambda obj: obj
    return lambda obj: torch.compile(obj, backend="neuron")


class NeuronBenchmark:
    """The `neuron_benchmark` fixture: pytest-benchmark's `benchmark`, in one mode.

    `device` is "neuron" ("cpu" for the cpu mode), `mode` the mode's name. Call it as
    `benchmark`: `neuron_benchmark(fn, *args, **kwargs)` (pytest-benchmark chooses the
    rounds) or `neuron_benchmark.pedantic(fn, args, kwargs, rounds=...)`; each round ends
    with a sync, after `warmup_rounds` unmeasured rounds. In the compile mode the function
    runs through torch.compile(backend="neuron"), unless the test compiled what it wanted
    with `neuron_benchmark.compile(model)` (a model without its optimizer step, say)."""

    warmup_rounds = 2

    def __init__(self, benchmark, mode: str, realtime: bool = False, group: str | None = None):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        self.benchmark, self.mode = benchmark, mode
        self.device = MODES[mode][0]
        self.realtime = realtime and self.device != "cpu"
        self._compiled = False
        self._start = None
        if group is not None:
            benchmark.group = group
        benchmark.extra_info.update(mode=mode, device=self.device)

    @property
    def group(self) -> str | None:
        return self.benchmark.group

    @group.setter
    def group(self, name: str) -> None:
        self.benchmark.group = name

    @property
    def extra_info(self) -> dict:
        return self.benchmark.extra_info

    @contextlib.contextmanager
    def scope(self):
        """The test's body runs in the mode; metrics() counts from here."""
        with mode_scope(self.mode, self.realtime):
            self._start = ae.metrics()
            try:
                yield self
            finally:
                self._start = None

    def metrics(self) -> ae.Snapshot:
        """ae.metrics() since the mode's scope began (this test, this mode)."""
        if self._start is None:
            raise RuntimeError("neuron_benchmark.metrics() is read inside the test")
        return ae.metrics() - self._start

    def compile(self, obj):
        """torch.compile(obj, backend="neuron") in the compile mode, `obj` in the others."""
        self._compiled = self._compiled or self.mode == "compile"
        return compiler(self.mode)(obj)

    def _fn(self, fn):
        return fn if self._compiled else compiler(self.mode)(fn)

    def __call__(self, fn, *args, **kwargs):
        result, info = measure(self._fn(fn), args, kwargs, self.device, self.warmup_rounds,
                               lambda r: self.benchmark(r, *args, **kwargs))
        self.benchmark.extra_info.update(info)
        return result

    def pedantic(self, fn, args=(), kwargs=None, rounds=1, warmup_rounds=None, iterations=1):
        """As benchmark.pedantic (no setup or teardown); `warmup_rounds` are ours (unmeasured,
        default `self.warmup_rounds`)."""
        kwargs = kwargs or {}
        warm = self.warmup_rounds if warmup_rounds is None else warmup_rounds
        result, info = measure(
            self._fn(fn), args, kwargs, self.device, warm,
            lambda r: self.benchmark.pedantic(r, args=args, kwargs=kwargs, rounds=rounds,
                                              iterations=iterations))
        self.benchmark.extra_info.update(info)
        return result
