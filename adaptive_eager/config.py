"""Every setting, declared once: typed default, environment variable, effect.

Names follow the reference (TORCHNEURON.md); our own carry the ADAPTIVE_EAGER_ prefix. The
environment is read once, at import. Tests change settings with `config.override(...)`,
never by editing os.environ mid-run.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile


def _flag_exact_1(v: str) -> bool:  # the reference turns features on only for exactly "1"
    return v == "1"


def _flag_not_0(v: str) -> bool:
    return v != "0"


def _opt_int(v: str) -> int | None:
    return int(v) if v else None


def _opt_float(v: str) -> float | None:
    return float(v) if v else None


def _core_list(v: str) -> tuple[int, ...] | None:
    """The Neuron runtime's forms: '0-1' (a range), '2', '0,3' (a list)."""
    if not v:
        return None
    cores = []
    for part in v.split(","):
        lo, _, hi = part.strip().partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(cores)


_SETTINGS: list[tuple[str, str, object, callable, str]] = [
    # (field, env var, default, parser, effect)
    ("adaptive", "TORCH_NEURONX_ENABLE_CONCATENATION", False, _flag_exact_1,
     "adaptive eager (lazy queue + fusion) on at start-up when exactly '1'"),
    ("queue_low_threshold", "TORCH_NEURONX_CONCATENATION_QUEUE_LOW_THRESHOLD", 15, int,
     "flush at the next natural cut while no more than this many launches are in flight"),
    ("buffer_size_limit", "TORCH_NEURONX_CONCATENATION_BUFFER_SIZE_LIMIT", 1024, int,
     "max ops queued before a forced flush"),
    ("skip_intermediate", "TORCH_NEURONX_APPLY_SKIP_INTERMEDIATE", True, _flag_not_0,
     "do not write back values whose tensors were all freed before the flush"),
    ("cache_dir", "TORCH_NEURONX_NEFF_CACHE_DIR",
     os.path.join(tempfile.gettempdir(), "neff_cache"), str, "on-disk executable cache"),
    ("disable_disk_cache", "TORCH_NEURONX_NEFF_DISABLE_CACHE", False, _flag_exact_1,
     "'1' turns the on-disk cache off"),
    ("cache_max_entries", "NEURON_COMPILATION_CACHE_MAX_ENTRIES", None, _opt_int,
     "in-memory cache entry bound (LRU evicts to 80%)"),
    ("cache_max_mb", "NEURON_COMPILATION_CACHE_MAX_SIZE_MB", None, _opt_float,
     "in-memory cache size bound in MiB (LRU evicts to 80%)"),
    ("launch_blocking", "NEURON_LAUNCH_BLOCKING", False, _flag_exact_1,
     "every launch synchronous; errors raised at the op"),
    ("fallback_enabled", "NEURON_FALLBACK_ENABLED", True, _flag_not_0,
     "CPU recovery when a device op cannot run ('0' raises)"),
    ("stack_trace", "TORCH_NEURONX_ENABLE_STACK_TRACE", False, _flag_exact_1,
     "record each op's full Python stack for error reports"),
    ("log_level", "TORCH_NEURONX_LOG_LEVEL", 1, int,
     "logger 'adaptive_eager': 0 error, 1 warning, 2 info (a line per flush and compile), "
     "3 debug (every boundary)"),
    ("log_file", "TORCH_NEURONX_LOG_FILE", "", str, "log to this file instead of stderr"),
    ("strategy", "ADAPTIVE_EAGER_FUSION_STRATEGY", "graph", str,
     "fusion strategy in adaptive mode: graph, matmul or none"),
    ("max_group_ops", "ADAPTIVE_EAGER_MAX_GROUP_OPS", 128, int, "max ops in one fused group"),
    ("max_group_contractions", "ADAPTIVE_EAGER_MAX_GROUP_CONTRACTIONS", 4, int,
     "max contractions (matmul/conv) in one fused group of the graph strategy"),
    ("max_pending_mb", "ADAPTIVE_EAGER_MAX_PENDING_MB", 1024.0, float,
     "flush when queued (not yet written) values exceed this many MiB"),
    ("realtime", "ADAPTIVE_EAGER_REALTIME", False, _flag_exact_1,
     "each launch also takes its modeled time on the wall clock (wall-clock benchmarks)"),
    ("visible_cores", "NEURON_RT_VISIBLE_CORES", None, _core_list,
     "the chip's NeuronCores this process sees ('0-1', '2', '0,3'), numbered neuron:0.."),
    ("num_cores", "NEURON_RT_NUM_CORES", None, _opt_int,
     "how many NeuronCores this process sees (when NEURON_RT_VISIBLE_CORES is unset)"),
]


@dataclasses.dataclass
class Config:
    adaptive: bool = False
    queue_low_threshold: int = 15
    buffer_size_limit: int = 1024
    skip_intermediate: bool = True
    cache_dir: str = ""
    disable_disk_cache: bool = False
    cache_max_entries: int | None = None
    cache_max_mb: float | None = None
    launch_blocking: bool = False
    fallback_enabled: bool = True
    stack_trace: bool = False
    log_level: int = 1
    log_file: str = ""
    strategy: str = "graph"
    max_group_ops: int = 128
    max_group_contractions: int = 4
    max_pending_mb: float = 1024.0
    realtime: bool = False
    visible_cores: tuple[int, ...] | None = None
    num_cores: int | None = None

    @classmethod
    def from_env(cls, env=os.environ) -> "Config":
        kw = {}
        for field, var, default, parse, _ in _SETTINGS:
            raw = env.get(var)
            try:
                kw[field] = default if raw is None else parse(raw)
            except ValueError:
                raise ValueError(f"{var}={raw!r} is not valid: {_doc(field)}") from None
        return cls(**kw)


def _doc(field: str) -> str:
    return next(s[4] for s in _SETTINGS if s[0] == field)


def describe() -> str:
    """One line per setting: env var, current value, effect."""
    return "\n".join(f"{var:52} {getattr(config, f)!r:>12}  {doc}"
                     for f, var, _, _, doc in _SETTINGS)


config = Config.from_env()


def configure_logging() -> None:
    """The 'adaptive_eager' logger's level and destination, from the settings."""
    import logging
    log = logging.getLogger("adaptive_eager")
    log.setLevel({0: logging.ERROR, 1: logging.WARNING, 2: logging.INFO}.get(
        config.log_level, logging.DEBUG))
    if not log.handlers:
        h = logging.FileHandler(config.log_file) if config.log_file else logging.StreamHandler()
        h.setFormatter(logging.Formatter("[%(name)s %(levelname)s] %(message)s"))
        log.addHandler(h)
        log.propagate = False


configure_logging()


@contextlib.contextmanager
def override(**changes):
    """Temporarily change settings (tests). Engines re-read what they cache on exit."""
    from . import _engine
    for k in changes:
        if not hasattr(config, k):
            raise AttributeError(f"no setting named {k!r}; see adaptive_eager.config.describe()")
    old = {k: getattr(config, k) for k in changes}
    _engine.ENGINE.flush("config")
    for k, v in changes.items():
        setattr(config, k, v)
    _engine.ENGINE.reconfigure()
    try:
        yield config
    finally:
        _engine.ENGINE.flush("config")
        for k, v in old.items():
            setattr(config, k, v)
        _engine.ENGINE.reconfigure()
