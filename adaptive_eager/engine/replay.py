"""Note [Replay]: a steady-state loop queues the same ops again and again: the same ops on
tensors of the same layouts, their buffers numbered the same way in their segments, cut and
flushed at the same places. The nodes queued between two flushes other than "device idle"
(a step between syncs, or one op in eager mode) are kept as a trace: per node, the op's
cached meta result and its online-grouping cut. A trace is filed under the plan flushed
just before it; after such a flush, the trace filed under that flush's plan is expected
next. While every op matches the expected one at its position, the engine skips the work
whose answer the trace already holds:

- the argument templates and the meta-cache lookup: an op matches when it is the same op
  overload with the same arguments as the template sees them (each neuron tensor's layout,
  buffers distinct; each runtime scalar's type; each static argument's type and value)
  under the same global state: exactly what makes the slow path find the same cache key,
  checked without building it; and each buffer has the trace's index in its segment;
- online grouping: with every node since the trace began equal (op, buffer numbering,
  bytes, segment boundaries), the open group is the trace's, and so is the cut.

Everything that depends on this call is done through the Segment's own methods
(queue.py), in `queue.record`'s order: runtime scalars and their conversion checks, memory
admission, the flush policy (a flush on the way checks the op again, against the new
segment), new buffers and their numbering, the source line, results. A 0-d host tensor
argument is a runtime value (copied at the call, as the template copies it). An op that
does not match, or takes another path (other host tensors, a tensor list holding a buffer
twice, the engine's own handlers), goes the slow way: first the online group is rebuilt from the
queued nodes (`catch_up`); then, if the node it queued is the trace's at that position
(same op signature, buffers, bytes and cut), the replay goes on (`resumes`), else it ends
for the rest of the trace. Ops that queue nothing (views) leave it on.

Note [Eager launches]: in eager mode every op is flushed alone, so its trace is one node,
and the flush that ends it runs a plan keyed by that node and its buffers, all live (Note
[Plan cache] in fusion/flush.py); the engine keeps that key on the trace (`Trace.sig`). An
op that the replay matches against such a trace, with nothing queued, is not queued: it is
run at once (`Engine.launch`) as `flush("eager")` would run the segment holding it alone,
with the same plan key, buffers and contexts, the same launch, metrics, report and timeline
entry, and under launch blocking the same wait (its errors raise at the call). The trace is
then filed as `remember` files a trace replayed to its end. Everything before (counting,
checks, admission, the source line, new buffers) and after (results) is the replay's.
Engine.dispatch tries the traces beginning with an op (`step`) before its handlers (views
aside: Note [Replayed views] in handlers.py), so a replayed eager op never enters
Engine.dispatch_plain; it is counted once it matches (`follow`),
before anything reads the clock, as the slow path counts it first.
A one-op launch that is not a custom kernel's goes through `Device.submit_plain`: its
modeled cost is computed once per plan and device spec (`GroupPlan.cost`) and no Launch
record is made unless it fails (the same clock, counters and timeline entry as `submit`).
Its plan knows it is one op launched alone (`Plan.one`, with the segment indices of its
inputs), so `Runner.run_sig` launches it without `_execute`'s general steps, and `step`
tells `follow` that its own frames and its caller's are ours (the source walk looks at the
user's frame only).
No FlushReport is made either: the engine keeps its fields, and `Engine.last_report` makes it
when read (`ae.explain`), as for every flush.
"""
from __future__ import annotations

import weakref

import torch

from fusion.ir import Handle, encode_static

from .. import config as _config, errors
from . import cpu_settings
from .tensor import NeuronTensor, fresh
from .meta import _global_state, check_conversions, give_warnings
from .results import results
from .source import _source

