"""Simulated HBM: an allocator with capacity, peak and stats, and the buffers it hands out."""
from __future__ import annotations

import threading

import torch


class NeuronOutOfMemoryError(torch.OutOfMemoryError):
    """Raised when an allocation does not fit in the simulated HBM.

    Note [Out-of-memory wording]: the message opens as PyTorch's allocators word theirs
    ("CUDA out of memory. Tried to allocate 2.00 MiB. ...", XPU's alike): libraries match that
    text, not the type. accelerate's `should_reduce_batch_size` (behind Trainer's
    `auto_find_batch_size` and `find_executable_batch_size`) looks for " out of memory." in a
    RuntimeError's message; worded "out of memory: tried to", the first OOM ended the run
    instead of halving the batch.
    """


def _fmt(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    raise AssertionError


# The simulated HBM lives in this host's RAM. An allocation the host cannot give would not
# raise: the kernel's OOM killer ends the process, and the user loses everything. Large
# allocations are checked against the host first, and refused with the device's own error.
HOST_CHECK_BYTES = 64 << 20  # smaller ones are not checked (reading /proc costs)
_HOST_MARGIN = 1 << 30  # left to the host, and to queued values (max_pending_mb)


def host_available() -> int | None:
    """Bytes of RAM this host can still give (Linux MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class HBM:
    """Byte accounting for the simulated device memory."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0
        self.peak = 0
        self.num_allocs = 0
        self.num_frees = 0
        self.num_ooms = 0
        # A buffer is released by whichever thread drops its last tensor (Buffer.__del__),
        # possibly while another thread allocates: the counters are updated under a lock.
        self._lock = threading.Lock()

    def after_fork(self) -> None:
        """In a forked child: a lock another thread of the parent held stays held for good."""
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> None:
        lock = self._lock
        lock.acquire()  # (`with`, unrolled: twice the cost, and eager mode makes a buffer per op)
        try:
            used = self.used + nbytes
            if used > self.capacity:
                self.num_ooms += 1
                raise NeuronOutOfMemoryError(
                    f"Neuron out of memory. Tried to allocate {_fmt(nbytes)}; "
                    f"{_fmt(self.used)} in use, {_fmt(self.capacity - self.used)} free of "
                    f"{_fmt(self.capacity)} total. Free tensors (del, or let them go out of "
                    f"scope) or use smaller batches; the device stays usable."
                )
            self.used = used
            if used > self.peak:
                self.peak = used
            self.num_allocs += 1
        finally:
            lock.release()

    def check_host(self, nbytes: int) -> None:
        """Refuse (NeuronOutOfMemoryError) a large allocation this host's RAM cannot back."""
        if nbytes < HOST_CHECK_BYTES:
            return
        free = host_available()
        if free is not None and nbytes > free - _HOST_MARGIN:
            with self._lock:
                self.num_ooms += 1
            raise NeuronOutOfMemoryError(
                f"Neuron out of memory. Tried to allocate {_fmt(nbytes)}, but the simulated "
                f"device keeps its memory in this host's RAM, which has {_fmt(max(free, 0))} "
                f"available (of the device's {_fmt(self.capacity - self.used)} free). Free "
                f"tensors or use smaller batches; the device stays usable.")

    def release(self, nbytes: int) -> None:
        lock = self._lock
        lock.acquire()  # (as in `reserve`)
        try:
            assert self.used >= nbytes, (self.used, nbytes)
            self.used -= nbytes
            self.num_frees += 1
        finally:
            lock.release()

    def stats(self) -> dict:
        return {
            "allocated_bytes.all.current": self.used,
            "allocated_bytes.all.peak": self.peak,
            "reserved_bytes.all.current": self.used,
            "reserved_bytes.all.peak": self.peak,
            "num_alloc_retries": 0,
            "num_ooms": self.num_ooms,
            "allocation.all.allocated": self.num_allocs,
            "allocation.all.freed": self.num_frees,
            "capacity_bytes": self.capacity,
        }


class Buffer:
    """A device allocation: nbytes of simulated HBM, backed by host bytes once written.

    The HBM bytes are reserved when the buffer is made (a value written back or an `empty`
    allocation) and released when the last reference to the buffer goes away.
    """

    __slots__ = ("nbytes", "storage", "_hbm", "host", "__weakref__")

    def __init__(self, nbytes: int, hbm: HBM, storage: torch.UntypedStorage | None = None):
        """`nbytes` reserved in `hbm` (its out-of-memory error if they do not fit), backed by
        `storage` (new host bytes if None)."""
        self._hbm = None  # (set once reserved: what __del__ releases)
        self.nbytes = nbytes
        # (layout, CPU tensor over `storage` with it): the last view a launch read it
        # through or wrote it as (Note [Host views] in fusion/codegen.py)
        self.host = None
        hbm.reserve(nbytes)
        self._hbm = hbm
        if storage is None:
            storage = torch.UntypedStorage(nbytes)
        assert storage.nbytes() >= nbytes, (storage.nbytes(), nbytes)
        self.storage = storage

    def __del__(self):
        if self._hbm is not None:
            self._hbm.release(self.nbytes)
