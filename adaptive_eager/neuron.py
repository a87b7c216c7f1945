"""`torch.neuron`: the device module, shaped like `torch.cuda`."""
from __future__ import annotations

import contextlib
import itertools

import torch

from . import _engine, cores

_E = lambda: _engine.ENGINE  # noqa: E731  (the engine may be rebuilt by tests)


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return cores.count()


def current_device() -> int:
    return 0  # Note [One core per process] in cores.py


def _check(device) -> int:
    return cores.check(device)  # Note [One core per process] in cores.py


def set_device(device) -> None:
    _check(device)


def get_amp_supported_dtype() -> list[torch.dtype]:
    """torch.autocast(device_type="neuron", dtype=...) accepts these (BF16 first, as Neuron)."""
    return [torch.bfloat16, torch.float16]


def get_device_name(device=None) -> str:
    _check(device)
    return "Simulated NeuronCore (adaptive-eager)"


def synchronize(device=None) -> None:
    """Wait for all queued work; raise the earliest deferred device error."""
    _check(device)
    _E().sync("synchronize")


# -- random ----------------------------------------------------------------------------
def manual_seed(seed: int) -> None:
    _E().flush("rng")  # queued random ops keep the state they were issued under
    _E().device.rng.manual_seed(int(seed))


manual_seed_all = manual_seed


def seed() -> None:
    manual_seed(torch.seed())


seed_all = seed


def initial_seed() -> int:
    return _E().device.rng.seed


def get_rng_state(device=None) -> torch.Tensor:
    _check(device)
    _E().flush("rng")
    return _E().device.rng.state.clone()


def set_rng_state(state: torch.Tensor, device=None) -> None:
    _check(device)
    _E().flush("rng")
    _E().device.rng.state = state.clone()


get_rng_state_all = lambda: [get_rng_state()]  # noqa: E731
set_rng_state_all = lambda states: set_rng_state(states[0])  # noqa: E731


# -- memory ----------------------------------------------------------------------------
def memory_allocated(device=None) -> int:
    _check(device)
    return _E().device.hbm.used


def max_memory_allocated(device=None) -> int:
    _check(device)
    return _E().device.hbm.peak


memory_reserved = memory_allocated
max_memory_reserved = max_memory_allocated


def reset_peak_memory_stats(device=None) -> None:
    _check(device)
    hbm = _E().device.hbm
    hbm.peak = hbm.used


def memory_stats(device=None) -> dict:
    _check(device)
    return _E().device.hbm.stats()


def mem_get_info(device=None) -> tuple[int, int]:
    _check(device)
    hbm = _E().device.hbm
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
        _check(device)
        self.device = _engine.DEVICE
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
        return f"<torch.neuron.Stream device=neuron:0 stream_id={self.stream_id}>"


_default_stream = None  # made by _registration once `neuron` is a device type
_current: list = []


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
        return (end.time_us - self.time_us) / 1e3


@contextlib.contextmanager
def device(d):
    _check(d)
    yield
