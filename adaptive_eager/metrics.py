"""Counters in one place (as tinygrad's GlobalCounters), and the readable report."""
from __future__ import annotations

import collections
import dataclasses

from fusion.executors import STATS


@dataclasses.dataclass
class Metrics:
    ops: int = 0  # ATen ops intercepted on neuron tensors
    launches: int = 0  # executable launches (fused or not)
    flushes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    group_sizes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    cpu_fallbacks: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    h2d_bytes: int = 0
    d2h_bytes: int = 0


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
    # Executors (fusion/executors): launches that ran TorchInductor's code vs the rest;
    # Inductor's real compile wall time, apart from the modeled compile_time_us above.
    compiled_launches: int = 0
    interpreted_launches: int = 0
    compiled_groups: int = 0  # Inductor compiles (one per group and scalar values)
    inductor_cache_hits: int = 0  # of which Inductor answered from its FX graph cache
    inductor_compile_s: float = 0.0
    tier_ups: int = 0  # auto: groups sent to the background compiler
    compile_failures: dict = dataclasses.field(default_factory=dict)  # reason -> groups

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
    ex = _executor_counts()
    compiled = ex["compiled_launches"] - base.get("compiled_launches", 0)
    return Snapshot(
        compiled_launches=compiled,
        interpreted_launches=m.launches - base.get("launches", 0) - compiled,
        compiled_groups=ex["compiled_groups"] - base.get("compiled_groups", 0),
        inductor_cache_hits=ex["inductor_cache_hits"] - base.get("inductor_cache_hits", 0),
        inductor_compile_s=ex["compile_s"] - base.get("compile_s", 0.0),
        tier_ups=ex["tier_ups"] - base.get("tier_ups", 0),
        compile_failures={k: v - base.get("failures", {}).get(k, 0)
                          for k, v in ex["failures"].items()
                          if v - base.get("failures", {}).get(k, 0)},
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
        group_sizes=groups)


def _executor_counts() -> dict:
    c = STATS.counters
    return {"compiled_launches": c["compiled_launches"],
            "compiled_groups": c["compiled_groups"],
            "inductor_cache_hits": c["inductor_cache_hits"], "tier_ups": c["tier_ups"],
            "compile_s": STATS.compile_s, "failures": dict(STATS.failures)}


def base_of(engine) -> dict:
    """The cumulative counters `reset_metrics` subtracts from later snapshots."""
    r, st = engine.runner, engine.runner.cache.stats
    return {**_executor_counts(), "launches": engine.metrics.launches,
            "compiles": st.misses, "mem": st.memory_hits, "disk": st.disk_hits,
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
        ("launches compiled / interpreted",
         f"{s.compiled_launches} / {s.interpreted_launches}"),
        ("Inductor compiles (cache hits)", f"{s.compiled_groups} ({s.inductor_cache_hits})"),
        ("Inductor compile time (wall)", f"{s.inductor_compile_s:.2f} s"),
        ("tier-ups", s.tier_ups),
        ("groups not compiled", ", ".join(f"{k}={v}" for k, v in
                                          sorted(s.compile_failures.items())) or "-"),
        ("device time (simulated)", f"{s.device_time_us / 1e3:.3f} ms"),
        ("CPU fallbacks", ", ".join(f"{k}={v}" for k, v in sorted(s.cpu_fallbacks.items()))
         or "-"),
        ("host->device bytes", s.h2d_bytes), ("device->host bytes", s.d2h_bytes),
        ("HBM bytes moved by launches", s.hbm_bytes),
        ("bytes not written back", s.bytes_saved),
        ("device memory (now / peak)", f"{s.memory_bytes} / {s.peak_memory_bytes} B"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)