MISS = object()  # the op does not match the trace: take the slow path
MISSED = object()  # it stopped matching once counted: the slow path, which must not count it
_SCALARS = {"int": int, "float": float, "bool": bool, "complex": complex}
_TENSOR, _SCALAR, _STATIC, _INTS, _ENUM, _AGAIN, _HOST, _TENSORS, _LISTED, _SCALARS_ = range(10)
_ENUM_TAGS = ("dt", "dev", "lay", "mf")  # fusion.ir.encode_static's
_ENUM_TYPES = (torch.dtype, torch.device, torch.layout, torch.memory_format)
_MAX_TRACES = 1024  # first ops (with their first argument's layout: `first_key`) with traces
MAX_TRACE = 1 << 13  # nodes: a longer run with no sync (no flush but device-idle ones) is
# not recorded, so a loop that never syncs keeps flat host memory
_PER_OP = 4  # traces kept per first op and layout
# Note [Guarded replay]: an op the engine's own handler takes (`HANDLERS` in handlers.py) is
# never replayed (Engine.dispatch tries the trace before the handler), except those with a
# guard here, by `func._op`: `guard(eng, args, kwargs)`, asked once when the op matches the
# trace, before anything is counted or flushed, says whether the handler, called now, would queue
# the op through Engine.dispatch_plain with these arguments (else: MISS, and the handler
# decides). The replay then does what that path does. `copy_` between two tensors of one
# core is queued unless it is copied at the call (transfer.queues_copy, Note [Direct
# copies]); its signature is in the trace, so it is not new (no first-sight flush). A copy
# that stops matching after the guard (a flush on the way) takes dispatch_plain, as the
# handler would have. So `buf.copy_(y)` and `a[i] = y` loops on queued values are replayed.
# The `*_like` and `new_*` factories are queued unless their result is on another device
# (transfer.queues_like): so is a backward's grad seed (`ones_like` of the loss).
GUARDS: dict = {}
# Note [Handled replay]: an op the engine's own handler takes and no guard lets through
# (Note [Guarded replay]) is never replayed by Engine.dispatch (its meta's `replay` is
# False). A handler that does its own work around an op queued unchanged (in-place foreach
# ops and fused optimizer steps: `_bumps_versions` and `_bumps_fused_versions` refuse
# inference tensors, then bump autograd versions) may replay the op itself: `handled_step`,
# called where it would call Engine.dispatch_plain, counts the op and follows the expected
# trace (or begins one, as dispatch_plain does: `step`) with the spec the replay would use
# were there no handler (`meta.handled`), else takes dispatch_plain. So the handler's
# checks and version bumps happen on every call, before and after the op, as on the slow
# path.


