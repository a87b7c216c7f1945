"""The simulated NeuronCore: one hardware queue, a simulated clock, trace events.

Note [Simulated asynchrony]: a launch's work is done on host memory when it is submitted
(the queue is in order, so nothing the host can observe differs), but its *time* is placed on
the device timeline: it starts when the device is free and the host has enqueued it, and the
host only waits for it at a sync. An exception raised by the work is kept on the launch and
re-raised at the next sync, earliest first, exactly as an asynchronous runtime reports it.
With `blocking=True` (NEURON_LAUNCH_BLOCKING=1) the host waits for every launch, and the
engine synchronizes after each flush, so errors are raised at the op that issued it.

Note [Collective stream]: collectives run on a stream of their own, as NCCL's on CUDA. One
starts once the host has issued it, the compute work queued before it has finished (its
inputs are written: CUDA's event on the current stream) and the collective before it has
finished; it does not hold the compute stream up. The compute stream joins it (waits for
its end) when the work is waited for (`join`, at `Work.wait()`), when a launch reads or
writes one of its buffers (`join_buffers`: a C++ caller's wait, DDP's reducer, that Python
cannot see), and at a sync. The time a join makes the compute stream wait (past both its
own queued work and the host) is the collective's *exposed* time; the rest of its time ran
under compute or host work: *hidden*. A sync's join counts as exposed too.
Per step (`ae.explain()`): the device counts the steps it is told of (`new_step`, at each
optimizer step) and files each collective under the step it was issued in; a join's wait is
given to the collectives running during it (the stream runs one at a time), whenever the
join comes, so a step's figures are its own collectives' even when adaptive mode joins them
at a later flush. A collective the compute stream or the host has passed can take no more
wait: it is final (the others are *pending*).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import time
from typing import Any, Callable

import torch

from .counters import COUNTERS, Tally
from .memory import HBM, Buffer
from .spec import DeviceSpec


SOURCE_BUDGET = 8192  # ops whose source lines the timeline keeps (`Device._trace`): ~0.6 MB


@dataclasses.dataclass(slots=True)
class Launch:
    """One executable launch (or DMA) on the hardware queue."""

    name: str
    run: Callable[[], Any] | None  # the work; None for pure accounting (DMA)
    nbytes: int  # HBM bytes read + written
    flops: float
    low_precision: bool = False
    kind: str = "launch"  # "launch", "kernel" (a custom kernel's launch) or "dma"
    dma_bytes: int = 0
    start_us: float = 0.0
    end_us: float = 0.0
    error: BaseException | None = None
    internal: bool = False  # the error is a bug of ours, not the op's (LaunchError)
    context: Any = None  # what the engine wants back with an error (op name, source line)
    cost_us: float = 0.0  # kind "collective": its time, from device/interconnect.py
    overhead_us: float = 0.0  # fixed time the executable adds (a kernel's declared overhead)
    # its ops for the trace: ([user source per op], ((FLOPs, bytes) per op, the plan's own
    # tuple)). Not the nodes themselves: the timeline keeping every launch's nodes alive
    # (with their runtime values) cost ~7% of host time per op on the 50-op chain (adaptive)
    nodes: Any = None


class LaunchError(Exception):
    """Raised by a launch's work; kept for the next sync. `internal`: not the op's own error
    (a kernel refusing its inputs) but a bug of ours, re-raised as itself, never dressed as
    a device error."""

    def __init__(self, cause: BaseException, internal: bool = False):
        super().__init__(str(cause))
        self.cause = cause
        self.internal = internal


class DeviceError(RuntimeError):
    """An error raised by a launch, reported at the next sync."""

    def __init__(self, launch: Launch):
        self.launch = launch
        super().__init__(str(launch.error))


# Timeline tracks by event kind: launches, DMAs, and the host's compiles and syncs.
TRACKS = {"launch": 0, "kernel": 0, "dma": 1, "compile": 2, "sync": 3, "collective": 4}
TRACK_NAMES = ("NeuronCore launches", "DMA", "host: compiles", "host: syncs", "collectives")


class Device:
    """One simulated logical NeuronCore."""

    def __init__(self, spec: DeviceSpec | None = None, *, blocking: bool = False,
                 realtime: bool = False, trace_limit: int = 100_000):
        self.spec = spec or DeviceSpec()
        self.hbm = HBM(self.spec.hbm_bytes)
        self.blocking = blocking
        self.realtime = realtime  # each launch also takes its modeled time on the wall clock
        self.host_us = 0.0  # simulated host clock
        self.free_at_us = 0.0  # when the device finishes everything queued so far
        # The end times of the newest max_in_flight launches (all those that may be in
        # flight: `_queue`), in order
        self._ends: collections.deque[float] = collections.deque(maxlen=self.spec.max_in_flight)
        self._errors: list[Launch] = []
        # (name, kind, start, duration, bytes, flops, nodes) per launch: the newest
        # trace_limit; nodes: its ops' (sources, costs) (Launch.nodes; None for host events
        # and DMAs), sources resolved to lines only when a report or trace asks
        # (adaptive_eager/engine/source.py `lines`)
        self.trace: collections.deque[tuple] = collections.deque(maxlen=trace_limit)
        self._kept_ops = 0  # ops whose sources the trace holds (bounded: `_trace`)
        self._tail = 0  # the newest entries, the only ones that may hold sources
        self.rng = DeviceRNG()
        self.stats = Tally()  # this core's share of COUNTERS' device figures
        self.submits = 0  # every launch and DMA, never reset: host copies are checked by it
        self.coll_free_at_us = 0.0  # when the collective stream is done (Note [Collective stream])
        self._pending: dict[int, tuple] = {}  # id(buffer) -> (buffer, end, wait for the bytes)
        self.step = 0  # optimizer steps seen (`new_step`)
        self._colls: collections.deque[list] = collections.deque()  # [start, end, step], unfinal
        self._steps: dict[int, list] = {}  # step -> [collectives, bytes, us, exposed us]

    def respec(self, spec: DeviceSpec) -> None:
        """New figures for this core, in place: its memory, clock, trace, generator and
        counts go on (a new Device would start them from zero while tensors still hold HBM)."""
        self.spec = spec
        self.hbm.capacity = spec.hbm_bytes
        self._ends = collections.deque(self._ends, maxlen=spec.max_in_flight)  # the newest

    def configure(self, *, blocking: bool, realtime: bool) -> None:
        """Launch blocking (NEURON_LAUNCH_BLOCKING) and real-time pacing, changeable live."""
        self.blocking, self.realtime = blocking, realtime

    # -- host side -------------------------------------------------------------------
    def advance_host(self, us: float) -> None:
        self.host_us += us

    def in_flight(self) -> int:
        """Launches submitted and not finished by the host's current time."""
        ends = self._ends
        while ends and ends[0] <= self.host_us:
            ends.popleft()
        return len(ends)

    def submit(self, launch: Launch) -> Launch:
        self.submits += 1
        spec = self.spec
        if launch.kind == "dma":
            cost = spec.dma_us(launch.dma_bytes)
            COUNTERS.dmas += 1
            self.stats["dmas"] += 1
        elif launch.kind == "collective":  # costed by its caller (device/interconnect.py)
            return self._submit_collective(launch)
        else:
            cost = spec.launch_us(launch.nbytes, launch.flops, launch.low_precision) \
                + launch.overhead_us
            COUNTERS.launches += 1
            COUNTERS.hbm_bytes += launch.nbytes
            self.stats["launches"] += 1
            if launch.kind == "kernel":  # custom kernels, counted apart too
                COUNTERS.kernel_launches += 1
                COUNTERS.kernel_time_us += cost
                COUNTERS.kernel_hbm_bytes += launch.nbytes
                COUNTERS.kernels[launch.name] += 1
        launch.start_us, launch.end_us = self._queue(cost)
        if launch.run is not None:
            try:
                launch.run()
            except LaunchError as e:  # kept for the next sync (Note [Simulated asynchrony])
                launch.error = e.cause
                launch.internal = e.internal
                self._errors.append(launch)
        if self.realtime:
            _sleep_us(cost)
        self._trace(launch, cost)
        if self.blocking:  # the host waits; the caller raises any error at its sync
            self.host_us = max(self.host_us, launch.end_us)
        return launch

    def _queue(self, cost: float) -> tuple[float, float]:
        """A launch of `cost` us enters the queue: its (start, end) on the device clock."""
        # The runtime keeps at most max_in_flight launches queued; the host waits beyond that.
        # (End times only grow: `limit` launches are in flight when the limit-th newest, the
        # oldest `_ends` holds once full, has not ended. So at most `limit` are in flight
        # after this one enters, and the one it pushes out of `_ends` has ended.)
        ends = self._ends
        if len(ends) == ends.maxlen and ends[0] > self.host_us:
            self.host_us = ends[0]
        start = self.host_us if self.host_us > self.free_at_us else self.free_at_us  # (max)
        self.free_at_us = end = start + cost
        COUNTERS.device_time_us += cost
        self.stats["device_time_us"] += cost
        ends.append(end)
        return start, end

    def submit_plain(self, name: str, run, args: tuple, cost: float, nbytes: int,
                     flops: float, low_precision: bool, nodes, context) -> Launch | None:
        """`submit(Launch(name, partial(run, *args), nbytes, flops, low_precision,
        context=context, nodes=nodes))` of a plain launch whose cost (`launch_us`) the
        caller knows (Note [Eager launches]: per op in eager mode): the same clock, counters
        and timeline entry, without the Launch record (nor the partial) unless it fails
        (returned then; None otherwise)."""
        self.submits += 1
        COUNTERS.launches += 1
        COUNTERS.hbm_bytes += nbytes
        self.stats["launches"] += 1
        start, end = self._queue(cost)
        failed = None
        try:
            run(*args)
        except LaunchError as e:  # kept for the next sync (Note [Simulated asynchrony])
            failed = Launch(name, functools.partial(run, *args), nbytes, flops, low_precision,
                            context=context, nodes=nodes)
            failed.start_us, failed.end_us = start, end
            failed.error, failed.internal = e.cause, e.internal
            self._errors.append(failed)
        if self.realtime:
            _sleep_us(cost)
        self._entry(name, "launch", start, cost, nbytes, flops, nodes)
        if self.blocking:  # the host waits; the caller raises any error at its sync
            self.host_us = max(self.host_us, end)
        return failed

    # -- the collective stream (Note [Collective stream]) --------------------------------
    def _submit_collective(self, launch: Launch) -> Launch:
        cost = launch.cost_us
        launch.start_us = max(self.host_us, self.free_at_us, self.coll_free_at_us)
        launch.end_us = self.coll_free_at_us = launch.start_us + cost
        COUNTERS.device_time_us += cost
        COUNTERS.collective_us += cost
        self.stats["device_time_us"] += cost
        self._trace(launch, cost)
        figures = self._steps.setdefault(self.step, [0, 0, 0.0, 0.0])
        figures[0] += 1
        figures[1] += launch.dma_bytes
        figures[2] += cost
        self._colls.append([launch.start_us, launch.end_us, self.step])
        self._finalize()
        if self.blocking:
            self.join(launch.end_us)
            self.host_us = max(self.host_us, launch.end_us)
        return launch

    def pend(self, buffers, end_us: float, wait: Callable[[], Any] | None) -> None:
        """`buffers` are a collective's until `end_us`; `wait()` waits for its bytes."""
        for b in buffers:
            self._pending[id(b)] = (b, end_us, wait)

    def join(self, end_us: float) -> None:
        """The compute stream waits for a collective ending at `end_us`."""
        base = max(self.free_at_us, self.host_us)
        if end_us > base:
            COUNTERS.exposed_collective_us += end_us - base
            self.stats["exposed_collective_us"] += end_us - base
            for start, end, step in self._colls:  # the wait, given to what ran during it
                wait = min(end_us, end) - max(base, start)
                if wait > 0 and step in self._steps:
                    self._steps[step][3] += wait
            self.free_at_us = end_us
        self._finalize()

    def _finalize(self) -> None:
        """Collectives that ended before both streams' present take no more wait."""
        now = max(self.free_at_us, self.host_us)
        while self._colls and self._colls[0][1] <= now:
            self._colls.popleft()

    def new_step(self) -> None:
        """An optimizer step: later collectives belong to the next step (the last two kept)."""
        self.step += 1
        self._steps.pop(self.step - 2, None)

    def step_communication(self) -> dict:
        """The last complete step's collectives (the current one's before any step):
        count, bytes, time, exposed and hidden time (us), and how many are pending."""
        step = max(self.step - 1, 0)
        n, nbytes, us, exposed = self._steps.get(step, [0, 0, 0.0, 0.0])
        self._finalize()
        return {"step": step, "complete": self.step > 0, "collectives": n, "bytes": nbytes,
                "collective_us": us, "exposed_us": exposed, "hidden_us": us - exposed,
                "pending": sum(1 for c in self._colls if c[2] == step)}

    def join_buffers(self, buffers) -> None:
        """A launch about to use `buffers`: the collectives writing them finish first (their
        bytes, and on the timeline)."""
        pending = self._pending
        for b in buffers:
            entry = pending.pop(id(b), None)
            if entry is not None and entry[0] is b:
                if entry[2] is not None:
                    entry[2]()
                self.join(entry[1])

    def unpend(self, buffers, end_us: float) -> None:
        """The collective that ended at `end_us` was waited for: join it, forget its buffers."""
        self.join(end_us)
        for b in buffers:
            entry = self._pending.get(id(b))
            if entry is not None and entry[0] is b and entry[1] <= end_us:
                del self._pending[id(b)]

    def _join_all(self) -> None:
        pending, self._pending = self._pending, {}
        for _, _, wait in pending.values():
            if wait is not None:
                wait()
        self.join(self.coll_free_at_us)

    def wait_idle(self) -> None:
        """The host waits until everything queued has finished (errors stay for the sync)."""
        self._join_all()
        self.host_us = max(self.host_us, self.free_at_us)

    def mark(self, name: str, kind: str, duration_us: float, start_us=None) -> None:
        """A host-side event on the timeline (a compile, a sync); starts now by default."""
        start = self.host_us if start_us is None else start_us
        self.trace.append((name, kind, start, duration_us, 0, 0.0, None))
        self._tail += 1

    def synchronize(self) -> None:
        """The host waits for all queued work, then the earliest deferred error is raised."""
        self._join_all()
        self.host_us = max(self.host_us, self.free_at_us)
        self._ends.clear()
        if self._errors:
            first, self._errors = self._errors[0], []
            raise DeviceError(first)

    # -- memory ----------------------------------------------------------------------
    def alloc(self, nbytes: int, storage=None) -> Buffer:
        return Buffer(nbytes, self.hbm, storage)

    def _trace(self, launch: Launch, cost: float) -> None:
        """The launch on the timeline. The sources its ops keep (for their lines) are bounded
        apart: past SOURCE_BUDGET ops kept, the oldest launches lose theirs (down to half the
        budget), so a long run keeps flat memory even with large fused launches."""
        self._entry(launch.name, launch.kind, launch.start_us, cost, launch.nbytes,
                    launch.flops, launch.nodes)

    def _entry(self, name, kind, start, cost, nbytes, flops, nodes) -> None:
        self.trace.append((name, kind, start, cost, nbytes, flops, nodes))
        self._tail += 1
        if nodes:
            self._kept_ops += len(nodes[0])
            if self._kept_ops > SOURCE_BUDGET:
                self._drop_sources()

    def _drop_sources(self) -> None:
        """The oldest launches that keep sources lose them, down to half the budget. Only
        the newest `_tail` entries may keep any (the older ones lost theirs), so only they
        are walked, taken off the deque's right end and put back (indexing a deque of
        100,000 launches from the left cost ~50 us per launch once it was full)."""
        trace = self.trace
        tail = [trace.pop() for _ in range(min(self._tail, len(trace)))]
        tail.reverse()
        kept = sum(len(t[6][0]) for t in tail if t[6])
        i = 0
        while i < len(tail) and kept > SOURCE_BUDGET // 2:
            t = tail[i]
            if t[6]:
                kept -= len(t[6][0])
                tail[i] = t[:6] + (None,)
            i += 1
        trace.extend(tail)
        self._tail = len(tail) - i
        self._kept_ops = kept

    def chrome_trace(self, pid: int = 0, lines: Callable | None = None) -> dict:
        """The device timeline in Chrome/Perfetto trace-event format (process row `pid`).
        `lines(nodes)`: a launch's source lines for its args (the engine's resolver)."""
        events = [{"name": name, "cat": kind, "ph": "X", "ts": ts, "dur": dur, "pid": pid,
                   "tid": TRACKS.get(kind, 0), "args": {"bytes": b, "flops": f}}
                  for name, kind, ts, dur, b, f, _ in self.trace]
        if lines is not None:
            for e, t in zip(events, self.trace):
                if t[6]:
                    e["args"]["lines"] = lines(t[6])
        meta = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                 "args": {"name": f"NeuronCore {pid}"}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": t, "args": {"name": n}}
                 for t, n in enumerate(TRACK_NAMES)]
        return {"traceEvents": meta + events, "displayTimeUnit": "ms"}




