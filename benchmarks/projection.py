"""Re-costing a measured step's collectives at more ranks, for dp_step.py and
fsdp_tp_llama.py (Note [DP projection] in benchmarks/README.md): a projection, not a measurement."""
from __future__ import annotations


def collectives_us(last_step, where) -> float:
    """The time of the collectives `last_step` lists ((timeline name, bytes) pairs:
    "c10d::allreduce_", ...), each re-costed by device/interconnect.py with its own pattern
    (ring, tree, ...) on the spec and rank count `where(pattern)` gives."""
    from adaptive_eager.integration.distributed import _COLLECTIVES
    from device.interconnect import collective_plan
    total = 0.0
    for name, nbytes in last_step:
        pattern = _COLLECTIVES[name.split("::")[1]][0]
        spec, ranks = where(pattern)
        total += collective_plan(spec, pattern, nbytes, ranks)[0]
    return total
