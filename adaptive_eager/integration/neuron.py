"""`torch.neuron`: the device module, shaped like `torch.cuda`; which NeuronCores a process
sees, and the current one.

Note [Cores]: the simulated chip has `DeviceSpec.chip_cores` logical cores (4 by default);
NEURON_RT_VISIBLE_CORES / NEURON_RT_NUM_CORES restrict what a process sees, numbered
neuron:0..n-1 as the Neuron runtime does, and `device_count()` reports that. Each core has
its own engine (`_engine.core(k)`: queue, meta and executable caches) and its own simulated
device (hardware queue, clock, HBM share, RNG), made on first use; one lock serializes them
all (Note [Threads]). A tensor's ops go to its core's engine; an op mixing cores raises
CUDA's error; a copy between cores is a costed DMA on each side (transfer.py).

PyTorch's Python device guard for PrivateUse1 (torch/csrc/acc/Module.cpp) reports one device,
and autograd sizes its per-device worker threads from it: a backward on neuron:1 would fail an
internal assert there. Backward runs with autograd's multithreading off (`torch.autograd.
set_multithreading_enabled(False)`, public API; also for CPU's order of a double backward):
the whole backward runs on the calling thread, every core included (registration.py).
The current core (`torch.neuron.set_device`, `torch.neuron.device(k)`) is per thread as CUDA's
with the native hooks (Note [Native hooks] in integration/native.py: the C++ device guard holds
it), per process without them.
"""
from __future__ import annotations

import contextlib
import itertools
import typing

import torch

from ..engine import engine as _engine


def _E(device=None):
    """The engine of core `device` (the current core by default), checked."""
    return _engine.core(_check(device))


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
    """How many NeuronCores this process sees (the chip's, or NEURON_RT_* restrictions)."""
    return _engine.visible_cores()


def current_device() -> int:
    return _engine.current_index()  # Note [Cores]


def _check(device) -> int:
    """The core index `device` names (None, or "neuron" with no index: the current one), if
    this process sees that core."""
    if device is None:
        return _engine.current_index()
    if isinstance(device, (str, torch.device)) and torch.device(device).type != "neuron":
        raise ValueError(f"expected a neuron device, got {device!r}")
    idx = device if isinstance(device, int) else torch.device(device).index
    if idx is None:
        return _engine.current_index()
    return _engine.check_core(idx)


def set_device(device) -> None:
    _engine.set_current(_check(device))


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
    major: int = 3  # get_device_capability()
    minor: int = 0


def get_device_properties(device=None) -> _DeviceProperties:
    eng = _E(device)
    return _DeviceProperties(get_device_name(eng.index), eng.spec.hbm_bytes, 1)


def synchronize(device=None) -> None:
    """Wait for all work queued on a core; raise its earliest deferred device error."""
    _E(device).sync("synchronize")


# -- random ----------------------------------------------------------------------------
def manual_seed(seed: int) -> None:
    """Seed the current core's generator."""
    seed = int(seed)
    _E().with_rng(lambda rng: rng.manual_seed(seed))


def manual_seed_all(seed: int) -> None:
    """Seed every core's generator (`torch.manual_seed` calls this); cores first used later
    start from core 0's seed (`_engine.core`)."""
    seed = int(seed)
    for eng in list(_engine.ENGINES):
        eng.with_rng(lambda rng: rng.manual_seed(seed))


def seed() -> None:
    manual_seed(torch.seed())


def seed_all() -> None:
    manual_seed_all(torch.seed())


# Each core's default generator, as torch.cuda.default_generators: its state is the core's
# device RNG (get_rng_state). Made by the native hooks (Note [Native hooks]); empty without.
default_generators: tuple = ()


def initial_seed() -> int:
    return _E().device.rng.seed


def get_rng_state(device=None) -> torch.Tensor:
    return _E(device).with_rng(lambda rng: rng.state)  # (a copy)


def set_rng_state(state: torch.Tensor, device=None) -> None:
    def set_state(rng):
        rng.state = state  # (the generator copies it)
    _E(device).with_rng(set_state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(k) for k in range(device_count())]


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
# Note [Streams]: a neuron stream is a `torch.Stream` (PyTorch's own stream type, as
# `torch.cuda.Stream` is), so the ops and APIs that take a stream accept it: `x.record_stream(s)`
# (DDP calls it when it copies inputs), `torch.accelerator.set_stream(s)`. Streams multiplex onto
# the one hardware queue of their core (as the reference): every op runs in issue order,
# whatever its stream, so a tensor used on one stream and freed on another is never reused
# before that use ran; `record_stream` has nothing to record. A change of stream is a fusion
# boundary. Each core has its current stream (its default one, id 0, until another is set).
_ids = itertools.count(1)
_PRIVATEUSE1 = int(torch._C._autograd.DeviceType.PrivateUse1)
_NATIVE_STREAMS = None  # the native hooks (Note [Native hooks]), which then number streams


