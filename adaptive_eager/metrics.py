"""Counters in one place (as tinygrad's GlobalCounters), and the readable report."""
from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass
class Metrics:
    ops: int = 0  # ATen ops intercepted on neuron tensors
    launches: int = 0  # executable launches (fused or not)
    flushes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    group_sizes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    cpu_fallbacks: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    collectives: int = 0  # torch.distributed collectives and P2P ops on neuron tensors
    collective_bytes: int = 0  # their payload (bytes of this rank's tensors they carry)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """`ae.metrics()`: counters since the last `ae.reset_metrics()`."""

    ops: int
    launches: int
    flushes: dict
    compiles: int
    cache_memory_hits: int
    cache_disk_hits: int
    cache_misses: int
    plan_hits: int
    cpu_fallbacks: dict
    h2d_bytes: int
    d2h_bytes: int
    device_time_us: float
    compile_time_us: float
    peak_memory_bytes: int
    memory_bytes: int
    bytes_saved: int
    hbm_bytes: int
    mean_group_size: float
    group_sizes: dict
    collectives: int = 0
    collective_bytes: int = 0

    def __sub__(self, other: "Snapshot") -> "Snapshot":
        """Counters accumulated between two snapshots (peak/current memory: the later one)."""
        def d(a, b):
            if isinstance(a, dict):
                return {k: a.get(k, 0) - b.get(k, 0) for k in a if a.get(k, 0) - b.get(k, 0)}
            return a - b
        vals = {f.name: d(getattr(self, f.name), getattr(other, f.name))
                for f in dataclasses.fields(self)}
        vals["peak_memory_bytes"] = self.peak_memory_bytes
        vals["memory_bytes"] = self.memory_bytes
        n = sum(vals["group_sizes"].values())
        vals["mean_group_size"] = (sum(k * v for k, v in vals["group_sizes"].items()) / n
                                   if n else 0.0)
        return Snapshot(**vals)


def snapshot(engine, base: dict) -> Snapshot:
    m, r, dev = engine.metrics, engine.runner, engine.device
    st = r.cache.stats
    groups = dict(m.group_sizes)
    n = sum(groups.values())
    return Snapshot(
        ops=m.ops, launches=m.launches, flushes=dict(m.flushes),
        compiles=st.misses - base.get("compiles", 0),
        cache_memory_hits=st.memory_hits - base.get("mem", 0),
        cache_disk_hits=st.disk_hits - base.get("disk", 0),
        cache_misses=st.misses - base.get("compiles", 0),
        plan_hits=r.counters["plan_hits"] - base.get("plan", 0),
        cpu_fallbacks=dict(m.cpu_fallbacks), h2d_bytes=m.h2d_bytes, d2h_bytes=m.d2h_bytes,
        device_time_us=dev.busy_us - base.get("busy", 0.0),
        compile_time_us=r.counters["compile_time_us"] - base.get("ctime", 0.0),
        peak_memory_bytes=dev.hbm.peak, memory_bytes=dev.hbm.used,
        bytes_saved=r.counters["bytes_saved"] - base.get("saved", 0),
        hbm_bytes=dev.hbm_bytes - base.get("hbm", 0),
        mean_group_size=(sum(k * v for k, v in groups.items()) / n) if n else 0.0,
        group_sizes=groups, collectives=m.collectives, collective_bytes=m.collective_bytes)


def base_of(engine) -> dict:
    """The cumulative counters `reset_metrics` subtracts from later snapshots."""
    r, st = engine.runner, engine.runner.cache.stats
    return {"compiles": st.misses, "mem": st.memory_hits, "disk": st.disk_hits,
            "plan": r.counters["plan_hits"], "busy": engine.device.busy_us,
            "ctime": r.counters["compile_time_us"], "saved": r.counters["bytes_saved"],
            "hbm": engine.device.hbm_bytes}


def report(s: Snapshot) -> str:
    rows = [
        ("ops intercepted", s.ops), ("launches", s.launches),
        ("mean fused group size", f"{s.mean_group_size:.2f}"),
        ("flushes", ", ".join(f"{k}={v}" for k, v in sorted(s.flushes.items())) or "-"),
        ("compiles", s.compiles), ("cache hits (memory)", s.cache_memory_hits),
        ("cache hits (disk)", s.cache_disk_hits), ("plan reuses", s.plan_hits),
        ("compile time (modeled)", f"{s.compile_time_us / 1e3:.1f} ms"),
        ("device time (simulated)", f"{s.device_time_us / 1e3:.3f} ms"),
        ("CPU fallbacks", ", ".join(f"{k}={v}" for k, v in sorted(s.cpu_fallbacks.items()))
         or "-"),
        ("collectives (bytes)", f"{s.collectives} ({s.collective_bytes} B)"),
        ("host->device bytes", s.h2d_bytes), ("device->host bytes", s.d2h_bytes),
        ("HBM bytes moved by launches", s.hbm_bytes),
        ("bytes not written back", s.bytes_saved),
        ("device memory (now / peak)", f"{s.memory_bytes} / {s.peak_memory_bytes} B"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)
