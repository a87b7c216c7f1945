"""The dependency graph of a queued segment, and its partition into fusable groups.

Note [Partitioning]: the partitioner is shared; strategies only answer "must a boundary fall
between the open group and this node, and why?". Groups are contiguous runs of the queue
order, a topological order of the graph, so every group is convex (a path leaving a group
and coming back would need a node between two of its members in that order, and all such
nodes are members), and random ops keep their eager order. Legality (`legal`) and
profitability (`pays`) are separate questions; every "no" returns a reason.
"""
from __future__ import annotations

import dataclasses

import networkx as nx

from device import DeviceSpec

from .ir import Node
from .ops import CONTRACTION, KERNEL, POINTWISE


def dependency_graph(nodes: list[Node]) -> nx.DiGraph:
    """Edges for read-after-write, write-after-read and write-after-write on buffers."""
    g = nx.DiGraph()
    writer: dict[int, int] = {}
    readers: dict[int, list[int]] = {}
    for i, n in enumerate(nodes):
        g.add_node(i, name=n.name, cls=n.cls)
        reads = {n.uids[li] for li in n.reads}
        writes = {n.uids[li] for li in n.writes}
        for u in reads:
            if u in writer:
                g.add_edge(writer[u], i, kind="RAW")
        for u in writes:
            if u in writer:
                g.add_edge(writer[u], i, kind="WAW")
            for r in readers.get(u, ()):
                if r != i:
                    g.add_edge(r, i, kind="WAR")
        for u in reads:
            readers.setdefault(u, []).append(i)
        for u in writes:
            writer[u] = i
            readers[u] = []
    return g


@dataclasses.dataclass
class GroupState:
    """What a strategy may ask of the open group."""

    size: int = 0
    contractions: int = 0
    inplace: bool = False
    nbytes: int = 0  # bytes read + written by its ops, counted per op
    produced: int = 0  # bytes of the values its ops produce: the on-chip working set bound
    flops: float = 0.0
    kernel: str | None = None  # the custom kernel it holds (then alone: `kernel_cut`)
    elementwise: bool = True  # pointwise ops only (Note [Elementwise groups stream])

    def add(self, n: Node) -> None:
        self.size += 1
        self.elementwise = self.elementwise and n.cls == POINTWISE
        if n.cls == KERNEL:
            self.kernel = n.name
        self.contractions += n.cls == CONTRACTION
        self.inplace = self.inplace or n.op.inplace
        self.nbytes += n.in_bytes + n.out_bytes
        self.produced += n.out_bytes
        self.flops += n.flops


class Strategy:
    """Where boundaries fall. `cut` returns the reason for a boundary before `n`, or None."""

    name = "base"

    def __init__(self, spec: DeviceSpec | None = None, max_group_ops: int = 128,
                 max_contractions: int = 4):
        self.spec = spec or DeviceSpec()
        self.max_group_ops = max_group_ops
        self.max_contractions = max_contractions
        # Everything that can move a boundary: part of a cached plan's key, which the plan
        # cache hashes per flush (per op in eager mode): the spec as its fingerprint, a
        # string (hashed once; the spec's dataclass hash goes over every field, in Python)
        self.key = (self.name, max_group_ops, max_contractions, self.spec.fingerprint())

    def cut(self, g: GroupState, n: Node, dependent: bool) -> str | None:
        raise NotImplementedError


