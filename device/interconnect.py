"""The cost of a collective over the interconnect: ring and tree models (Note [Interconnect
assumptions] in spec.py). Pure arithmetic on a DeviceSpec: nothing here moves data.

With p ranks, a link bandwidth B and a hop latency a (alpha-beta model, as in the NCCL and
"Bandwidth optimal all-reduce" literature):
- ring all-reduce of n bytes: 2(p-1) steps of n/p bytes: 2(p-1)(a + n/(pB));
- ring all-gather / reduce-scatter (n = the whole gathered buffer), all-to-all: (p-1)(a + n/(pB));
- broadcast, reduce, gather, scatter: a binary tree, ceil(log2 p) hops of the whole payload;
- send / recv: one hop; barrier: a dissemination barrier, ceil(log2 p) empty hops.
Every collective also pays one launch overhead, as any device launch does.
"""
from __future__ import annotations

import math

from .spec import DeviceSpec

RING_ALL_REDUCE = "all_reduce"
RING_GATHER = "ring"  # all_gather, reduce_scatter, all_to_all: each rank sends (p-1)/p of n
TREE = "tree"  # broadcast, reduce, gather, scatter
P2P = "p2p"
BARRIER = "barrier"
PATTERNS = (RING_ALL_REDUCE, RING_GATHER, TREE, P2P, BARRIER)


def collective_us(spec: DeviceSpec, pattern: str, nbytes: int, world: int) -> float:
    """Simulated device time of one collective of `nbytes` (the payload) over `world` ranks."""
    assert pattern in PATTERNS, f"unknown collective pattern {pattern!r}, not in {PATTERNS}"
    a, bw = spec.interconnect_latency_us, spec.interconnect_gbps * 1e3  # bytes per us
    p = max(int(world), 1)
    if pattern == P2P:
        wire = a + nbytes / bw
    elif p == 1:
        wire = 0.0  # one rank: nothing crosses a link
    elif pattern == RING_ALL_REDUCE:
        wire = 2 * (p - 1) * (a + nbytes / (p * bw))
    elif pattern == RING_GATHER:
        wire = (p - 1) * (a + nbytes / (p * bw))
    elif pattern == TREE:
        wire = math.ceil(math.log2(p)) * (a + nbytes / bw)
    else:  # BARRIER
        wire = math.ceil(math.log2(p)) * a
    return spec.launch_overhead_us + wire