def spec(meta):
    """How an op's arguments must look to find `meta` again (per argument: a tensor's
    layout and local buffer index, a runtime scalar's type (a Scalar[]'s: each element's),
    a static value, an earlier tensor or tensor list again), from the templates of its
    signature, with the number of positional arguments and the keyword names, in order;
    False where replay does not apply (host tensors but 0-d ones, a tensor list holding a
    buffer twice or partly an earlier one's...). Cached on the meta result."""
    if meta.replay is not None:
        return meta.replay
    out, at = [], []  # at: the argument position of each local buffer index
    args_t, kwargs_t = meta.op.sig[2], meta.op.sig[3]
    for t in args_t + tuple(v for _, v in kwargs_t):  # kwargs after args, as templates go
        if type(t) is tuple and t and type(t[0]) is str:
            tag = t[0]
            if tag == "T" and len(t) == 6 and t[1] == len(at):
                out.append((_TENSOR, t[2:6], len(at)))
                at.append(len(out) - 1)
            elif tag == "T" and len(t) == 6:  # the same tensor again (`addcmul_(g, g)`)
                out.append((_AGAIN, at[t[1]], t[2:6]))
            elif tag == "S" and type(t[2]) is str:
                out.append((_SCALAR, _SCALARS[t[2]]))
            elif tag == "S" and all(n in _SCALARS for n in t[2]):  # a Scalar[] (AdamW's bias
                out.append((_SCALARS_, tuple(_SCALARS[n] for n in t[2])))  # corrections)
            elif tag == "F":
                out.append((_STATIC, float, t))
            elif tag == "L" and all(type(x) in (int, bool) for x in t[1:]):
                out.append((_INTS, t[1:]))  # (dims, sizes, output masks)
            elif tag == "L" and t[1:] and all(
                    type(x) is tuple and len(x) == 6 and x[0] == "T" and x[1] == len(at) + i
                    for i, x in enumerate(t[1:])):  # a list of tensors, buffers distinct
                out.append((_TENSORS, tuple((x[2:6], x[1]) for x in t[1:])))
                at += [len(out) - 1] * (len(t) - 1)
            elif tag == "L" and t[1:] and all(type(x) is tuple and len(x) == 6 and x[0] == "T"
                                              and x[1] < len(at) for x in t[1:]) \
                    and out[at[t[1][1]]][0] == _TENSORS \
                    and out[at[t[1][1]]][1] == tuple((x[2:6], x[1]) for x in t[1:]):
                out.append((_LISTED, at[t[1][1]]))  # an earlier list again (`addcmul_(g, g)`)
            elif tag in _ENUM_TAGS:
                out.append((_ENUM, t))
            elif tag == "H" and t[3] == () and hasattr(torch, t[2]):  # a 0-d host tensor: a value
                out.append((_HOST, getattr(torch, t[2])))
            else:
                break
        elif t is None or type(t) in (int, float, bool, str):
            out.append((_STATIC, type(t), t))
        else:
            break
    else:
        meta.replay = (tuple(out), len(args_t), tuple(k for k, _ in kwargs_t),
                       GUARDS.get(meta.op.func._op))
        return meta.replay
    meta.replay = False
    return False


class Trace:
    """The nodes queued between two flushes other than "device idle", and per node its
    (meta result, cut); the policy the cuts were made under (lazy or not, the strategy)."""

    __slots__ = ("nodes", "steps", "lazy", "key", "n", "sig", "first")

    def __init__(self, nodes, steps, lazy, key):
        self.nodes, self.steps, self.lazy, self.key = nodes, steps, lazy, key
        self.n = len(nodes)
        self.sig = None  # Note [Eager launches]: an eager op's plan key, its buffers all live
        self.first = first_key(nodes[0].op)  # what it is filed under (`Traces.by_op`)


def first_key(op) -> object:
    """What a trace beginning with op signature `op` is filed under: the op, and its first
    argument's layout when that is a tensor, as `step` finds it from a call's arguments
    (Note [Replay]: one signature per layout of a model's matmuls, say, would otherwise
    share the few places an op has and push each other out, every step)."""
    t = op.sig[2][0] if op.sig[2] else None
    if type(t) is tuple and len(t) == 6 and t[0] == "T":
        return (op.func._op, t[2:6])
    return op.func._op


