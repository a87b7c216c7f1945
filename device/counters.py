"""Every counter in one object that is never replaced (as tinygrad's GlobalCounters).

Each layer adds to `COUNTERS` where the counted thing happens: the device counts launches and
device time, the fusion layer cache lookups and compiles, the engine ops, flushes and
fallbacks. Replacing a device, a runner or a cache (a settings change) never touches it, so
no figure can go backwards; `reset()` zeroes it in place.
"""
from __future__ import annotations

import collections
import dataclasses


class Tally(collections.Counter):
    """A Counter whose `c[k] += n` costs a dict's: Counter's own `__delitem__` (in Python)
    sends every store through Python's slot lookup (~0.1 us more each, and an eager op counts
    four). `del` of a missing key raises KeyError, as a dict's does."""

    __delitem__ = dict.__delitem__


@dataclasses.dataclass
class Counters:
    ops: int = 0  # ATen ops intercepted on neuron tensors
    replayed_ops: int = 0  # of which queued from a trace (Note [Replay] in the engine)
    launches: int = 0  # executable launches on the device (fused or not)
    dmas: int = 0  # host<->device copies
    device_time_us: float = 0.0  # simulated device time of every launch and copy
    hbm_bytes: int = 0  # HBM bytes read and written by launches
    # Custom kernels' launches (included in the figures above too), their device time and
    # HBM bytes, and launches by kernel name
    kernel_launches: int = 0
    kernel_time_us: float = 0.0
    kernel_hbm_bytes: int = 0
    kernels: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    # Note [Substitution] (fusion/substitute.py): queued patterns replaced, by kernel
    substitutions: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    d2d_bytes: int = 0  # core to core
    flushes: collections.Counter = dataclasses.field(default_factory=Tally)  # counted per op
    group_sizes: collections.Counter = dataclasses.field(default_factory=Tally)  # (eager)
    cpu_fallbacks: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    plan_hits: int = 0  # segments that reused a plan: no graph, partition or cache lookup
    plan_misses: int = 0
    cache_memory_hits: int = 0  # executable lookups answered by each level...
    cache_disk_hits: int = 0
    cache_misses: int = 0  # ...or by neither (a compile follows)
    cache_evictions: int = 0
    cache_disk_errors: int = 0  # corrupt or foreign cache files ignored
    compiles: int = 0  # executables built
    # Note [Compile causes] in fusion/causes.py: cause -> compiles; "dim D of input I of op"
    # -> new-shape compiles; one record per compile (the newest 100,000)
    compile_causes: collections.Counter = dataclasses.field(
        default_factory=collections.Counter)
    compile_dims: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    compile_log: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=100_000))
    compile_time_us: float = 0.0  # modeled compile time
    # Tensors entering the device (host-to-device copies: `.to("neuron")`, copy_ from the
    # host): (number, the user's source, shape), the newest 10,000; a compile record keeps
    # the number of the last one, so the line whose sizes its new shape follows can be
    # found (churn in adaptive_eager/tools/lines.py)
    entries: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=10_000))
    n_entries: int = 0
    bad_executables: collections.Counter = dataclasses.field(
        default_factory=collections.Counter)  # fused compiles that failed, by reason
    bytes_saved: int = 0  # bytes of values freed before their flush, never written back
    collectives: int = 0  # torch.distributed collectives and P2P ops on neuron tensors
    collective_bytes: int = 0  # their payload (bytes of this rank's tensors they carry)
    collective_us: float = 0.0  # their time on the collective stream (Note [Collective stream])
    exposed_collective_us: float = 0.0  # of which the compute stream waited for
    # Executors (fusion/executors): launches that ran TorchInductor's code; Inductor's real
    # compile wall time, apart from the modeled compile_time_us above.
    compiled_launches: int = 0
    compiled_groups: int = 0  # Inductor compiles (one per group and scalar values)
    inductor_cache_hits: int = 0  # of which Inductor answered from its FX graph cache
    inductor_compile_s: float = 0.0
    tier_ups: int = 0  # auto: groups sent to the background compiler
    compile_failures: collections.Counter = dataclasses.field(
        default_factory=collections.Counter)  # reason -> groups left to the interpreter
    # "reason@file:line" -> host reads (item, repr, cpu...) that flushed queued work
    sync_sites: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, f.default_factory() if f.default is dataclasses.MISSING
                    else f.default)


COUNTERS = Counters()
