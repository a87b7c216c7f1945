"""`torch.neuron`: the device module, shaped like `torch.cuda`."""
from __future__ import annotations

import contextlib
import itertools
import typing

import torch

from ..engine import cores

def _E(device=None):
    """The engine of core `device` (the current core by default)."""
    return cores.engine(device)


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


# torch.utils.checkpoint (and so Transformers' gradient checkpointing) saves a device's RNG
# state for the recomputation only if its module says `_initialized`, as torch.cuda does;
# without it a recomputed dropout draws a new mask and the gradient is silently wrong.
_initialized = True


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return cores.count()


def current_device() -> int:
    return cores.current()  # Note [Cores] in cores.py


def _check(device) -> int:
    return cores.check(device)


def set_device(device) -> None:
    cores.set_current(device)


def get_amp_supported_dtype() -> list[torch.dtype]:
    """torch.autocast(device_type="neuron", dtype=...) accepts these (BF16 first, as Neuron)."""
    return [torch.bfloat16, torch.float16]


def get_device_name(device=None) -> str:
    _check(device)
    return "Simulated NeuronCore (adaptive-eager)"


class _DeviceProperties(typing.NamedTuple):
    """`torch.neuron.get_device_properties(i)`: the fields scripts read from CUDA's."""
    name: str
    total_memory: int  # HBM bytes of the core
    multi_processor_count: int  # the core's engines (the simulator models one queue)
    type: str = "neuron"


def get_device_properties(device=None) -> _DeviceProperties:
    eng = _E(device)
    return _DeviceProperties(get_device_name(eng.index), eng.spec.hbm_bytes, 1)


def synchronize(device=None) -> None:
    """Wait for all work queued on a core; raise its earliest deferred device error."""
    _E(device).sync("synchronize")


# -- random ----------------------------------------------------------------------------
def manual_seed(seed: int) -> None:
    """Seed the current core's generator."""
    _E().flush("rng")  # queued random ops keep the state they were issued under
    _E().device.rng.manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    """Seed every core's generator (`torch.manual_seed` calls this); cores first used later
    start from core 0's seed (`_engine.core`)."""
    for eng in cores.engines():
        eng.flush("rng")
        eng.device.rng.manual_seed(int(seed))


def seed() -> None:
    manual_seed(torch.seed())


def seed_all() -> None:
    manual_seed_all(torch.seed())


def initial_seed() -> int:
    return _E().device.rng.seed


def get_rng_state(device=None) -> torch.Tensor:
    eng = _E(device)
    eng.flush("rng")
    return eng.device.rng.state.clone()


def set_rng_state(state: torch.Tensor, device=None) -> None:
    eng = _E(device)
    eng.flush("rng")
    eng.device.rng.state = state.clone()


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(k) for k in range(cores.count())]


def set_rng_state_all(states) -> None:
    for k, state in enumerate(states):
        set_rng_state(state, k)


# -- memory ----------------------------------------------------------------------------
def memory_allocated(device=None) -> int:
    return _E(device).device.hbm.used


def max_memory_allocated(device=None) -> int:
    return _E(device).device.hbm.peak


memory_reserved = memory_allocated
max_memory_reserved = max_memory_allocated


def reset_peak_memory_stats(device=None) -> None:
    hbm = _E(device).device.hbm
    hbm.peak = hbm.used


def memory_stats(device=None) -> dict:
    return _E(device).device.hbm.stats()


def mem_get_info(device=None) -> tuple[int, int]:
    hbm = _E(device).device.hbm
    return hbm.capacity - hbm.used, hbm.capacity


def empty_cache() -> None:
    """Flush queued work so that freed intermediates release their memory."""
    _E().flush("empty_cache")


# -- streams and events (one hardware queue: order is always kept) ----------------------
_ids = itertools.count(1)


class Stream:
    """A neuron stream. Streams multiplex onto the one hardware queue (as the reference):
    they keep order and event semantics; a change of stream is a fusion boundary."""

    def __init__(self, device=None, priority: int = 0, _id: int | None = None):
        self.device = torch.device("neuron", _check(device))
        self.priority = priority
        self.stream_id = next(_ids) if _id is None else _id

    def wait_event(self, event: "Event") -> None:
        _E().flush("event")

    def wait_stream(self, stream: "Stream") -> None:
        _E().flush("event")

    def record_event(self, event: "Event | None" = None) -> "Event":
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        _E().flush("stream query")
        dev = _E().device
        return dev.free_at_us <= dev.host_us

    def synchronize(self) -> None:
        _E().sync("stream sync")

    def __eq__(self, other):
        return isinstance(other, Stream) and other.stream_id == self.stream_id

    def __hash__(self):
        return hash(("neuron", self.stream_id))

    def __repr__(self):
        return f"<torch.neuron.Stream device={self.device} stream_id={self.stream_id}>"


_default_stream = None  # made by _start_streams once `neuron` is a device type
_current: list = []


def _start_streams() -> None:
    """The default stream, current until another is set (registration calls this)."""
    global _default_stream
    _default_stream = Stream(_id=0)
    _current.append(_default_stream)


def default_stream(device=None) -> Stream:
    _check(device)
    return _default_stream


def current_stream(device=None) -> Stream:
    _check(device)
    return _current[-1]


@contextlib.contextmanager
def stream(s: Stream | None):
    """Issue ops on `s` inside the block. Switching streams flushes (a boundary)."""
    if s is None:
        yield
        return
    if s != _current[-1]:
        _E().flush("stream switch")
    _current.append(s)
    try:
        yield
    finally:
        _current.pop()
        if s != _current[-1]:
            _E().flush("stream switch")


def set_stream(s: Stream) -> None:
    if s != _current[-1]:
        _E().flush("stream switch")
    _current[-1] = s


class Event:
    """An event on the simulated timeline; `elapsed_time` reads the simulated clock (ms)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        self.enable_timing = enable_timing
        self.time_us: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        _E().flush("event")
        self.time_us = _E().device.free_at_us
        self.core = _E().index

    def wait(self, stream: Stream | None = None) -> None:
        _E().flush("event")

    def query(self) -> bool:
        return self.time_us is None or self.time_us <= _E().device.host_us

    def synchronize(self) -> None:
        if self.time_us is not None:
            _E().sync("event sync")

    def elapsed_time(self, end: "Event") -> float:
        if self.time_us is None or end.time_us is None:
            raise RuntimeError("Both events must be recorded before calling elapsed_time()")
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Both events need enable_timing=True for elapsed_time()")
        if self.core != end.core:  # each core has its own clock
            raise ValueError(f"Both events must be recorded on the same device: neuron:"
                             f"{self.core} and neuron:{end.core}")
        return (end.time_us - self.time_us) / 1e3


@contextlib.contextmanager
def device(d):
    """`with torch.neuron.device(k):` core k is the current one inside (None: unchanged)."""
    old = cores.current()
    if d is not None:
        cores.set_current(d)
    try:
        yield
    finally:
        cores.set_current(old)
