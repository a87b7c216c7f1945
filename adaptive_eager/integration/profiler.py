"""torch.profiler shows the simulated device: each launch as an event named after its
executable (`neuron::addmm|gelu`) carrying its simulated duration, and the host's compiles
(`neuron::compile:<name>`), syncs (`neuron::sync:<reason>`) and DMAs (`neuron::h2d`), in
`key_averages()` (as device time) and in `export_chrome_trace` (a "neuron:k (simulated)"
process per core). The events are the device timeline's own (`ae.save_trace`), so both tell the same
story: same names, order and durations.

Note [Profiler hooks]: a Python backend cannot feed Kineto, so we wrap four methods of
`torch.autograd.profiler.profile` (what `torch.profiler.profile` drives; private API):
`_start_trace` (remember where the device timeline stands), `__exit__` (flush and wait, then
take the timeline's new events), `_ensure_function_events` (append them as FunctionEvents
on PrivateUse1) and `export_chrome_trace` (append them to the written JSON). The device
track keeps simulated time, placed from the start of the profile.
"""
from __future__ import annotations

import json

from torch.autograd import DeviceType
from torch.autograd import profiler as _p
from torch.autograd.profiler_util import FunctionEvent

from .. import patches
from ..engine import engine as _engine
from ..engine.source import lines

PREFIX = "neuron::"
_installed = False


def event_name(name: str, kind: str) -> str:
    """The profiler's name for one timeline event."""
    if kind in ("compile", "sync", "kernel"):  # (a custom kernel: neuron::kernel:ns::name)
        return f"{PREFIX}{kind}:{name}"
    return PREFIX + name


def _timeline_start(prof) -> None:
    # per core: the timeline's newest event now (its events are fresh tuples: identity marks
    # the spot) and the clock; a core first used inside the profile starts from nothing
    prof._neuron = {"cores": {eng.index: _mark(eng.device) for eng in _engine.ENGINES},
                    "events": []}


def _mark(dev) -> dict:
    return {"last": dev.trace[-1] if dev.trace else None,
            "t0": max(dev.host_us, dev.free_at_us)}


def _timeline_stop(prof) -> None:
    st = getattr(prof, "_neuron", None)
    if st is None:
        return
    events = []
    for eng in list(_engine.ENGINES):
        try:
            eng.flush("profiler")  # queued work belongs to the window
            eng.synchronize()  # (not a user's sync: no sync event)
        except Exception:
            pass  # deferred device errors are the user's next sync's to raise
        mark = st["cores"].get(eng.index, {"last": None, "t0": 0.0})
        trace = list(eng.device.trace)
        start = 0
        for i in range(len(trace) - 1, -1, -1):
            if trace[i] is mark["last"]:
                start = i + 1
                break
        # (all of it if the bounded timeline dropped the mark); times from the core's start
        events += [(eng.index, mark["t0"], e) for e in trace[start:]]
    st["events"] = events


def _function_events(prof) -> list:
    st = getattr(prof, "_neuron", None)
    if not st or not st["events"]:
        return []
    out = []
    for i, (core, t0, (name, kind, ts, dur, nbytes, flops, _)) in enumerate(st["events"]):
        start = max(0.0, ts - t0)
        host = kind in ("compile", "sync")
        fe = FunctionEvent(
            id=-(i + 1), name=event_name(name, kind), thread=0, start_us=start,
            end_us=start + dur, use_device="neuron", device_index=0 if host else core,
            device_type=DeviceType.CPU if host else DeviceType.PrivateUse1,
            flops=int(flops) if flops else None, trace_name=event_name(name, kind), stack=[],
            input_shapes=[], concrete_inputs=[], kwinputs={})
        out.append(fe)
    return out


def chrome_events(prof, anchor_us: float) -> list[dict]:
    """The window's timeline events in the profiler's Chrome trace, from `anchor_us`."""
    st = getattr(prof, "_neuron", None)
    if not st:
        return []
    from device.core import TRACK_NAMES, TRACKS
    ev = []
    for core in sorted({c for c, _, _ in st["events"]}):
        pid = f"neuron:{core} (simulated)"
        ev += [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": pid}}]
        ev += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": t, "args": {"name": n}}
               for t, n in enumerate(TRACK_NAMES)]
    for core, t0, (name, kind, ts, dur, nbytes, flops, nodes) in st["events"]:
        args = {"bytes": nbytes, "flops": flops, "simulated": True}
        if nodes:
            args["lines"] = lines(nodes[0])
        ev.append({"name": event_name(name, kind), "cat": "neuron_" + kind, "ph": "X",
                   "pid": f"neuron:{core} (simulated)", "tid": TRACKS.get(kind, 0),
                   "ts": anchor_us + max(0.0, ts - t0), "dur": dur, "args": args})
    return ev


def install() -> None:
    """Wrap the profiler's start, stop, event list and trace export (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    cls = _p.profile
    start, exit_, ensure, export = (cls._start_trace, cls.__exit__,
                                    cls._ensure_function_events, cls.export_chrome_trace)

    def _start_trace(self):
        _timeline_start(self)
        return start(self)

    def __exit__(self, *exc):
        if self.enabled:
            _timeline_stop(self)
        return exit_(self, *exc)

    def _ensure_function_events(self):
        fresh = self._function_events is None
        ensure(self)
        events = self._function_events
        mine = _function_events(self) if fresh and events is not None else []
        if mine and not events._use_device:
            # the tables show device columns only for the profile's device: ours
            events._use_device = "neuron"
            for fe in events:
                fe.use_device = "neuron"
        for fe in mine:
            events.append(fe)

    def export_chrome_trace(self, path, *args, **kwargs):
        out = export(self, path, *args, **kwargs)
        events = getattr(self, "_neuron", None)
        if not events or not events["events"]:
            return out
        with open(path) as f:
            data = json.load(f)
        host = [e["ts"] for e in data.get("traceEvents", [])
                if e.get("ph") == "X" and isinstance(e.get("ts"), (int, float))]
        data.setdefault("traceEvents", []).extend(chrome_events(self, min(host, default=0.0)))
        with open(path, "w") as f:
            json.dump(data, f)
        return out

    for name, new, rests_on in (
            ("_start_trace", _start_trace, "profile._start_trace (private): the profile starts"),
            ("__exit__", __exit__, "profile.__exit__: the profile stops"),
            ("_ensure_function_events", _ensure_function_events,
             "profile._ensure_function_events (private) and EventList._use_device (private)"),
            ("export_chrome_trace", export_chrome_trace,
             "profile.export_chrome_trace writing Chrome's JSON, which we extend")):
        patches.patch(cls, name, new, rests_on=f"torch.autograd.profiler.{rests_on}")