class GraphStrategy(Strategy):
    """Our default (fusion/README.md, "Fusion rules"): pointwise chains, pointwise into and
    out of reductions, contraction epilogues, horizontal concatenation when the cost model
    pays.

    Note [Contractions per group]: a group may hold up to `max_contractions` (default 4)
    contractions, the shapes of the fused kernels a NeuronCore runs well: attention's
    QK^T -> softmax -> PV, an MLP's two linears with the activation between, a linear's
    backward pair dX/dW (independent, concatenated). Its working set (every value its ops
    produce) must fit in SBUF, so kernel-sized groups stay kernel-sized on large tensors.

    Note [Elementwise groups stream]: a group of pointwise ops only (an optimizer step's
    foreach ops, a chain of activations) is not bounded by SBUF: each output element needs
    the same-position elements of its inputs only, so the kernel runs tile by tile and
    holds a tile of each live value, whatever the tensors' size (as TorchInductor's and the
    Neuron compiler's fused elementwise loops do). The bound applies once the group holds
    a contraction, a reduction or any other op, whose working set is the whole value.
    Without this, AdamW's 8 foreach ops over a d=512 MLP's 17 MB of parameters were 8
    launches, each one cut by "SBUF capacity"."""

    name = "graph"

    def cut(self, g, n, dependent):
        return self.legal(g, n) or (None if dependent else self.pays(g, n))

    def legal(self, g, n) -> str | None:
        if g.size >= self.max_group_ops:
            return f"size limit ({self.max_group_ops} ops)"
        if n.cls == CONTRACTION and g.contractions >= self.max_contractions:
            return f"contraction limit ({self.max_contractions})"
        if g.produced + n.out_bytes > self.spec.sbuf_bytes and not (
                g.elementwise and n.cls == POINTWISE):  # Note [Elementwise groups stream]
            return "SBUF capacity"
        return None

    def pays(self, g, n) -> str | None:
        """Horizontal fusion of an independent op: one launch must cost less than two.
        A heuristic, not needed for correctness."""
        s = self.spec
        apart = s.launch_us(g.nbytes, g.flops) + s.launch_us(n.in_bytes + n.out_bytes, n.flops)
        joined = s.launch_us(g.nbytes + n.in_bytes + n.out_bytes, g.flops + n.flops)
        return None if joined < apart else "horizontal fusion does not pay"


class MatmulStrategy(Strategy):
    """The reference's policy: a group is everything since the last boundary up to and
    including the next matmul-class op; in-place ops are boundaries and run unfused."""

    name = "matmul"

    def cut(self, g, n, dependent):
        if g.contractions:
            return "after matmul"
        if g.inplace or n.op.inplace:
            return "in-place op"
        return None


class NoneStrategy(Strategy):
    """Every op its own launch (eager's grouping, with adaptive's laziness)."""

    name = "none"

    def cut(self, g, n, dependent):
        return "strategy none"


STRATEGIES = {s.name: s for s in (GraphStrategy, MatmulStrategy, NoneStrategy)}


def kernel_cut(g: GroupState, n: Node) -> str | None:
    """Note [Custom kernels] in kernels.py: a custom kernel is a launch of its own, whatever
    the strategy: a boundary before it and after it."""
    if n.cls == KERNEL:
        return f"custom kernel {n.name} (a launch of its own)"
    if g.kernel is not None:
        return f"after custom kernel {g.kernel}"
    return None


def partition(nodes: list[Node], graph: nx.DiGraph, strategy: Strategy
              ) -> tuple[list[list[int]], list[str]]:
    """Groups (node indices) and, for each group after the first, why it was cut."""
    groups: list[list[int]] = []
    reasons: list[str] = []
    cur: list[int] = []
    members: set[int] = set()
    state = GroupState()
    for i, n in enumerate(nodes):
        if cur:
            why = kernel_cut(state, n) if state.kernel is not None or n.cls == KERNEL \
                else strategy.cut(state, n, any(p in members for p in graph.predecessors(i)))
            if why is not None:
                groups.append(cur)
                reasons.append(why)
                cur, members, state = [], set(), GroupState()
        cur.append(i)
        members.add(i)
        state.add(n)
    if cur:
        groups.append(cur)
    return groups, reasons


class OnlineGroup:
    """The open group at the queue's tail, kept as ops are recorded, so the adaptive policy
    can flush at a natural cut without partitioning. Its dependence test is the graph's
    edge relation (RAW, WAR, WAW) restricted to the group."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.state = GroupState()
        self.reads: set[int] = set()
        self.writes: set[int] = set()

    def cut(self, strategy: Strategy, n: Node, ids: list) -> str | None:
        """Why a boundary falls before `n` (to be added next; `ids`: its buffers' identities,
        by local index), or None. Plain loops: this and `add` run per op."""
        if not self.state.size:
            return None
        if n.cls == KERNEL or self.state.kernel is not None:
            return kernel_cut(self.state, n)
        # New buffers are fresh: only argument buffers can meet the group's (reads are all
        # arguments; in-place writes are among them).
        op = n.op
        writes = self.writes
        for li in op.reads:
            if ids[li] in writes:
                return strategy.cut(self.state, n, True)
        reads = self.reads
        for li in op.arg_writes:
            if ids[li] in reads:
                return strategy.cut(self.state, n, True)
        return strategy.cut(self.state, n, False)

    def add(self, n: Node, reason: str | None, ids: list) -> None:
        if reason is not None:
            self.reset()
        self.state.add(n)
        op = n.op
        reads, writes = self.reads, self.writes
        for li in op.reads:
            reads.add(ids[li])
        for li in op.writes:
            writes.add(ids[li])
