"""Counters in one place (as tinygrad's GlobalCounters), and the readable report."""
from __future__ import annotations

import dataclasses

from device import COUNTERS


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
    plan_misses: int
    bad_executables: dict
    cache_evictions: int
    cpu_fallbacks: dict
    h2d_bytes: int
    d2h_bytes: int
    d2d_bytes: int
    device_time_us: float
    compile_time_us: float
    peak_memory_bytes: int
    memory_bytes: int
    bytes_saved: int
    hbm_bytes: int
    mean_group_size: float
    group_sizes: dict
    sync_sites: dict
    # Executors (fusion/executors): launches that ran TorchInductor's code vs the rest;
    # Inductor's real compile wall time, apart from the modeled compile_time_us above.
    compiled_launches: int = 0
    interpreted_launches: int = 0
    compiled_groups: int = 0  # Inductor compiles (one per group and scalar values)
    inductor_cache_hits: int = 0  # of which Inductor answered from its FX graph cache
    inductor_compile_s: float = 0.0
    tier_ups: int = 0  # auto: groups sent to the background compiler
    compile_failures: dict = dataclasses.field(default_factory=dict)  # reason -> groups
    collectives: int = 0
    collective_bytes: int = 0
    # Note [Overlap] in integration/distributed.py: collective-stream time, and the part of it
    # the compute stream waited for; the rest ran under compute or host work (hidden)
    collective_us: float = 0.0
    exposed_collective_us: float = 0.0
    replayed_ops: int = 0  # ops queued from a trace (Note [Replay]): no template, no lookup
    # Custom kernels (Note [Custom kernels]): their launches, device time and HBM bytes (also
    # counted in launches, device_time_us and hbm_bytes), and launches by kernel
    kernel_launches: int = 0
    kernel_time_us: float = 0.0
    kernel_hbm_bytes: int = 0
    kernels: dict = dataclasses.field(default_factory=dict)
    substitutions: dict = dataclasses.field(default_factory=dict)  # Note [Substitution]
    # Note [Compile causes] in fusion/causes.py: cause -> compiles ("new op sequence",
    # "new shape", "new dtype", "new scalar type", "new static argument", "new wiring",
    # "cache setting", "cache eviction"); for new shapes, "dim D of input I of op" -> compiles
    compile_causes: dict = dataclasses.field(default_factory=dict)
    compile_dims: dict = dataclasses.field(default_factory=dict)

    @property
    def hidden_collective_us(self) -> float:
        """Collective time that ran under compute or host work (Note [Overlap])."""
        return self.collective_us - self.exposed_collective_us

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


def snapshot(hbms) -> Snapshot:
    """The counters now (device.COUNTERS), with the device memory of the cores' `hbms`: in
    use now, summed; the peak, the largest core's (each core has its own share of HBM)."""
    c = COUNTERS
    groups = dict(c.group_sizes)
    n = sum(groups.values())
    return Snapshot(
        ops=c.ops, launches=c.launches, flushes=dict(c.flushes), compiles=c.compiles,
        cache_memory_hits=c.cache_memory_hits, cache_disk_hits=c.cache_disk_hits,
        cache_misses=c.cache_misses, plan_hits=c.plan_hits, plan_misses=c.plan_misses,
        cache_evictions=c.cache_evictions,
        bad_executables=dict(c.bad_executables), cpu_fallbacks=dict(c.cpu_fallbacks),
        h2d_bytes=c.h2d_bytes, d2h_bytes=c.d2h_bytes, d2d_bytes=c.d2d_bytes,
        device_time_us=c.device_time_us,
        compile_time_us=c.compile_time_us, peak_memory_bytes=max(h.peak for h in hbms),
        memory_bytes=sum(h.used for h in hbms), bytes_saved=c.bytes_saved, hbm_bytes=c.hbm_bytes,
        mean_group_size=(sum(k * v for k, v in groups.items()) / n) if n else 0.0,
        group_sizes=groups, sync_sites=dict(c.sync_sites),
        compiled_launches=c.compiled_launches,
        interpreted_launches=c.launches - c.compiled_launches,
        compiled_groups=c.compiled_groups, inductor_cache_hits=c.inductor_cache_hits,
        inductor_compile_s=c.inductor_compile_s, tier_ups=c.tier_ups,
        compile_failures=dict(c.compile_failures),
        collectives=c.collectives, collective_bytes=c.collective_bytes,
        collective_us=c.collective_us, exposed_collective_us=c.exposed_collective_us,
        replayed_ops=c.replayed_ops, kernel_launches=c.kernel_launches,
        kernel_time_us=c.kernel_time_us, kernel_hbm_bytes=c.kernel_hbm_bytes,
        kernels=dict(c.kernels), substitutions=dict(c.substitutions),
        compile_causes=dict(c.compile_causes),
        compile_dims=dict(c.compile_dims))