class Traces:
    """One core's replay state (Note [Replay]): the trace being recorded (`nodes`; per node,
    `steps`: its meta result and cut), the one expected next, the one this recording has
    followed so far, whether a node of the queued segment was replayed (its online group is
    behind), and recent traces by their first op and its first argument's layout
    (`first_key`)."""

    __slots__ = ("nodes", "steps", "expect", "followed", "replayed", "by_op")

    def __init__(self):
        self.nodes: list = []
        self.steps: list = []
        self.expect = self.followed = None
        self.replayed = False
        self.by_op: dict = {}

    def slow_path(self, seg) -> tuple:
        """The slow path is about to queue a node: the replay stops (`catch_up`). Returns
        what `recorded` needs to tell whether it may go on after the node."""
        before = (self.expect, self.followed, len(self.nodes))
        if self.expect is not None or self.replayed:
            self.catch_up(seg)
        return before

    def recorded(self, seg, node, meta, cut, before) -> None:
        """The slow path queued `node`: it joins the trace being recorded, and the replay
        goes on when the node is the expected trace's (`resumes`), or a trace beginning
        with it is picked."""
        trace, followed, pos = before
        self.nodes.append(node)
        self.steps.append((meta, cut))
        if trace is not None and resumes(trace, pos, node, cut):
            self.expect, self.followed = trace, followed
        elif pos == 0:  # a trace may begin with this node (`step` picks the others')
            for t in self.by_op.get(first_key(node.op), ()):
                if resumes(t, 0, node, cut):
                    self.expect = self.followed = t
                    break
        elif len(self.nodes) >= MAX_TRACE:
            self.overflow(seg)

    def replayed_node(self, seg, node, tstep, pos: int, ids) -> None:
        """The replay queued `node` (the trace's `tstep` at `pos`); with `ids` (check_replay),
        the online group is kept as the slow path keeps it, else it falls behind."""
        self.nodes.append(node)
        self.steps.append(tstep)
        if pos + 1 >= MAX_TRACE:  # (len(self.nodes))
            self.overflow(seg)
        if ids is not None:
            seg.online.add(node, tstep[1], ids)
        else:
            self.replayed = True

    def overflow(self, seg) -> None:
        """The trace being recorded reached MAX_TRACE nodes: the online group is brought up
        to date (from the steps about to go) and recording stops until the next trace."""
        self.catch_up(seg)
        self.nodes = self.steps = NOT_RECORDING

    def catch_up(self, seg) -> None:
        """The replay ends for the rest of the trace, and if nodes were replayed into the
        segment, its online group becomes what it would be had every queued node been added
        to it (the nodes since the last cut, with their buffers' identities)."""
        self.expect = self.followed = None
        if not self.replayed:
            return
        self.replayed = False
        queue, online, refs = seg.nodes, seg.online, seg.refs
        steps = self.steps[len(self.steps) - len(queue):]  # the segment's (a trace's tail)
        start = len(queue) - 1
        while start > 0 and steps[start][1] is None:
            start -= 1
        online.reset()
        for n, (_, cut) in zip(queue[start:], steps[start:]):
            ids = []
            for ci in n.uids:
                r = refs[ci]
                h = r() if type(r) is weakref.ref else r
                ids.append(h.uid if h is not None else -1 - ci)  # a freed buffer: a unique id
            online.add(n, cut, ids)

    def remember(self, reason: str, lazy: bool, key) -> Trace | None:
        """After a flush: unless it was a device-idle flush (the trace goes on across
        those), the trace ends and is filed under its first op (`first_key`), newest first; none is
        expected until the next op picks one (`step`). A trace replayed start to end is the
        one it followed: that one moves to the front instead. The flush took the segment's
        online group with it (`replayed` is cleared). Returns the trace filed, if any."""
        self.replayed = False
        if reason == "device idle":
            return None
        nodes, self.nodes = self.nodes, []
        steps, self.steps = self.steps, []
        done, self.followed, self.expect = self.followed, None, None
        if not nodes or nodes is NOT_RECORDING or not _config.config.replay:
            return None
        if done is not None and done.n == len(nodes) and done.lazy == lazy:
            trace = done
        else:
            trace = Trace(nodes, steps, lazy, key)
        by_op = self.by_op
        if len(by_op) >= _MAX_TRACES:
            by_op.clear()
        k = trace.first
        by_op[k] = [trace] + [t for t in by_op.get(k, ()) if t is not trace][:_PER_OP - 1]
        return trace

    def again(self, trace) -> None:
        """Note [Eager launches]: one-op `trace` was replayed and run without queuing its
        node: filed as `remember` files a trace replayed start to end (it moves to the
        front), with nothing recorded since."""
        self.expect = self.followed = None
        by_op = self.by_op
        k = trace.first
        found = by_op.get(k)
        if found is None or found[0] is not trace:
            if found is None and len(by_op) >= _MAX_TRACES:
                by_op.clear()
            by_op[k] = [trace] + [t for t in found or () if t is not trace][:_PER_OP - 1]

    def forget(self) -> None:
        """Settings changed, or a flush failed: no trace is expected or kept, and the one
        being recorded is dropped."""
        self.expect = self.followed = None
        self.replayed = False
        self.by_op.clear()
        self.nodes, self.steps = [], []


