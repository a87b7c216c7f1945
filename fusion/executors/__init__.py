"""Executors: what runs a fused group's ops. See Note [Executors] in fusion/executors/tiered.py.

`interpreter` (default) runs the ops one after another on host memory, bit for bit eager;
`inductor` and `auto` hand the group's FX graph to TorchInductor (float tolerance)."""
from __future__ import annotations


EXECUTORS = ("interpreter", "inductor", "auto")


_made: dict[tuple, object] = {}  # one executor per setting: compiled groups outlive switches


def make_executor(name: str, tier_up: int = 3, cache_dir: str | None = None):
    """The executor called `name`, or None for the interpreter (the Runner's own path)."""
    if name not in EXECUTORS:
        raise ValueError(f"unknown executor {name!r}; choose one of {list(EXECUTORS)}")
    if name == "interpreter":
        return None
    key = (name, tier_up, cache_dir)
    if key not in _made:
        from .tiered import TieredExecutor
        _made[key] = TieredExecutor(blocking=name == "inductor", tier_up=tier_up,
                                    cache_dir=cache_dir)
    return _made[key]
