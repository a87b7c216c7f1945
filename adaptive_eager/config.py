"""Every setting, declared once: typed default, environment variable, effect.

Names follow the reference (adaptive_eager/REFERENCE.md); our own carry the ADAPTIVE_EAGER_
prefix. The environment is read once, at import. Tests change settings with `ae.override(...)` (the
engine applies them), never by editing os.environ mid-run. This module imports nothing of
the engine.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile

DEVICE_TYPE = "neuron"  # the device's name: torch.device(DEVICE_TYPE) once registered


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
        lo, hi = int(lo), int(hi or lo)
        if hi < lo:
            raise ValueError(f"the range {part.strip()!r} goes down (write {hi}-{lo})")
        cores.extend(range(lo, hi + 1))
    return tuple(cores)


def _setting(var: str, default, parse, doc: str, least=None):
    """A Config field: default, the environment variable that sets it, parser, effect, and
    for numbers the least value that makes sense."""
    return dataclasses.field(default=default, metadata={"var": var, "parse": parse, "doc": doc,
                                                        "least": least})


_TYPES = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,),
          "tuple[int, ...]": (tuple,)}


def check(name: str, value) -> None:
    """Refuse a value of the wrong type or out of range for setting `name`, naming it (a
    string where a number was due failed later, inside an op, as "unsupported operand")."""
    f = next(f for f in dataclasses.fields(Config) if f.name == name)
    kinds = [k.strip() for k in str(f.type).split("|")]
    if value is None and "None" in kinds:
        return
    types = tuple(t for k in kinds for t in _TYPES.get(k, ()))
    least = f.metadata["least"]
    ok = isinstance(value, types) and (bool not in types) == (not isinstance(value, bool))
    if ok and isinstance(value, (int, float)) and not isinstance(value, bool):
        ok = value == value and (least is None or value >= least)  # (nan != nan)
    if not ok:
        want = " or ".join(kinds) + (f", at least {least}" if least is not None else "")
        raise ValueError(f"setting {name} ({f.metadata['var']}) must be {want}, got "
                         f"{value!r}: {f.metadata['doc']}")


@dataclasses.dataclass
class Config:
    """Every setting, declared once (field = default + env var + parser + effect)."""

    adaptive: bool = _setting(
        "TORCH_NEURONX_ENABLE_CONCATENATION", False, _flag_exact_1,
        "adaptive eager (lazy queue + fusion) on at start-up when exactly '1'")
    queue_low_threshold: int = _setting(
        "TORCH_NEURONX_CONCATENATION_QUEUE_LOW_THRESHOLD", 15, int,
        "flush at the next natural cut while no more than this many launches are in flight",
        least=0)
    buffer_size_limit: int = _setting(
        "TORCH_NEURONX_CONCATENATION_BUFFER_SIZE_LIMIT", 1024, int,
        "max ops queued before a forced flush", least=1)
    replay: bool = _setting(
        "ADAPTIVE_EAGER_REPLAY", True, _flag_not_0,
        "'0' turns Note [Replay] off: every op takes the slow path (templates, meta lookup, "
        "online grouping); results and launches are the same either way")
    check_replay: bool = _setting(
        "ADAPTIVE_EAGER_CHECK_REPLAY", False, _flag_exact_1,
        "'1': every replayed op is checked against the slow path (same cache key, buffers, "
        "runtime values and cut; an AssertionError if not): for tests, slow")
    skip_intermediate: bool = _setting(
        "TORCH_NEURONX_APPLY_SKIP_INTERMEDIATE", True, _flag_not_0,
        "do not write back values whose tensors were all freed before the flush")
    cache_dir: str = _setting(
        "TORCH_NEURONX_NEFF_CACHE_DIR", os.path.join(tempfile.gettempdir(), "neff_cache"), str,
        "on-disk executable cache")
    disable_disk_cache: bool = _setting(
        "TORCH_NEURONX_NEFF_DISABLE_CACHE", False, _flag_exact_1,
        "'1' turns the on-disk cache off")
    cache_max_entries: int | None = _setting(
        "NEURON_COMPILATION_CACHE_MAX_ENTRIES", None, _opt_int,
        "in-memory cache entry bound (LRU evicts to 80%)", least=1)
    cache_max_mb: float | None = _setting(
        "NEURON_COMPILATION_CACHE_MAX_SIZE_MB", None, _opt_float,
        "in-memory cache size bound in MiB (LRU evicts to 80%)", least=0)
    launch_blocking: bool = _setting(
        "NEURON_LAUNCH_BLOCKING", False, _flag_exact_1,
        "every launch synchronous; errors raised at the op (adaptive mode queues nothing)")
    fallback_enabled: bool = _setting(
        "NEURON_FALLBACK_ENABLED", True, _flag_not_0,
        "CPU fallback for ops the device lacks ('0' raises instead)")
    native: bool = _setting(
        "ADAPTIVE_EAGER_NATIVE", True, _flag_not_0,
        "the native hooks (device guard, pinned memory, generators; built with the C++ "
        "compiler at first import): '0' goes without them")
    stack_trace: bool = _setting(
        "TORCH_NEURONX_ENABLE_STACK_TRACE", False, _flag_exact_1,
        "record each op's full Python stack for error reports")
    log_level: int = _setting(
        "TORCH_NEURONX_LOG_LEVEL", 1, int,
        "logger 'adaptive_eager': 0 error, 1 warning, 2 info (a line per flush and compile), "
        "3 debug (every boundary)", least=0)
    log_file: str = _setting(
        "TORCH_NEURONX_LOG_FILE", "", str, "log to this file instead of stderr")
    strategy: str = _setting(
        "ADAPTIVE_EAGER_FUSION_STRATEGY", "graph", str,
        "fusion strategy in adaptive mode at start-up: graph, matmul or none")
    max_group_ops: int = _setting(
        "ADAPTIVE_EAGER_MAX_GROUP_OPS", 128, int, "max ops in one fused group", least=1)
    max_group_contractions: int = _setting(
        "ADAPTIVE_EAGER_MAX_GROUP_CONTRACTIONS", 4, int,
        "max contractions (matmul/conv) in one fused group of the graph strategy", least=0)
    max_pending_mb: float = _setting(
        "ADAPTIVE_EAGER_MAX_PENDING_MB", 1024.0, float,
        "flush when queued (not yet written) values exceed this many MiB", least=0)
    substitute: bool = _setting(
        "ADAPTIVE_EAGER_SUBSTITUTE", False, _flag_exact_1,
        "'1': adaptive mode launches the kernel library's flash_attention / rms_norm for "
        "hand-written attention and RMSNorm whose intermediates nothing else needs (attention's "
        "forward and backward together when one flush holds both), and for "
        "scaled_dot_product_attention (Note [Substitution])")
    realtime: bool = _setting(
        "ADAPTIVE_EAGER_REALTIME", False, _flag_exact_1,
        "each launch also takes its modeled time on the wall clock (wall-clock benchmarks)")
    executor: str = _setting(
        "ADAPTIVE_EAGER_EXECUTOR", "interpreter", str,
        "what runs fused groups: interpreter (bit for bit eager), inductor (TorchInductor, "
        "compiled before first launch) or auto (interpreted, compiled in background when hot)")
    tier_up: int = _setting(
        "ADAPTIVE_EAGER_TIER_UP", 3, int,
        "executor auto: launches of a group before it is compiled in the background", least=1)
    visible_cores: tuple[int, ...] | None = _setting(
        "NEURON_RT_VISIBLE_CORES", None, _core_list,
        "the chip's NeuronCores this process sees ('0-1', '2', '0,3'), numbered neuron:0..")
    num_cores: int | None = _setting(
        "NEURON_RT_NUM_CORES", None, _opt_int,
        "how many NeuronCores this process sees (when NEURON_RT_VISIBLE_CORES is unset)", least=1)
    metrics_enabled: bool = _setting(
        "TORCH_NEURONX_METRICS_ENABLED", False, _flag_exact_1,
        "'1': write this process's metrics as JSON at exit (one file per process)")
    frameworks: bool = _setting(
        "ADAPTIVE_EAGER_FRAMEWORKS", True, _flag_not_0,
        "'0': Hugging Face Transformers, accelerate, TRL and PEFT do not find the neuron "
        "device (the import name `torch_neuronx` is not answered) and train on the CPU")
    metrics_dir: str = _setting(
        "TORCH_NEURONX_METRICS_DIR", "", str,
        "folder of the metrics files (default: the working folder)")

    @classmethod
    def from_env(cls, env=os.environ) -> "Config":
        kw = {}
        for f in dataclasses.fields(cls):
            raw = env.get(f.metadata["var"])
            if raw is None:
                continue
            try:
                kw[f.name] = f.metadata["parse"](raw)
            except ValueError as e:
                raise ValueError(f"{f.metadata['var']}={raw!r} is not valid ({e}): "
                                 f"{f.metadata['doc']}") from None
            try:
                check(f.name, kw[f.name])
            except ValueError as e:
                raise ValueError(f"{f.metadata['var']}={raw!r} is not valid: {e}") from None
        return cls(**kw)


def describe() -> str:
    """One line per setting: env var, current value, effect."""
    return "\n".join(f"{f.metadata['var']:52} {getattr(config, f.name)!r:>12}  "
                     f"{f.metadata['doc']}" for f in dataclasses.fields(Config))


config = Config.from_env()


def configure_logging() -> None:
    """The 'adaptive_eager' logger's level and destination, from the settings."""
    import logging
    log = logging.getLogger("adaptive_eager")
    log.setLevel({0: logging.ERROR, 1: logging.WARNING, 2: logging.INFO}.get(
        config.log_level, logging.DEBUG))
    if not log.handlers:
        try:
            h = logging.FileHandler(config.log_file) if config.log_file \
                else logging.StreamHandler()
        except OSError as e:
            raise ValueError(f"TORCH_NEURONX_LOG_FILE={config.log_file!r} cannot be opened "
                             f"({e.strerror}): name a file in an existing folder") from None
        h.setFormatter(logging.Formatter("[%(name)s %(levelname)s] %(message)s"))
        log.addHandler(h)
        log.propagate = False


configure_logging()