def handled_step(eng, func, args, kwargs):
    """Note [Handled replay]: what Engine.dispatch_plain does with an op a handler queues
    unchanged, from the trace where it matches."""
    eng.count_op()
    tr = eng.traces
    out = MISS
    if tr.expect is not None:
        out = follow(eng, func, args, kwargs, True, True)
    elif not tr.nodes:
        out = step(eng, func, args, kwargs, True)
    if out is MISS:
        return eng.dispatch_plain(func, args, kwargs, counted=True)
    return out


def _handled_spec(meta):
    """Note [Handled replay]: `spec` of a meta result whose `replay` its handler made False."""
    if meta.handled is None:
        meta.replay, was = None, meta.replay
        meta.handled = spec(meta)
        meta.replay = was
    return meta.handled


def step(eng, func, args, kwargs, handled=False):
    """Note [Replay]: the first op of a trace picks the trace: the recent traces that began
    with this op, its first argument laid out so, are tried, newest first (`follow`: MISS,
    nothing counted, if none matches; MISSED if one stopped matching once counted).
    Engine.dispatch calls it before counting the op; `handled_step` (`handled`), after."""
    tr = eng.traces
    # `first_key` of the signature this call would have (here: a frame less per eager op)
    key = (func._op, args[0]._info[0]) if args and type(args[0]) is NeuronTensor else func._op
    for trace in tr.by_op.get(key, ()):
        tr.expect = tr.followed = trace
        out = follow(eng, func, args, kwargs, handled, handled, 4)  # (handled_step counted it)
        if out is not MISS:
            return out
        if tr.nodes:  # (a flush on the way cannot queue a node: never taken)
            break
    tr.expect = tr.followed = None
    return MISS


