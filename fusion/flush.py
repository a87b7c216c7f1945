"""Running a queued segment: plan (graph, partition, executables), launch, write back.

Note [Plan cache]: a segment's signature is its nodes' signatures, how they share buffers
(uids renumbered by first appearance) and which pending values are still alive. A segment
identical to one seen before reuses its plan, i.e. its groups and resolved executables,
without building the graph or partitioning again: a steady-state loop pays neither.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import warnings
import weakref

import networkx as nx
import torch

from device import COUNTERS, Buffer, Device, Launch, LaunchError

from .cache import ExecutableCache
from .causes import HISTORY
from .ir import Handle, Node
from .partition import Strategy, dependency_graph, partition
from .program import CompileError, Executable, Program, build_program, run_instr, skip
from . import substitute as substitution

log = logging.getLogger("adaptive_eager.fusion")
_LOW_PRECISION = ("bfloat16", "float16")
_CPU = torch.device("cpu")


@dataclasses.dataclass
class GroupPlan:
    start: int  # node indices [start, end) of the segment
    end: int
    exe: Executable
    slots: list[int]  # segment buffer index (Node.uids) held by each slot
    outputs: list[int]  # slots written back
    nbytes: int
    flops: float
    low_precision: bool  # BF16/FP16 values: the device's faster peak applies
    level: str  # where its executable came from when the plan was built
    kernel: bool = False  # a custom kernel's launch (Note [Custom kernels] in kernels.py)
    overhead_us: float = 0.0  # its declared fixed cost
    op_costs: tuple = ()  # (FLOPs, bytes) per op alone: the line report's split of its time
    cost: tuple = (None, 0.0)  # (spec, its launch's modeled us on that spec): computed once
    # One op launched alone (set by `_plan`: `Plan.one`): the segment indices of its input
    # slots, in order, and a None per other slot (`run_sig` fills the storages with them)
    ins: tuple = ()
    pad: tuple = ()


@dataclasses.dataclass
class Plan:
    groups: list[GroupPlan]
    reasons: list[str]  # boundary before group i+1
    graph: nx.DiGraph
    skipped_bytes: int  # bytes of created values never written back (freed before flush)
    launches: int = 0
    sizes: collections.Counter = None  # group size -> count, for the metrics
    size_items: tuple = ()  # its items (counted per flush: per op in eager mode)
    # (launches, device us, HBM bytes) of this flush as planned
    totals: tuple = None
    one: GroupPlan = None  # its group, when it is one op launched alone (eager mode)

    def __post_init__(self):
        self.launches = sum(g.end - g.start if isinstance(g.exe, OneByOne) else 1
                            for g in self.groups)
        self.sizes = collections.Counter(g.end - g.start for g in self.groups)
        self.size_items = tuple(self.sizes.items())


@dataclasses.dataclass
class FlushReport:
    """What one flush did: the data behind `ae.explain()` (read from its plan on demand)."""

    reason: str
    strategy: str
    n_ops: int
    plan: Plan
    plan_hit: bool
    compiled: list[bool] = None  # per group: ran TorchInductor's code (fusion/executors)
    nodes: list = None  # the flushed nodes (their sources: explain's lines)
    substitutions: list = ()  # Note [Substitution]: fusion.substitute.Substitution each
    declined: list = ()  # patterns found but not replaced: the flush costs less without
    unsubstituted: tuple = None  # (launches, device us, HBM bytes) with no pattern replaced
    sig: tuple = None  # the plan's key (Note [Plan cache])

    @property
    def groups(self) -> list[dict]:
        return [{"name": g.exe.name, "ops": g.end - g.start, "bytes": g.nbytes,
                 "kernel": g.kernel,
                 "flops": g.flops, "level": "plan" if self.plan_hit else g.level,
                 "bad": getattr(g.exe, "reason", None),
                 "compiled": bool(self.compiled and self.compiled[i])}
                for i, g in enumerate(self.plan.groups)]

    boundaries = property(lambda self: self.plan.reasons)
    launches = property(lambda self: self.plan.launches)
    bytes_saved = property(lambda self: self.plan.skipped_bytes)
    graph = property(lambda self: self.plan.graph)


class Runner:
    def __init__(self, device: Device, cache: ExecutableCache, max_plans: int = 256,
                 executor=None):
        self.device = device
        self.executor = executor  # None: the interpreter; else fusion.executors.tiered
        self.cache = cache
        self.plans: collections.OrderedDict[tuple, Plan] = collections.OrderedDict()
        self.max_plans = max_plans
        self.compile_hook = None  # tests: called with each Program compiled; may raise
        self.done = 0  # nodes of the running flush whose group has run (an interrupted one)
        self.origin = None  # Note [Substitution]: original index + 1 of each planned node
        self.choices: dict = {}  # Note [Substitution]: flush signature -> what to replace

    def compile(self, program: Program, nodes=None) -> Executable:
        """`nodes`: the group's nodes (their sources name the compile's lines)."""
        if self.compile_hook is not None:
            self.compile_hook(program)
        exe = Executable(program)
        us = self.device.spec.compile_us(len(program.instrs))
        HISTORY.cause(program, self.cache.serial, nodes, us)  # Note [Compile causes]
        log.info("compile %s (%d ops, %.0f ms modeled)", program.name[:100],
                 len(program.instrs), us / 1e3)
        COUNTERS.compiles += 1
        COUNTERS.compile_time_us += us
        self.device.mark(program.name, "compile", us)
        self.device.advance_host(us)  # the host waits for the compiler
        return exe

    def run(self, nodes: list[Node], refs: list, reason: str, strategy: Strategy,
            substitute: bool = False) -> FlushReport:
        """`flush`, and its report."""
        return FlushReport(*self.flush(nodes, refs, reason, strategy, substitute))

    def flush(self, nodes: list[Node], refs: list, reason: str, strategy: Strategy,
              substitute: bool = False) -> tuple:
        """Run a queued segment: its nodes, and its buffers by index (Node.uids: numbered by
        first use, so equal segments have equal numbers), each a handle or a weakref to a
        pending one (None once its tensors are gone: never written back). `substitute`:
        recognized patterns become library kernels (Note [Substitution]). Returns its
        FlushReport's fields, in order: the engine makes the report when it is read (an
        eager op is a flush, and most reports are never read)."""
        self.done = 0
        self.origin = None
        handles: list[Handle | None] = [r() if type(r) is weakref.ref else r for r in refs]
        n_ops, subs, declined = len(nodes), [], []
        self.unsubstituted = None
        if substitute:
            found = substitution.find(nodes, handles)
            if found:
                subs, declined = self._choose(nodes, found, handles, strategy)
                nodes = substitution.apply(nodes, subs)
                if subs:  # original index + 1 of each node (a kernel: its place's, Substitution.at)
                    gone = {k for s in subs for k in s.replaced if k not in s.at}
                    self.origin = [0] + [i + 1 for i in range(n_ops) if i not in gone]
        live = tuple([h is not None for h in handles])
        # Nodes of one signature share one OpSig object (the engine caches it): identity
        # stands for the whole signature and hashes in O(1).
        sig = (strategy.key, tuple([n.op for n in nodes]), tuple([n.uids for n in nodes]),
               live)
        return self.run_sig(nodes, handles, sig, reason, strategy, n_ops, subs, declined)

    def run_sig(self, nodes, handles, sig, reason, strategy, n_ops=None, subs=(),
                declined=()) -> tuple:
        """`flush`, given the segment's buffers (None: gone) and its plan key: an eager op
        replayed (Note [Eager launches] in adaptive_eager/engine/replay.py) knows both, and
        substitutes nothing (`n_ops` None: `flush`'s start is done here)."""
        if n_ops is None:
            self.done = 0
            self.origin = None
            self.unsubstituted = None
            n_ops = len(nodes)
        plan = self.plans.get(sig)
        hit = plan is not None
        if hit:
            self.plans.move_to_end(sig)
            COUNTERS.plan_hits += 1  # no executable was looked up: no cache hit is counted
        else:
            plan = self._plan(nodes, handles, strategy)
            self.plans[sig] = plan
            if len(self.plans) > self.max_plans:
                self.plans.popitem(last=False)
            COUNTERS.plan_misses += 1
        gp, dev, st = plan.one, self.device, None
        if gp is not None and not dev._pending:
            st = []
            for c in gp.ins:
                h = handles[c]
                if h.poison is not None:
                    st = None
                    break
                st.append(h.buffer.storage)
        if st is None:
            compiled = self._execute(nodes, plan, handles)
        else:  # `_execute`, for its common case: one op launched alone (`Plan.one`), no
            # input poisoned, no collective pending (Note [Collective stream])
            compiled = None if self.executor is None else [False]
            node, exe, slots = nodes[0], gp.exe, gp.slots
            st += gp.pad
            views = _host_views(exe, slots, handles, ())
            poisoned, causes, members = set(), {}, [node]
            args = (st, [node.inputs], dev.rng, poisoned, causes, views)
            spec, cost = gp.cost
            if gp.kernel:
                launch = dev.submit(Launch(exe.name, functools.partial(exe.run, *args),
                                           gp.nbytes, gp.flops, gp.low_precision,
                                           context=members, kind="kernel",
                                           overhead_us=gp.overhead_us,
                                           nodes=((node.source,), gp.op_costs)))
                launch = launch if launch.error is not None else None
            else:  # a plain launch, its cost known (Note [Eager launches])
                if spec is not dev.spec:
                    spec = dev.spec
                    cost = spec.launch_us(gp.nbytes, gp.flops, gp.low_precision) \
                        + gp.overhead_us
                    gp.cost = spec, cost
                launch = dev.submit_plain(exe.name, exe.run, args, cost, gp.nbytes, gp.flops,
                                          gp.low_precision, ((node.source,), gp.op_costs),
                                          members)
            if launch is not None or poisoned:
                self._written(gp, exe, st, poisoned, causes, launch, members, {}, {}, handles,
                              views)
            else:
                nv, hbm = exe.n_views, dev.hbm
                for s in gp.outputs:
                    h = handles[slots[s]]
                    if h is not None and h.pending:
                        h.buffer = buf = Buffer(h.nbytes, hbm, st[s])  # (Device.alloc's)
                        h.pending = False
                        h.poison = None
                        r = views[nv + s]
                        if r is not None:  # Note [Host views]
                            buf.host = (exe.out_keys[s], r)
                self.done = gp.end if self.origin is None else self.origin[gp.end]
        if log.isEnabledFor(logging.INFO):
            log.info("flush (%s): %d ops -> %d launches, plan %s", reason, len(nodes),
                     len(plan.groups), "reused" if hit else "built")
            for i, why in enumerate(plan.reasons):
                log.debug("  boundary before group %d: %s", i + 1, why)
        COUNTERS.bytes_saved += plan.skipped_bytes
        if subs:
            COUNTERS.substitutions.update(s.kernel for s in subs)
        return (reason, strategy.name, n_ops, plan, hit, compiled, nodes, subs, declined,
                self.unsubstituted, sig)

    def _plan(self, nodes, handles, strategy) -> Plan:
        graph = dependency_graph(nodes)
        groups, reasons = partition(nodes, graph, strategy)
        plans, skipped = [], 0
        for gi, members, keep, nbytes, low, cost, dropped in _groups(nodes, groups, handles):
            g = groups[gi]
            skipped += dropped
            program, slot_uids = build_program(members, keep)
            exe, level = self._executable(program, members)
            slots = slot_uids  # segment buffer indices
            plans.append(GroupPlan(g[0], g[-1] + 1, exe, slots, list(program.outputs),
                                   nbytes, sum(n.flops for n in members), low, level,
                                   cost is not None, cost.overhead_us if cost else 0.0,
                                   tuple((n.op.flops, n.in_bytes + n.out_bytes)
                                         for n in members)))
        plan = Plan(plans, reasons, graph, skipped)
        gp = plans[0] if len(plans) == 1 and len(nodes) == 1 else None
        if gp is not None and not isinstance(gp.exe, OneByOne) and not (
                self.executor is not None and len(gp.exe.instrs) > 1):  # (`_execute`'s)
            plan.one = gp
            gp.ins = tuple(gp.slots[:gp.exe.program.n_inputs])
            gp.pad = (None,) * (gp.exe.program.n_slots - len(gp.ins))
        spec = self.device.spec
        plan.totals = (plan.launches, sum(spec.launch_us(g.nbytes, g.flops, g.low_precision)
                                          + g.overhead_us for g in plans),
                       sum(g.nbytes for g in plans))
        return plan

    def _choose(self, nodes, found, handles, strategy):
        """Note [Substitution]: which found patterns to replace: those that lower the flush's
        modeled device time (greedy: all, then each dropped if the flush costs less without
        it), each with what it saves. Cached per flush signature and kernels (runtime scalars
        the match read are static arguments of the kernels' signatures)."""
        key = (strategy.key, tuple([n.op for n in nodes]), tuple([n.uids for n in nodes]),
               tuple([h is not None for h in handles]),
               tuple([k.op for s in found for k in s.at.values()]))
        known = self.choices.get(key)
        if known is None:
            cost = functools.partial(self._cost, handles=handles, strategy=strategy)
            chosen = list(found)
            best = cost(substitution.apply(nodes, chosen))
            better = True
            while better and chosen:
                better = False
                for s in list(chosen):
                    trial = [t for t in chosen if t is not s]
                    c = cost(substitution.apply(nodes, trial))
                    if c[1] < best[1] - 1e-6:
                        chosen, best, better = trial, c, True
            none = cost(nodes)
            if none[1] <= best[1] + 1e-6:  # no gain: nothing replaced
                chosen, best = [], none
            saved = []
            for s in found:
                other = [t for t in chosen if t is not s] if s in chosen else chosen + [s]
                c = cost(substitution.apply(nodes, sorted(other, key=found.index)))
                saved.append(tuple(a - b for a, b in zip(c, best)) if s in chosen
                             else tuple(b - a for a, b in zip(c, best)))
            known = self.choices[key] = ([found.index(s) for s in chosen], saved, none, best)
            if len(self.choices) > self.max_plans:
                self.choices.pop(next(iter(self.choices)))
        picked, saved, _, _ = known
        for s, v in zip(found, saved):
            s.saved = v
        subs = [found[i] for i in picked]
        self.unsubstituted = known[2]
        return subs, [s for s in found if s not in subs]

    def _cost(self, nodes, handles, strategy) -> tuple:
        """(launches, device us, HBM bytes) of `nodes` as one flush, planned but not built."""
        groups, _ = partition(nodes, dependency_graph(nodes), strategy)
        spec, us, hbm = self.device.spec, 0.0, 0
        for gi, members, keep, nbytes, low, cost, dropped in _groups(nodes, groups, handles):
            us += spec.launch_us(nbytes, sum(n.flops for n in members), low) + (
                cost.overhead_us if cost else 0.0)
            hbm += nbytes
        return len(groups), us, hbm

    def _executable(self, program: Program, members=None) -> tuple[Executable, str]:
        reason = self.cache.bad.get(program.key)
        if reason is not None:
            return OneByOne(program, reason), "bad"
        try:
            return self.cache.get(program, functools.partial(self.compile, nodes=members))
        except CompileError as e:  # a fused compile failed: its ops run one by one (reference)
            if len(program.instrs) == 1:
                raise
            reason = f"{type(e).__name__}: {e}"
            self.cache.bad[program.key] = reason
            COUNTERS.bad_executables[reason[:120]] += 1
            warnings.warn(f"Fused executable '{program.name[:80]}' failed to compile ({e}); "
                          f"its ops run one by one for the rest of this process.", stacklevel=2)
            return OneByOne(program, reason), "bad"

    def _execute(self, nodes, plan: Plan, handles) -> list[bool] | None:
        env: dict[int, torch.UntypedStorage] = {}
        bad: dict[int, Launch] = {}  # segment buffer -> the failed launch that poisoned it
        dev = self.device
        compiled = [] if self.executor is not None else None
        for gp in plan.groups:
            exe = gp.exe
            views = None
            st = [None] * exe.program.n_slots
            poisoned, origin = set(), None
            causes = {}  # slot -> the failed launch, or (instr, LaunchError), poisoning it
            for s in range(exe.program.n_inputs):
                c = gp.slots[s]
                st[s] = env[c] if c in env else handles[c].buffer.storage
                why = bad.get(c) or (handles[c].poison if handles[c] is not None else None)
                if why is not None:  # Note [Poison]
                    poisoned.add(s)
                    causes[s] = why
                    origin = origin or why
            if dev._pending:  # Note [Collective stream] in device/core.py
                dev.join_buffers([handles[gp.slots[s]].buffer for s in range(exe.program.n_inputs)
                                  if gp.slots[s] not in env and handles[gp.slots[s]] is not None])
            members = nodes[gp.start:gp.end]
            inputs = [n.inputs for n in members]
            if isinstance(exe, OneByOne):
                if compiled is not None:
                    compiled.append(False)
                for k, n in enumerate(members):
                    launch = dev.submit(Launch(n.name, exe.runner(k, st, inputs, dev.rng,
                                                                  poisoned, causes),
                                               n.in_bytes + n.out_bytes, n.flops, context=[n],
                                               nodes=((n.source,), gp.op_costs[k:k + 1])))
                    if launch.error is not None:
                        origin = origin or launch
                        for s in exe.instrs[k].out_slots:
                            causes[s] = launch
            else:
                run = views = None
                # Note [Executors] in fusion/executors/tiered.py: fused groups only (single
                # ops stay as eager), and only with valid inputs (poison is the interpreter's).
                # A compiled run reads no host views (Note [Host views]): none are made for it
                if compiled is not None and len(exe.instrs) > 1 and not poisoned:
                    run = self.executor.launcher(exe, st, inputs, poisoned)
                if compiled is not None:
                    compiled.append(run is not None)
                if run is None:
                    views = None if poisoned else _host_views(exe, gp.slots, handles, env)
                    run = functools.partial(exe.run, st, inputs, dev.rng, poisoned, causes,
                                            views)
                launch = dev.submit(Launch(exe.name, run, gp.nbytes, gp.flops,
                                           gp.low_precision, context=members,
                                           kind="kernel" if gp.kernel else "launch",
                                           overhead_us=gp.overhead_us,
                                           nodes=((members[0].source,) if len(members) == 1
                                                  else tuple([n.source for n in members]),
                                                  gp.op_costs)))
                if launch.error is not None:
                    origin = launch
            self._written(gp, exe, st, poisoned, causes, origin, members, env, bad, handles,
                          views)
        return compiled

    def _written(self, gp, exe, st, poisoned, causes, origin, members, env, bad, handles,
                 views) -> None:
        """After group `gp`'s launch: its outputs' storages (in `env`, for later groups),
        what its failures poisoned (in `bad`, and on the buffers), its new buffers."""
        dev = self.device
        for s in gp.outputs:  # (only these leave the group: later groups read them)
            c = gp.slots[s]
            if st[s] is None:  # never written (its op failed or was skipped): poisoned
                st[s] = torch.UntypedStorage(handles[c].nbytes if handles[c] else 0)
            env[c] = st[s]
        own = {}  # a later failed op of the group: a launch record of its own
        for s in poisoned:
            c = gp.slots[s]
            why = causes.get(s) or origin
            if type(why) is tuple:
                k, err = why
                why = own.get(k)
                if why is None:
                    why = own[k] = Launch(members[k].name, None, 0, 0.0,
                                          context=[members[k]])
                    why.error, why.internal = err.cause, err.internal
            bad[c] = why
            if handles[c] is not None and not handles[c].pending:
                handles[c].poison = why  # an existing buffer updated in place
        for s in gp.outputs:
            h = handles[gp.slots[s]]
            if h is not None and h.pending:
                h.buffer = dev.alloc(h.nbytes, st[s])
                h.pending = False
                h.poison = bad.get(gp.slots[s])
                if views is not None and h.poison is None:  # Note [Host views]
                    r = views[exe.n_views + s]
                    if r is not None:
                        h.buffer.host = (exe.out_keys[s], r)
        self.done = gp.end if self.origin is None else self.origin[gp.end]


def _host_views(exe, slots, handles, env) -> list:
    """The `views` of a launch of `exe` (Note [Host views] in codegen.py): the CPU tensors
    over its input buffers that earlier launches made, or made now and kept."""
    views = [None] * (exe.n_views + exe.program.n_slots)
    for vid, s, key in exe.host_views:
        c = slots[s]
        if c in env:
            continue
        buf = handles[c].buffer
        hv = buf.host
        if hv is not None and (hv[0] is key or hv[0] == key):
            views[vid] = hv[1]
        else:
            v = views[vid] = torch.empty(0, dtype=key[3], device=_CPU).set_(
                buf.storage, key[2], key[0], key[1])
            buf.host = (key, v)
    return views


def _groups(nodes, groups, handles):
    """Per group: (index, members, the values it keeps, its HBM bytes, low precision?, its
    custom kernel's cost or None, bytes of values it makes and drops)."""
    last_read = {}
    for gi, g in enumerate(groups):
        for i in g:
            n = nodes[i]
            for li in n.reads:
                last_read[n.uids[li]] = gi
    for gi, g in enumerate(groups):
        members = [nodes[i] for i in g]
        created = {n.uids[li] for n in members for li in n.writes if n.is_new(li)}
        keep = {u for u in created
                if handles[u] is not None or last_read.get(u, -1) > gi}
        dropped = sum(n.vbytes[li] for n in members for li in n.writes
                      if n.uids[li] in created and n.uids[li] not in keep)
        ext_bytes = {}
        for n in members:
            for li in n.reads:
                u = n.uids[li]
                if u not in created:
                    ext_bytes[u] = max(ext_bytes.get(u, 0), n.vbytes[li])
        out_bytes = sum(n.vbytes[li] for n in members for li in n.writes
                        if n.uids[li] in keep or n.uids[li] not in created)
        low = any(o is not None and o[4] in _LOW_PRECISION for n in members for o in n.outs)
        cost = members[0].op.cost  # a custom kernel, alone in its group: its own cost
        nbytes = sum(ext_bytes.values()) + out_bytes if cost is None else cost.hbm_bytes
        yield gi, members, keep, nbytes, low, cost, dropped


class OneByOne(Executable):
    """A bad fused executable's stand-in: each op is launched on its own, results unchanged."""

    def __init__(self, program: Program, reason: str):
        super().__init__(program)
        self.reason = reason  # why its compile failed (explain() shows it)

    def runner(self, k, st, inputs, rng, poisoned, causes=None):
        def run():
            ins = self.instrs[k]
            if poisoned and not poisoned.isdisjoint(ins.in_slots):
                skip(ins, poisoned, causes)  # Note [Poison] in fusion/program.py
                return
            try:
                run_instr(ins, st, inputs[k], rng, [None] * self.n_views)
            except Exception as e:
                poisoned.update(ins.out_slots)
                if not isinstance(e, LaunchError):
                    e = LaunchError(e, internal=True)
                e.cause.instr_index = 0
                raise e
        return run
