"""The lazy queue's policy: each recorded op becomes a Node; in adaptive mode the online
grouper says where a fused group would end, and the queue is flushed (with the reason, passed
as an argument) when the device runs idle at such a cut, the buffer is full, pending memory
is too large, or, in eager mode, at once."""
from __future__ import annotations

import weakref

import torch

from device import HOST_CHECK_BYTES
from fusion.ir import Handle, Node

from .. import config as _config
from . import cpu_settings
from .replay import MAX_TRACE, catch_up, overflow, resumes
from .source import _source


def record(eng, meta, handles, inputs, vbytes):
    """Queue one op (its cached signature `meta.op`, this call's buffers and runtime inputs)
    as a Node, and flush as the policy says. Returns the handles of its new buffers."""
    if cpu_settings.FTZ_USED[0]:  # Note [CPU settings]: one flush-to-zero per queue
        ftz = cpu_settings.thread_ftz()
        if ftz != eng.queue_ftz:
            if eng.queue:
                eng.flush("settings")
            eng.queue_ftz = ftz
    op = meta.op
    new_bytes = op.new_total
    hbm = eng.device.hbm
    if (new_bytes >= HOST_CHECK_BYTES  # a large value is checked against the host too
            or hbm.used + eng.pending_bytes + new_bytes > hbm.capacity):
        eng._make_room(new_bytes)
    new = [Handle(b, pending=True) for b in op.new_bytes]
    if meta.f64:
        eng._check_dtype(torch.float64)
    trace, tfrom, pos = eng.expect, eng.tfrom, len(eng.tnodes)
    if trace is not None or eng.replayed:  # Note [Replay]: the slow path takes over
        catch_up(eng)
    # Frames known to be ours: this, Engine._dispatch (our code's only entry here), its
    # caller (Engine.dispatch or one of the engine's op handlers) and that one's caller (a
    # __torch_dispatch__, Engine.dispatch, or a kernel of ours that copies).
    node = Node(op, None, inputs, tuple(vbytes) + op.new_bytes, _source(4))
    cfg = _config.config
    lazy = eng.is_lazy()
    cut = None
    if lazy:  # eager flushes every op: no open group to track
        ids = [h.uid for h in handles] + [h.uid for h in new]
        cut = eng.online.cut(eng.strategy, node, ids) if eng.queue else "start"
        low = cfg.queue_low_threshold  # 0: purely lazy, never flush for idling
        if cut is not None and eng.queue and low > 0 and eng.device.in_flight() <= low:
            eng.flush("device idle")
        eng.online.add(node, cut, ids)
    # Only now (a flush above may have started a new segment and written pending inputs
    # back): number the buffers in the queued segment, which holds values in HBM strongly,
    # pending ones weakly (Handle's docstring).
    seg, refs, uids = eng.seg, eng.refs, []
    for h in handles:
        if h.seg is not seg:
            h.seg, h.ci = seg, len(refs)
            refs.append(weakref.ref(h) if h.pending else h)
        uids.append(h.ci)
    weak = cfg.skip_intermediate  # else every value is written back: held until the flush
    for h in new:
        h.seg, h.ci = seg, len(refs)
        refs.append(weakref.ref(h) if weak else h)
        uids.append(h.ci)
    node.uids = tuple(uids)
    eng.queue.append(node)
    eng.tnodes.append(node)  # Note [Replay]: the trace being recorded
    eng.tsteps.append((meta, cut))
    if trace is not None and resumes(trace, pos, node, cut):
        eng.expect, eng.tfrom = trace, tfrom
    elif pos == 0:  # a trace may begin with this node (replay.step picks the others')
        for t in eng.traces.get(op.func._op, ()):
            if resumes(t, 0, node, cut):
                eng.expect = eng.tfrom = t
                break
    elif len(eng.tnodes) >= MAX_TRACE:
        overflow(eng)
    eng.pending_bytes += new_bytes
    if not lazy:
        eng.flush("eager")
    elif len(eng.queue) >= cfg.buffer_size_limit:
        eng.flush("buffer full")
    elif eng.pending_bytes > cfg.max_pending_mb * 2**20:
        eng.flush("pending memory")
    return new