def follow(eng, func, args, kwargs, counted=False, handled=False, frames=3):
    """Note [Replay]: queue op `func(*args, **kwargs)` from the expected trace at its
    position and return its result. MISS if it does not match (nothing is changed, but a
    flush on the way may have happened, as the slow path would have done it); MISSED if it
    stopped matching after this call counted the op (as Engine.dispatch_plain counts every
    op, once: `counted` says it already did). `handled`: Note [Handled replay]. `frames`:
    how many frames from this one up are known to be ours (`_source`'s `ours`)."""
    ok = ours = guarded = False  # ours: this call counted the op; guarded: its guard held
    seg, tr = eng.seg, eng.traces
    for _ in range(3):  # a flush on the way: the op is checked again, in the new segment
        trace = tr.expect
        if trace is None or cpu_settings.FTZ_USED[0] and seg.ftz_differs() \
                or cpu_settings.THREADS_SET[0] and seg.threads_differ():
            break  # (Note [CPU settings]: the slow path flushes for it)
        lazy = eng.is_lazy()
        key = eng.strategy.key
        if lazy != trace.lazy or trace.key is not key and trace.key != key:  # another policy's
            break
        pos = len(tr.nodes)
        if pos >= trace.n:
            break
        tstep = trace.steps[pos]
        meta, cut = tstep
        op = meta.op
        if func is not op.func:
            break
        sp = meta.replay if meta.replay is not None else spec(meta)
        if sp is False and handled:
            sp = _handled_spec(meta)
        if sp is False or len(args) != sp[1] or (tuple(kwargs) != sp[2] if kwargs else sp[2]):
            break
        tn = trace.nodes[pos]
        vbytes = tn.vbytes
        handles, inputs = [], []
        listed = False  # a tensor list's buffers were taken: checked distinct at the end
        flat = args + tuple(kwargs.values()) if kwargs else args
        for a, s in zip(flat, sp[0]):
            kind = s[0]
            if kind == _TENSOR:
                if type(a) is not NeuronTensor or a._engine is not eng:
                    break
                lay, nbytes, extent = a._info
                h = a._handle
                if lay is not s[1] and lay != s[1] or h in handles or extent > h.nbytes \
                        or min(h.nbytes, nbytes) != vbytes[s[2]]:
                    break
                handles.append(h)
            elif kind == _SCALAR:
                if type(a) is not s[1]:
                    break
                inputs.append(a)
            elif kind == _AGAIN:  # the very tensor object of an earlier argument, as laid out
                if a is not flat[s[1]] or a._info[0] != s[2]:  # then (another layout: another
                    break  # key)
            elif kind == _STATIC:
                if type(a) is not s[1] or (encode_static(a) if s[1] is float else a) != s[2]:
                    break
            elif kind == _ENUM:
                if type(a) not in _ENUM_TYPES or encode_static(a) != s[1]:
                    break
            elif kind == _TENSORS:  # each as a _TENSOR argument (buffers distinct: checked
                if type(a) not in (list, tuple) or len(a) != len(s[1]):  # once, at the end,
                    break  # not per element: an optimizer's lists hold hundreds)
                for x, (layout, li) in zip(a, s[1]):
                    if type(x) is not NeuronTensor or x._engine is not eng:
                        break
                    lay, nbytes, extent = x._info
                    h = x._handle
                    if lay is not layout and lay != layout \
                            or extent > h.nbytes or min(h.nbytes, nbytes) != vbytes[li]:
                        break
                    handles.append(h)
                else:
                    listed = True
                    continue
                break
            elif kind == _SCALARS_:  # runtime values of these types, as templates take them
                if type(a) not in (list, tuple) or len(a) != len(s[1]) or any(
                        type(x) is not y for x, y in zip(a, s[1])):
                    break
                inputs.append(list(a))
            elif kind == _LISTED:  # the very tensors of an earlier list, in order
                b = flat[s[1]]
                if type(a) not in (list, tuple) or len(a) != len(b) or any(
                        x is not y for x, y in zip(a, b)):
                    break
            elif kind == _HOST:  # as templates.py takes it (a copy of its value, now)
                if type(a) is not torch.Tensor or a.dtype is not s[1] or a.dim() \
                        or a.device.type != "cpu" or a.layout is not torch.strided:
                    break
                inputs.append(a.detach().clone())
            elif type(a) not in (list, tuple) or len(a) != len(s[1]) or any(
                    type(x) is not type(y) or x != y for x, y in zip(a, s[1])):
                break
        else:  # (a guard is asked once: at the call, where the handler would decide)
            if (not listed or len(set(handles)) == len(handles)) \
                    and not (op.arg_writes and errors.COPIED[0]  # Note [Copied views]
                             and errors.any_copied(handles, op.arg_writes)) \
                    and meta.gstate == _global_state() \
                    and (sp[3] is None or guarded or sp[3](eng, args, kwargs)):
                ok = guarded = True
        if not ok:
            break
        ok = False
        # The op is the trace's: queued as queue.record queues it, through the same steps.
        if not counted:
            counted = ours = True
            eng.count_op()
        if meta.checks:  # Note [Scalar conversion] in meta.py
            check_conversions(meta.checks, inputs)
        if meta.warns:
            give_warnings(meta.warns)
        queued = len(seg.nodes)
        if seg.admit(eng, op.new_total):
            continue  # it flushed
        check = _config.config.check_replay
        if check and lazy:  # the cut the slow path's online group gives
            real = seg.online.cut(eng.strategy, tn, [h.uid for h in handles]) if queued \
                else "start"
        if lazy and cut is not None and queued and seg.idle_at(eng.device, cut):
            eng.flush("device idle")
            continue
        # the buffers' indices in this segment must be the trace's
        uids, token = tn.uids, seg.token
        nxt = len(seg.refs)
        for li, h in enumerate(handles):
            if h.seg is token:
                if h.ci != uids[li]:
                    break
            elif uids[li] == nxt:
                nxt += 1
            else:
                break
        else:  # then the new ones
            n = len(handles)
            ok = len(uids) == n or uids[n] == nxt
        break
    if not ok:
        return MISSED if ours else MISS
    if check:
        _check(eng, func, args, kwargs, meta, handles, inputs)
        assert not lazy or (real is None) == (cut is None), (func, real, cut)
        assert lazy == eng.is_lazy()
    if meta.f64:
        eng.check_dtype_f64()
    # Frames known to be ours: this, its caller (Engine.dispatch, `step` or `handled_step`)
    # and that one's (a __torch_dispatch__, the scope's, _unsafe_view's or results.py's; or
    # Engine.dispatch, or a handler); from `step`, that one's caller too (`frames` 4)
    node = tn.again(inputs, _source(frames))
    new = []
    for b in op.new_bytes:  # (not a comprehension: a frame of its own, and this runs per op)
        new.append(Handle(b, None, True))
    if not lazy and trace.sig is not None and not queued:  # Note [Eager launches]
        eng.metrics.replayed_ops += 1
        eng.launch([node], handles + new, "eager", eng.eager_strategy, trace.sig, False,
                   trace)
    else:
        reason = seg.enqueue(node, handles, new, op.new_total, lazy)
        tr.replayed_node(seg, node, tstep, pos, [h.uid for h in handles] + [h.uid for h in new]
                         if check and lazy else None)
        eng.metrics.replayed_ops += 1
        if reason is not None:
            eng.flush(reason)
    if meta.single:
        leaf = meta.leaves[0]
        if leaf[0] == "new":
            _, k, size, stride, dtype, info = leaf
            return fresh(eng, new[k], size, stride, dtype, info)
    return results(eng, func, args, kwargs, handles, meta, new)


