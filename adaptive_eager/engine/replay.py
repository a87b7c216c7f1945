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

Everything that depends on this call is done as `queue.record` does it, in its order:
runtime scalars and their conversion checks, memory admission, the flush policy (a flush on
the way checks the op again, against the new segment), new buffers, the source line,
results. An op that does not match, or takes another path (host tensors, tensor lists, the
engine's own handlers), goes the slow way: first the online group is rebuilt from the
queued nodes (`catch_up`); then, if the node it queued is the trace's at that position
(same op signature, buffers, bytes and cut), the replay goes on (`resumes`), else it ends
for the rest of the trace. Ops that queue nothing (views) leave it on.
"""
from __future__ import annotations

import weakref

import torch

from device import HOST_CHECK_BYTES
from fusion.ir import Handle, encode_static

from .. import config as _config
from . import cpu_settings
from .tensor import NeuronTensor, fresh
from .meta import _global_state, check_conversions
from .results import results
from .source import _source

MISS = object()  # the op does not match the trace: take the slow path
MISSED = object()  # it stopped matching once counted: the slow path, which must not count it
_SCALARS = {"int": int, "float": float, "bool": bool, "complex": complex}
_TENSOR, _SCALAR, _STATIC, _INTS, _ENUM, _AGAIN = range(6)
_ENUM_TAGS = ("dt", "dev", "lay", "mf")  # fusion.ir.encode_static's
_ENUM_TYPES = (torch.dtype, torch.device, torch.layout, torch.memory_format)
_MAX_TRACES = 1024  # first ops with traces
MAX_TRACE = 1 << 13  # nodes: a longer run with no sync (no flush but device-idle ones) is
# not recorded, so a loop that never syncs keeps flat host memory
_PER_OP = 4  # traces kept per first op


def spec(meta):
    """How an op's arguments must look to find `meta` again (per argument: a tensor's
    layout and local buffer index, a runtime scalar's type, a static value), from the
    templates of its signature, with the number of positional arguments and the keyword
    names, in order; False where replay does not apply (host tensors, tensor lists, a
    buffer passed twice...). Cached on the meta result."""
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
            elif tag == "F":
                out.append((_STATIC, float, t))
            elif tag == "L" and all(type(x) in (int, bool) for x in t[1:]):
                out.append((_INTS, t[1:]))  # (dims, sizes, output masks)
            elif tag in _ENUM_TAGS:
                out.append((_ENUM, t))
            else:
                break
        elif t is None or type(t) in (int, float, bool, str):
            out.append((_STATIC, type(t), t))
        else:
            break
    else:
        meta.replay = (tuple(out), len(args_t), tuple(k for k, _ in kwargs_t))
        return meta.replay
    meta.replay = False
    return False


class Trace:
    """The nodes queued between two flushes other than "device idle", and per node its
    (meta result, cut); the policy the cuts were made under (lazy or not, the strategy)."""

    __slots__ = ("nodes", "steps", "lazy", "key", "n")

    def __init__(self, nodes, steps, lazy, key):
        self.nodes, self.steps, self.lazy, self.key = nodes, steps, lazy, key
        self.n = len(nodes)


def step(eng, func, args, kwargs):
    """Note [Replay]: the first op of a trace picks the trace: the recent traces that began
    with this op are tried, newest first (`follow`). Engine._dispatch has counted the op."""
    for trace in eng.traces.get(func._op, ()):
        eng.expect = eng.tfrom = trace
        out = follow(eng, func, args, kwargs, True)
        if out is not MISS:
            return out
        if eng.tnodes:  # (a flush on the way cannot queue a node: never taken)
            break
    eng.expect = eng.tfrom = None
    return MISS


def follow(eng, func, args, kwargs, counted=False):
    """Note [Replay]: queue op `func(*args, **kwargs)` from the expected trace `eng.expect`
    at its position and return its result. MISS if it does not match (nothing is changed,
    but a flush on the way may have happened, as the slow path would have done it); MISSED
    if it stopped matching after this call counted the op (as Engine._dispatch counts every
    op, once: `counted` says it already did)."""
    ok = ours = False  # ours: this call counted the op
    for _ in range(3):  # a flush on the way: the op is checked again, in the new segment
        trace = eng.expect
        if trace is None or cpu_settings.FTZ_USED[0] and (
                cpu_settings.thread_ftz() != eng.queue_ftz):
            break  # (Note [CPU settings]: the slow path flushes for it)
        lazy = eng.is_lazy()
        key = eng.strategy.key
        if lazy != trace.lazy or trace.key is not key and trace.key != key:  # another policy's
            break
        pos = len(eng.tnodes)
        if pos >= trace.n:
            break
        tstep = trace.steps[pos]
        meta, cut = tstep
        op = meta.op
        if func is not op.func:
            break
        sp = meta.replay if meta.replay is not None else spec(meta)
        if sp is False or len(args) != sp[1] or (tuple(kwargs) != sp[2] if kwargs else sp[2]):
            break
        tn = trace.nodes[pos]
        vbytes = tn.vbytes
        handles, inputs = [], []
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
            elif type(a) not in (list, tuple) or len(a) != len(s[1]) or any(
                    type(x) is not type(y) or x != y for x, y in zip(a, s[1])):
                break
        else:
            if meta.gstate == _global_state():
                ok = True
        if not ok:
            break
        ok = False
        # The op is the trace's. What follows is Engine._dispatch's and queue.record's, in
        # their order.
        if not counted:
            counted = ours = True
            eng.metrics.ops += 1
            eng.device.advance_host(eng.spec.host_op_overhead_us)
        if meta.checks:  # Note [Scalar conversion] in meta.py
            check_conversions(meta.checks, inputs)
        new_bytes = op.new_total
        hbm = eng.device.hbm
        queued = len(eng.queue)
        if new_bytes >= HOST_CHECK_BYTES or hbm.used + eng.pending_bytes + new_bytes > hbm.capacity:
            eng._make_room(new_bytes)
            if len(eng.queue) != queued:
                continue  # it flushed
        cfg = _config.config
        check = cfg.check_replay
        if check and lazy:  # the cut the slow path's online group gives
            real = eng.online.cut(eng.strategy, tn, [h.uid for h in handles]) if queued \
                else "start"
        if lazy and cut is not None and queued:
            low = cfg.queue_low_threshold
            if low > 0 and eng.device.in_flight() <= low:
                eng.flush("device idle")
                continue
        # the buffers' indices in this segment must be the trace's
        uids, seg = tn.uids, eng.seg
        nxt = base = len(eng.refs)
        for li, h in enumerate(handles):
            if h.seg is seg:
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
    # Queue it (queue.record's work, with the trace's answers)
    if meta.f64:
        eng._check_dtype(torch.float64)
    # Frames known to be ours: this, its caller (Engine.dispatch, or `step`) and that one's
    # (a __torch_dispatch__ or _unsafe_view, or Engine._dispatch)
    node = tn.again(inputs, _source(3))
    refs, ci = eng.refs, base  # (len(refs))
    for h in handles:  # numbered as checked: their indices are the trace node's
        if h.seg is not seg:
            h.seg, h.ci = seg, ci
            ci += 1
            refs.append(weakref.ref(h) if h.pending else h)
    weak = cfg.skip_intermediate
    new = []
    for b in op.new_bytes:  # (not a comprehension: a frame of its own, and this runs per op)
        h = Handle(b, None, True)
        h.seg, h.ci = seg, ci
        ci += 1
        refs.append(weakref.ref(h) if weak else h)
        new.append(h)
    eng.queue.append(node)
    eng.tnodes.append(node)
    eng.tsteps.append(tstep)
    if pos + 1 >= MAX_TRACE:  # (len(eng.tnodes))
        overflow(eng)
    if check and lazy:  # the online group kept as the slow path keeps it
        eng.online.add(node, cut, [h.uid for h in handles] + [h.uid for h in new])
    else:
        eng.replayed = True
    eng.metrics.replayed_ops += 1
    eng.pending_bytes += new_bytes
    if not lazy:
        eng.flush("eager")
    elif queued + 1 >= cfg.buffer_size_limit:  # (len(eng.queue))
        eng.flush("buffer full")
    elif eng.pending_bytes > cfg.max_pending_mb * 2**20:
        eng.flush("pending memory")
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
    assert hs == handles and ins == inputs and [type(v) for v in ins] == \
        [type(v) for v in inputs], (func, hs, handles, ins, inputs)


class _NotRecording(list):
    """Stands for the nodes of a trace grown past MAX_TRACE: records nothing, and is as
    long as that (no trace matches past its end: every op takes the slow path)."""

    def append(self, _):
        pass

    def __len__(self):
        return MAX_TRACE


NOT_RECORDING = _NotRecording()


def overflow(eng) -> None:
    """The trace being recorded reached MAX_TRACE nodes: the online group is brought up to
    date (from the steps about to go) and recording stops until the next trace begins."""
    catch_up(eng)
    eng.tnodes = eng.tsteps = NOT_RECORDING


def catch_up(eng) -> None:
    """The slow path is about to queue a node: the replay ends for the rest of the trace,
    and if nodes were replayed into this segment, the online group becomes what it would be
    had every queued node been added to it (the nodes since the last cut, with their
    buffers' identities)."""
    eng.expect = eng.tfrom = None
    if not eng.replayed:
        return
    eng.replayed = False
    queue, online, refs = eng.queue, eng.online, eng.refs
    steps = eng.tsteps[len(eng.tsteps) - len(queue):]  # the segment's (a trace's tail)
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


def resumes(trace, pos: int, node, cut) -> bool:
    """Whether the replay goes on after a node queued the slow way at `pos` (an op with
    kwargs, an in-place foreach op...): when it is the trace's node there, on the same
    buffers with the same bytes and cut, the trace still describes the queue."""
    if pos >= trace.n:
        return False
    tn = trace.nodes[pos]
    return (tn.op is node.op and tn.uids == node.uids and tn.vbytes == node.vbytes
            and (trace.steps[pos][1] is None) == (cut is None))


def remember(eng, reason: str, lazy: bool) -> None:
    """After a flush: unless it was a device-idle flush (the trace goes on across those),
    the trace ends and is filed under its first op, newest first; none is expected until
    the next op picks one (`step`). A trace replayed start to end is the one it followed:
    that one moves to the front instead."""
    if reason == "device idle":
        return
    nodes, eng.tnodes = eng.tnodes, []
    steps, eng.tsteps = eng.tsteps, []
    done, eng.tfrom, eng.expect = eng.tfrom, None, None
    if not nodes or nodes is NOT_RECORDING or not _config.config.replay:
        return
    if done is not None and done.n == len(nodes) and done.lazy == lazy:
        trace = done
    else:
        trace = Trace(nodes, steps, lazy, eng.strategy.key)
    traces = eng.traces
    if len(traces) >= _MAX_TRACES:
        traces.clear()
    key = nodes[0].op.func._op
    traces[key] = [trace] + [t for t in traces.get(key, ()) if t is not trace][:_PER_OP - 1]


def forget(eng) -> None:
    """Settings changed, or a flush failed: no trace is expected or kept, and the one being
    recorded is dropped."""
    eng.expect = eng.tfrom = None
    eng.traces.clear()
    eng.tnodes, eng.tsteps = [], []