def _sleep_us(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


class DeviceRNG:
    """The device's random generator: a CPU generator (MT19937) of its own, separate from the
    process's default one, so a neuron tensor drawn under `torch.manual_seed(s)` equals the
    CPU tensor drawn under the same seed.

    Random ops get it as their `generator=` (an overload that takes one, `rand.generator` for
    `rand`). Swapping its state into the CPU's default generator instead was a race: another
    thread's CPU draws (a data-augmentation thread) ran inside the swap, taking the device's
    numbers and losing their own. `native_dropout`, which has no such overload, is composed as
    CPU composes it, drawing from this generator (`_native_dropout`). A random op with neither
    still swaps (the lock keeps two cores' swaps apart; a CPU thread's draws meanwhile race):
    none reaches the engine today (CUDA's, MPS's and cuDNN's fused kernels)."""

    def __init__(self, seed: int = 67280421310721):
        self.gen = torch.Generator()
        self.manual_seed(seed)

    def manual_seed(self, seed: int) -> None:
        self.seed = int(seed)
        self.gen.manual_seed(self.seed)

    @property
    def state(self) -> torch.Tensor:
        return self.gen.get_state()

    @state.setter
    def state(self, state: torch.Tensor) -> None:
        self.gen.set_state(state)

    def run(self, op, args, kwargs):
        with_gen = with_generator(op)
        if with_gen is not None:
            return with_gen(*args, **dict(kwargs, generator=self.gen))
        with _SWAP:
            gen = torch.default_generator
            saved = gen.get_state()
            gen.set_state(self.gen.get_state())
            try:
                return op(*args, **kwargs)
            finally:
                self.gen.set_state(gen.get_state())
                gen.set_state(saved)


def _native_dropout(input, p, train=None, *, generator):
    """CPU's `native_dropout` (aten/src/ATen/native/Dropout.cpp, `native_dropout_cpu`), op for
    op, its mask drawn from `generator`: the same values as CPU's kernel drawing from a
    default generator in the same state."""
    if input.numel() == 0 or train is False:  # (draws nothing)
        return torch.ops.aten.native_dropout.default(input, p, train)
    p1m = 1.0 - p
    scale = 0.0 if p1m == 0 else 1.0 / p1m
    mask = torch.empty_like(input, dtype=torch.bool).bernoulli_(p1m, generator=generator)
    # (C++'s `mul_(double)` is `mul_.Scalar`, which rounds the scale to a half's dtype first)
    return torch.ops.aten.mul_.Scalar(input.mul(mask), scale), mask


_SWAP = threading.Lock()
# op -> its form taking `generator=` (None: none)
_WITH_GENERATOR: dict = {torch.ops.aten.native_dropout.default: _native_dropout}


def with_generator(op):
    """`op` itself if it takes a `generator=`, else its overload that does and otherwise takes
    the same arguments (`rand.default` -> `rand.generator`), else None."""
    try:
        return _WITH_GENERATOR[op]
    except KeyError:
        pass
    names = [a.name for a in op._schema.arguments]
    found = None
    if "generator" in names:
        found = op
    else:
        packet = getattr(torch.ops.aten, op._schema.name.split("::")[1], None)
        for name in packet.overloads() if packet is not None else ():
            other = getattr(packet, name)
            if [a.name for a in other._schema.arguments if a.name != "generator"] == names \
                    and len(other._schema.arguments) == len(names) + 1:
                found = other
                break
    _WITH_GENERATOR[op] = found
    return found