def _check(eng, func, args, kwargs, meta, handles, inputs) -> None:
    """check_replay: the slow path, asked the same question, finds the same answer: the same
    cache key (hence meta result), buffers and runtime values."""
    from .templates import template
    args_t, kwargs_t, hs, ins, _ = template(eng, func, args, kwargs)
    key = (func._op, args_t, kwargs_t, _global_state())
    found = eng.meta_cache.get(key)
    assert (found is None or found is meta) and args_t == meta.op.sig[2] \
        and kwargs_t == meta.op.sig[3] and meta.gstate == key[3], (func, args_t, meta.op.sig)
    assert hs == handles and len(ins) == len(inputs) and all(
        type(a) is type(b) and (a.dtype == b.dtype and (torch.equal(a, b) or bool(a != a)
                                                        and bool(b != b))
                                if type(a) is torch.Tensor else a == b or a != a)
        for a, b in zip(ins, inputs)), (func, hs, handles, ins, inputs)


class _NotRecording(list):
    """Stands for the nodes of a trace grown past MAX_TRACE: records nothing, and is as
    long as that (no trace matches past its end: every op takes the slow path)."""

    def append(self, _):
        pass

    def __len__(self):
        return MAX_TRACE


NOT_RECORDING = _NotRecording()


def resumes(trace, pos: int, node, cut) -> bool:
    """Whether the replay goes on after a node queued the slow way at `pos` (an op with
    kwargs, an in-place foreach op...): when it is the trace's node there, on the same
    buffers with the same bytes and cut, the trace still describes the queue."""
    if pos >= trace.n:
        return False
    tn = trace.nodes[pos]
    return (tn.op is node.op and tn.uids == node.uids and tn.vbytes == node.vbytes
            and (trace.steps[pos][1] is None) == (cut is None))
