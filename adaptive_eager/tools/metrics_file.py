"""TORCH_NEURONX_METRICS_ENABLED=1: this process's metrics as JSON at exit, one file per
process in TORCH_NEURONX_METRICS_DIR (default: the working folder), named with the pid and,
under torch.distributed, the rank. `python -m adaptive_eager run` reads these files."""
from __future__ import annotations

import atexit
import dataclasses
import glob
import json
import os
import sys
import time

PREFIX = "neuron_metrics"
_T0 = time.perf_counter()


def _rank() -> int | None:
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # a half-torn-down process group at exit: fall back to the env
        pass
    r = os.environ.get("RANK")
    return int(r) if r is not None and r.isdigit() else None


def filename(pid: int, rank: int | None) -> str:
    return f"{PREFIX}_{'' if rank is None else f'rank{rank}_'}pid{pid}.json"


def collect() -> dict:
    """Everything the file holds: metrics(), compile-mode counters, process identity, the
    50 lines with the most device time (ae.line_report()), the shape churn and the time to
    steady state."""
    import adaptive_eager as ae
    from ..integration import compile as _compile
    from . import lines as _lines
    from . import steps as _steps
    rank = _rank()
    return {
        "pid": os.getpid(), "rank": rank, "argv": sys.argv,
        "wall_s": time.perf_counter() - _T0,
        "metrics": dataclasses.asdict(ae.metrics()),
        "compile": _compile.STATS.as_dict(),
        "lines": ae.line_report().rows[:50],
        "churn": _lines.churn(),
        "steps": _steps.summary(),
    }


def write(directory: str = "") -> str:
    """Write the file now; returns its path (atomic: written aside, then renamed)."""
    data = collect()
    directory = directory or os.getcwd()
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, filename(data["pid"], data["rank"]))
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)
    return path


def read_all(directory: str) -> list[dict]:
    """Every metrics file in a folder (what `run` aggregates)."""
    out = []
    for p in sorted(glob.glob(os.path.join(directory, PREFIX + "_*.json"))):
        with open(p) as f:
            out.append(json.load(f))
    return out


def _at_exit() -> None:
    from ..engine import engine as _engine
    from ..config import config
    try:
        _engine.ENGINE.sync("exit")  # what is still queued counts too
    except Exception:
        pass  # reported by the package's own exit flush
    try:
        write(config.metrics_dir)
    except Exception as e:  # never crash the interpreter's shutdown
        print(f"adaptive_eager: could not write the metrics file: {e}", file=sys.stderr)


def install() -> None:
    """Write the file at exit when TORCH_NEURONX_METRICS_ENABLED=1 (read at import)."""
    from ..config import config
    if config.metrics_enabled:
        atexit.register(_at_exit)
        from . import steps
        steps.install()  # Note [Time to steady state]
