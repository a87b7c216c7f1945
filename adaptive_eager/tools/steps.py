"""Time to steady state: the modeled time of a training run's first steps, compile time
included, and the step after which nothing compiles again.

Note [Time to steady state]: a step ends at each `optimizer.step()` (torch's global
optimizer-step hooks, so an unchanged script is measured): eager, when it returns; adaptive,
when the next step starts (or the report is made), as its queued work is launched (and
compiled) at the sync after it, usually before the next step. At each, the simulated clock (per
core, the later of the host clock, which the compiler's modeled time and each op's host
overhead advance, and the time the device finishes what it was given; the latest core) and
the compiles so far are kept. Steady state starts after the last step that compiled; the
report gives the modeled time up to it (of which compiling) and the median step after it.
A step that compiled only because the queue was flushed at another point than before still
counts: it is a compile the run paid for.
"""
from __future__ import annotations

import statistics

from device import COUNTERS

from ..engine import engine as _engine

MAX_STEPS = 100_000
_STEPS: list = []  # (clock us, compiles, compile us) at the end of each step
_START: list = [None]  # the same at the start of the first step
_HOOK: list = [None]
_PENDING = [False]  # a step ended in lazy mode, its point not taken yet


def clock_us() -> float:
    """The simulated clock: the latest core's max(host clock, device done)."""
    return max((max(e.device.host_us, e.device.free_at_us) for e in _engine.ENGINES),
               default=0.0)


def _now():
    return (clock_us(), COUNTERS.compiles, COUNTERS.compile_time_us)


def _post_hook(optimizer, args, kwargs) -> None:
    if _engine.ENGINE.is_lazy():  # its work is still queued: ends at the next step
        _PENDING[0] = True
    elif len(_STEPS) < MAX_STEPS:
        _STEPS.append(_now())


def _pre_hook(optimizer, args, kwargs) -> None:
    if _PENDING[0]:
        _PENDING[0] = False
        if len(_STEPS) < MAX_STEPS:
            _STEPS.append(_now())


def install() -> None:
    """Keep each optimizer step's figures from now on (again: starts over)."""
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)
    _STEPS.clear()
    _PENDING[0] = False
    _START[0] = _now()
    if _HOOK[0] is None:
        _HOOK[0] = (register_optimizer_step_pre_hook(_pre_hook),
                    register_optimizer_step_post_hook(_post_hook))


def uninstall() -> None:
    if _HOOK[0] is not None:
        for h in _HOOK[0]:
            h.remove()
        _HOOK[0] = None


def summary(steps=None, start=None) -> dict | None:
    """{steps, steady_from (the first step after the last that compiled, 1-based; None if
    the last step compiled), warm_ms (modeled time until then), warm_compile_ms,
    warm_compiles, steady_step_ms (median step after it; None if none), total_ms}."""
    if steps is None:
        steps = _STEPS + ([_now()] if _PENDING[0] else [])
    steps = list(steps)
    start = _START[0] if start is None else start
    if not steps or start is None:
        return None
    points = [tuple(start)] + [tuple(s) for s in steps]
    last = max((i for i in range(1, len(points)) if points[i][1] > points[i - 1][1]),
               default=0)  # the last step that compiled (0: none)
    steady = None if last == len(steps) else last + 1
    end = points[last]
    deltas = [points[i][0] - points[i - 1][0] for i in range(last + 1, len(points))]
    return {"steps": len(steps), "steady_from": steady,
            "warm_ms": (end[0] - start[0]) / 1e3,
            "warm_compile_ms": (end[2] - start[2]) / 1e3, "warm_compiles": end[1] - start[1],
            "steady_step_ms": statistics.median(deltas) / 1e3 if deltas else None,
            "total_ms": (points[-1][0] - start[0]) / 1e3}


def sentence(s: dict | None) -> str:
    if not s:
        return ""
    if s["steady_from"] is None:
        return (f"compiles did not stop: step {s['steps']} of {s['steps']} still compiled; "
                f"the {s['steps']} steps took {s['total_ms']:.1f} ms modeled "
                f"({s['warm_compile_ms']:.1f} ms of it compiling, {s['warm_compiles']} "
                f"compiles)")
    k = s["steady_from"] - 1
    n = s["warm_compiles"]
    first = ("no step compiled" if not k else
             f"the first {f'{k} steps' if k > 1 else 'step'} took {s['warm_ms']:.1f} ms "
             f"modeled ({s['warm_compile_ms']:.1f} ms of it compiling, {n} "
             f"compile{'s' if n != 1 else ''})")
    return (f"steady state from step {s['steady_from']} of {s['steps']}: {first}; a steady "
            f"step takes {s['steady_step_ms']:.3f} ms modeled")