def report(s: Snapshot) -> str:
    rows = [
        ("ops intercepted", s.ops), ("of which replayed", s.replayed_ops),
        ("launches", s.launches),
        ("mean fused group size", f"{s.mean_group_size:.2f}"),
        ("flushes", ", ".join(f"{k}={v}" for k, v in sorted(s.flushes.items())) or "-"),
        ("compiles", s.compiles), ("cache hits (memory)", s.cache_memory_hits),
        ("cache hits (disk)", s.cache_disk_hits), ("cache misses", s.cache_misses),
        ("plan reuses", s.plan_hits),
        ("fused executables run op by op", ", ".join(
            f"{k}={v}" for k, v in sorted(s.bad_executables.items())) or "-"),
        ("compile causes", ", ".join(f"{k}={v}" for k, v in sorted(
            s.compile_causes.items(), key=lambda kv: -kv[1])) or "-"),
        ("new shapes by input dim", ", ".join(f"{k}={v}" for k, v in sorted(
            s.compile_dims.items(), key=lambda kv: -kv[1])[:3]) or "-"),
        ("compile time (modeled)", f"{s.compile_time_us / 1e3:.1f} ms"),
        ("launches compiled / interpreted",
         f"{s.compiled_launches} / {s.interpreted_launches}"),
        ("Inductor compiles (cache hits)", f"{s.compiled_groups} ({s.inductor_cache_hits})"),
        ("Inductor compile time (wall)", f"{s.inductor_compile_s:.2f} s"),
        ("tier-ups", s.tier_ups),
        ("groups not compiled", ", ".join(f"{k}={v}" for k, v in
                                          sorted(s.compile_failures.items())) or "-"),
        ("device time (simulated)", f"{s.device_time_us / 1e3:.3f} ms"),
        ("custom kernel launches (time, HBM)",
         f"{s.kernel_launches} ({s.kernel_time_us / 1e3:.3f} ms, {s.kernel_hbm_bytes} B)"
         + (": " + ", ".join(f"{k}={v}" for k, v in sorted(s.kernels.items()))
            if s.kernels else "")),
        ("patterns substituted", ", ".join(f"{k}={v}" for k, v in
                                           sorted(s.substitutions.items())) or "-"),
        ("CPU fallbacks", ", ".join(f"{k}={v}" for k, v in sorted(s.cpu_fallbacks.items()))
         or "-"),
        ("collectives (bytes)", f"{s.collectives} ({s.collective_bytes} B)"),
        ("communication exposed / hidden", f"{s.exposed_collective_us / 1e3:.3f} / "
         f"{(s.collective_us - s.exposed_collective_us) / 1e3:.3f} ms"),
        ("host->device bytes", s.h2d_bytes), ("device->host bytes", s.d2h_bytes),
        ("core->core bytes", s.d2d_bytes),
        ("HBM bytes moved by launches", s.hbm_bytes),
        ("bytes not written back", s.bytes_saved),
        ("device memory (now / peak)", f"{s.memory_bytes} / {s.peak_memory_bytes} B"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)
