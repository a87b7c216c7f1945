"""The cost of a collective over the interconnect: ring and tree models on two levels (Note
[Interconnect assumptions] in spec.py). Pure arithmetic on a DeviceSpec: nothing here moves
data.

With k ranks on one level, a per-rank bandwidth B and a hop latency a (alpha-beta model, as
in the NCCL and "Bandwidth optimal all-reduce" literature):
- ring all-reduce of n bytes: 2(k-1) steps of n/k bytes: 2(k-1)(a + n/(kB));
- tree all-reduce (a pipelined double binary tree): 2 ceil(log2 k) hops of latency, and the
  payload crosses each rank's link twice: 2 ceil(log2 k) a + 2n/B;
- ring all-gather / reduce-scatter (n = the whole gathered buffer), all-to-all: (k-1)(a + n/(kB));
- broadcast, reduce, gather, scatter: a binary tree, ceil(log2 k) hops of the whole payload;
- send / recv: one hop; barrier: a dissemination barrier, ceil(log2 k) empty hops.
Every collective also pays one launch overhead, as any device launch does.

Note [Two-level interconnect]: ranks fill instances of `ranks_per_instance` (NeuronLink
inside: `interconnect_*`; EFA between: `inter_instance_*`, one NIC bandwidth per instance
shared by its ranks). Within one instance, all-reduce is a ring or a tree, whichever is
faster for the size (NCCL's rule: trees for small messages). Across m instances of L
ranks, collectives are hierarchical, as NCCL's and the Neuron runtime's:
- all-reduce: the faster for the size (NCCL's choice) of a hierarchical one (reduce-scatter
  inside each instance, a ring over L; then L concurrent all-reduces of n/L bytes across
  instances, one per local rank, each with B_efa / L of the NIC, a ring or a tree, whichever
  is faster: the per-level choice; then all-gather inside) and a tree spanning both levels
  (ceil(log2 L) hops inside and ceil(log2 m) over EFA, each way, the payload at the slower
  link's speed: small messages);
- all-gather / reduce-scatter / all-to-all: the instance level over each rank's share, then
  the ring inside;
- tree ops: ceil(log2 m) hops over EFA, then ceil(log2 L) inside; barrier likewise.
Assumptions: ranks are packed (rank r on instance r // L), every instance is full, the
network is non-blocking (no congestion between instance pairs), and no level overlaps
another. `collective_plan` names the algorithm it took.
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


def _log2(k: int) -> int:
    return math.ceil(math.log2(k)) if k > 1 else 0


def _ring_all_reduce(a, bw, n, k):
    return 2 * (k - 1) * (a + n / (k * bw)) if k > 1 else 0.0


def _tree_all_reduce(a, bw, n, k):
    return 2 * _log2(k) * a + 2 * n / bw if k > 1 else 0.0


def _ring_gather(a, bw, n, k):
    return (k - 1) * (a + n / (k * bw)) if k > 1 else 0.0


def _tree(a, bw, n, k):
    return _log2(k) * (a + n / bw)


def collective_plan(spec: DeviceSpec, pattern: str, nbytes: int, world: int) -> tuple[float, str]:
    """(simulated device time in us, the algorithm) of one collective of `nbytes` (the
    payload) over `world` ranks (Note [Two-level interconnect])."""
    assert pattern in PATTERNS, f"unknown collective pattern {pattern!r}, not in {PATTERNS}"
    a1, b1 = spec.interconnect_latency_us, spec.interconnect_gbps * 1e3  # bytes per us
    a2, nic = spec.inter_instance_latency_us, spec.inter_instance_gbps * 1e3
    p = max(int(world), 1)
    per_instance = spec.ranks_per_instance
    inner, m = min(p, per_instance), -(-p // per_instance)  # ranks per instance, instances
    b2 = nic / inner  # each local rank's share of the NIC
    n = nbytes
    if pattern == P2P:  # neighbours (pipeline stages) sit in one instance
        return spec.launch_overhead_us + a1 + n / b1, "p2p"
    if p == 1:
        return spec.launch_overhead_us, "none"  # one rank: nothing crosses a link
    if pattern == RING_ALL_REDUCE:  # the fastest of the algorithms for this size
        if m == 1:
            plans = [(_ring_all_reduce(a1, b1, n, p), "ring"),
                     (_tree_all_reduce(a1, b1, n, p), "tree")]
        else:
            ring, tree = (_ring_all_reduce(a2, b2, n / inner, m),
                          _tree_all_reduce(a2, b2, n / inner, m))
            cross, how = (ring, "ring") if ring <= tree else (tree, "tree")
            plans = [(2 * _ring_gather(a1, b1, n, inner) + cross,
                      f"hierarchical (ring in {inner}, {how} across {m} instances)"),
                     (2 * (_log2(inner) * a1 + _log2(m) * a2) + 2 * n / min(b1, nic),
                      "tree (two levels)")]
        wire, algo = min(plans)
    elif pattern == RING_GATHER:
        wire = _ring_gather(a1, b1, n, inner) + _ring_gather(a2, b2, n / inner, m)
        algo = "ring" if m == 1 else f"hierarchical (ring across {m} instances, ring in {inner})"
    elif pattern == TREE:
        wire = _tree(a1, b1, n, inner) + _tree(a2, nic, n, m)
        algo = "tree" if m == 1 else "tree (across instances, then inside)"
    else:  # BARRIER
        wire = _log2(inner) * a1 + _log2(m) * a2
        algo = "dissemination"
    return spec.launch_overhead_us + wire, algo


def collective_us(spec: DeviceSpec, pattern: str, nbytes: int, world: int) -> float:
    """Simulated device time of one collective of `nbytes` (the payload) over `world` ranks."""
    return collective_plan(spec, pattern, nbytes, world)[0]