def use_native(mod, count: int) -> None:
    """The native hooks number streams, follow the current stream, and give each core's
    default generator (registration calls this once they are loaded)."""
    global _NATIVE_STREAMS, default_generators
    _NATIVE_STREAMS = mod
    default_generators = tuple(mod.default_generator(k) for k in range(count))


def _new_id() -> int:
    return next(_ids) if _NATIVE_STREAMS is None else _NATIVE_STREAMS.new_stream_id()


def _tell_guard(s: "Stream") -> None:
    """The C++ device guard's current stream follows ours (PyTorch's code asks it)."""
    if _NATIVE_STREAMS is not None:
        _NATIVE_STREAMS.set_stream(s.device_index, s.stream_id)


class Stream(torch.Stream):
    """A neuron stream: `torch.neuron.Stream(device=None, priority=0)` (Note [Streams])."""

    def __new__(cls, device=None, priority: int = 0, _id: int | None = None):
        return super().__new__(cls, stream_id=_new_id() if _id is None else _id,
                               device_index=_check(device), device_type=_PRIVATEUSE1)

    def __init__(self, device=None, priority: int = 0, _id: int | None = None):
        self.priority = priority
        self._contexts = []

    def wait_event(self, event: "Event") -> None:
        _E(self.device_index).flush("event")

    def wait_stream(self, stream: torch.Stream) -> None:
        _E(self.device_index).flush("event")

    def record_event(self, event: "Event | None" = None) -> "Event":
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        eng = _E(self.device_index)
        eng.flush("stream query")
        return eng.device.free_at_us <= eng.device.host_us

    def synchronize(self) -> None:
        _E(self.device_index).sync("stream sync")

    def __enter__(self):
        """`with s:` as `with torch.neuron.stream(s):` (torch.Stream's own asks the C++ device
        guard, which a Python backend cannot provide)."""
        ctx = stream(self)
        ctx.__enter__()
        self._contexts.append(ctx)
        return self

    def __exit__(self, *exc):
        return self._contexts.pop().__exit__(*exc)

    def __repr__(self):
        return (f"<torch.neuron.Stream device={self.device} stream_id={self.stream_id} "
                f"priority={self.priority}>")


_defaults: dict[int, Stream] = {}  # core -> its default stream
_current: dict[int, torch.Stream] = {}  # core -> its current stream, once set


def default_stream(device=None) -> Stream:
    k = _check(device)
    s = _defaults.get(k)
    if s is None:
        s = _defaults[k] = Stream(k, _id=0)
    return s


def current_stream(device=None) -> torch.Stream:
    k = _check(device)
    s = _current.get(k)
    return s if s is not None else default_stream(k)


def _neuron_stream(s, what: str) -> torch.Stream:
    if not isinstance(s, torch.Stream):
        raise TypeError(f"{what}: expected a torch.Stream, got {type(s).__name__}")
    if s.device_type != _PRIVATEUSE1:
        raise RuntimeError(f"{what}: expected a neuron stream, got a stream on {s.device}")
    return s


def set_stream(s: torch.Stream) -> None:
    """Make `s` the current stream of its core (a boundary if it changes)."""
    if s is None:
        return
    _neuron_stream(s, "set_stream")
    k = _check(s.device_index)
    if s != current_stream(k):
        _E(k).flush("stream switch")
    _current[k] = s
    _tell_guard(s)


@contextlib.contextmanager
def stream(s: torch.Stream | None):
    """Issue ops on `s` inside the block, its core the current one (as torch.cuda.stream).
    Switching streams flushes (a boundary)."""
    if s is None:
        yield
        return
    _neuron_stream(s, "stream")
    with device(s.device_index):
        previous = current_stream(s.device_index)
        set_stream(s)
        try:
            yield
        finally:
            set_stream(previous)


def record_stream(eng, func, args, kwargs) -> None:
    """`aten::record_stream` on a neuron tensor: checked, nothing to record (Note [Streams])."""
    s = args[1] if len(args) > 1 else kwargs["s"]
    _neuron_stream(s, "record_stream")
    return None


class Event:
    """An event on the simulated timeline; `elapsed_time` reads the simulated clock (ms)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        self.enable_timing = enable_timing
        self.time_us: float | None = None

    def record(self, stream: torch.Stream | None = None) -> None:
        eng = _E(None if stream is None else stream.device_index)
        eng.flush("event")
        self.time_us = eng.device.free_at_us
        self.core = eng.index

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
    old = _engine.current_index()
    if d is not None:
        _engine.set_current(_check(d))
    try:
        yield
    finally:
        _engine.set_current(_check(old))


# -- what frameworks ask torch.cuda ------------------------------------------------------
# Note [torch.neuron answers as torch.cuda]: Hugging Face Transformers, accelerate, PEFT, TRL
# and Lightning call these on their device paths (`torch.<device>.*`, found by grepping
# them: adaptive_eager/TORCH_NEURON_API.md has the table). Each answers from the simulated
# device; what has no meaning here (CUDA graphs, NVML's temperature) is left out, so
# `hasattr` tells.
from device import NeuronOutOfMemoryError as OutOfMemoryError  # noqa: E402


def init() -> None:
    """torch.cuda.init: the device is ready once registered; nothing to initialize."""


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """bfloat16 is the NeuronCore's native matmul type (autocast's default here)."""
    return True


def is_tf32_supported() -> bool:
    """float32 matmuls run in float32 (CPU's kernels): no TF32 mode to turn on."""
    return False


_CAPABILITY = (3, 0)  # NeuronCore-v3, the generation of Trainium2 (Note [Device assumptions])


def get_device_capability(device=None) -> tuple[int, int]:
    """(major, minor) of the core's generation: NeuronCore-v3 (Trainium2) is (3, 0). Not a
    CUDA compute capability: code comparing it with CUDA's (8, 0) asks `device.type` first."""
    _check(device)
    return _CAPABILITY


def can_device_access_peer(device, peer_device) -> bool:
    """The cores of the one simulated chip reach each other (collectives copy between them)."""
    _check(device)
    _check(peer_device)
    return True


def is_current_stream_capturing() -> bool:
    """No graph capture on the device (CUDA graphs have no counterpart): never capturing."""
    return False


def ipc_collect() -> None:
    """Nothing to collect: a neuron buffer is never shared with another process (Note
    [Sharing across processes] in engine/tensor.py)."""


def reset_max_memory_allocated(device=None) -> None:
    """The peak of allocated memory starts again from what is in use (reserved is the same
    figure on the simulator: no caching allocator keeps freed blocks)."""
    reset_peak_memory_stats(device)


reset_max_memory_cached = reset_max_memory_allocated
memory_cached = memory_reserved  # CUDA's deprecated names
max_memory_cached = max_memory_reserved


def reset_accumulated_memory_stats(device=None) -> None:
    """Zero the allocation, free and out-of-memory counts of memory_stats()."""
    hbm = _E(device).device.hbm
    hbm.num_allocs = hbm.num_frees = hbm.num_ooms = 0


def device_memory_used(device=None) -> int:
    """Bytes in use on the core's HBM (this process is its only user)."""
    return _E(device).device.hbm.used


def memory_stats_as_nested_dict(device=None) -> dict:
    """memory_stats() split at its dots, as CUDA's nested form."""
    out: dict = {}
    for key, value in memory_stats(device).items():
        *path, last = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def memory_summary(device=None, abbreviated: bool = False) -> str:
    """A readable table of the core's memory, as torch.cuda.memory_summary gives."""
    eng = _E(device)
    hbm = eng.device.hbm

    def mib(n):
        return f"{n:,} B"
    rows = [("Allocated memory", mib(hbm.used), mib(hbm.peak)),
            ("Reserved memory", mib(hbm.used), mib(hbm.peak)),
            ("Capacity", mib(hbm.capacity), ""),
            ("Allocations / frees", f"{hbm.num_allocs:>16}", f"{hbm.num_frees:>16}"),
            ("Out-of-memory errors", f"{hbm.num_ooms:>16}", "")]
    lines = [f"neuron:{eng.index} memory summary (simulated HBM)",
             f"{'':24}{'current':>16}{'peak':>16}"]
    lines += [f"{name:24}{cur:>16}{peak:>16}" for name, cur, peak in rows]
    return "\n".join(lines)


class StreamContext:
    """`with torch.neuron.StreamContext(s):` as `torch.neuron.stream(s)` (None: no change)."""

    def __init__(self, stream):
        self.stream = stream
        self._cm = None

    def __enter__(self):
        self._cm = _stream_scope(self.stream)
        self._cm.__enter__()
        return self.stream

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


@contextlib.contextmanager
def device_of(obj):
    """The current core is `obj`'s inside the block (a CPU tensor leaves it unchanged)."""
    index = obj.get_device() if obj.device.type == "neuron" else None
    with device(index):
        yield


_stream_scope = stream
