"""The lazy queue: a core's `Segment` (what is queued since its last flush) and `record`, the
slow path that queues one op. The replay path (replay.follow) queues through the same Segment
methods, in the same order, with the trace's answers.

Note [Segments]: a segment holds the queued nodes, their buffers by index (Node.uids: a
handle, or a weakref to a pending one), the bytes of the values they will make, the online
group (where a fused group would end, for the adaptive policy) and the flush-to-zero mode of
its ops (Note [CPU settings]). A flush takes the nodes and buffers whole (`take`) and the
segment starts again under a new token: a Handle's `seg` is the token of the segment that
numbered it, so a handle is numbered once per segment. The queue is flushed (with the
reason, as an argument) when the device runs idle at a cut, the buffer is full, pending
memory is too large, or, in eager mode, at once.
"""
from __future__ import annotations

import weakref

from device import HOST_CHECK_BYTES
from fusion.ir import Handle, Node
from fusion import substitute
from fusion.partition import OnlineGroup

from .. import config as _config, errors
from . import cpu_settings
from .source import _source


class Segment:
    """What one core has queued since its last flush (Note [Segments])."""

    __slots__ = ("nodes", "refs", "token", "pending_bytes", "online", "ftz", "threads")

    def __init__(self):
        self.nodes: list[Node] = []
        self.refs: list = []
        self.token = object()
        self.pending_bytes = 0
        self.online = OnlineGroup()
        self.ftz = False
        self.threads = 0  # the intra-op thread count of its ops (0: not recorded)

    def take(self) -> tuple[list, list]:
        """The queued nodes and their buffers, for a flush; the segment starts again, empty."""
        nodes, refs = self.nodes, self.refs
        self.nodes, self.refs, self.token = [], [], object()
        self.pending_bytes = 0
        self.online.reset()
        return nodes, refs

    def ftz_differs(self) -> bool:
        """Does this thread's flush-to-zero differ from the queued ops' (Note [CPU settings])?"""
        return cpu_settings.FTZ_USED[0] and cpu_settings.thread_ftz() != self.ftz

    def threads_differ(self) -> bool:
        """Does this thread's intra-op thread count differ from the queued ops' (Note [CPU
        settings])?"""
        return cpu_settings.THREADS_SET[0] and cpu_settings.thread_count() != self.threads

    def admit(self, eng, nbytes: int) -> bool:
        """Memory admission of an op making `nbytes` of new values: room is made (a flush,
        or the out-of-memory error) when HBM would not hold them, and a large value is
        checked against the host. True if that flushed."""
        hbm = eng.device.hbm
        if nbytes >= HOST_CHECK_BYTES or hbm.used + self.pending_bytes + nbytes > hbm.capacity:
            queued = len(self.nodes)
            eng.make_room(nbytes)
            return len(self.nodes) != queued
        return False

    def idle_at(self, device, cut) -> bool:
        """Should what is queued be launched before an op that opens a new fused group
        (`cut`), because the device has run idle (at most queue_low_threshold launches in
        flight; 0: never)?"""
        low = _config.config.queue_low_threshold
        return cut is not None and low > 0 and bool(self.nodes) and device.in_flight() <= low

    def enqueue(self, node: Node, handles, new, nbytes: int, lazy: bool) -> str | None:
        """Queue `node`, an op making `nbytes` of new values. Its buffers are numbered in this
        segment (its Node.uids): its arguments' buffers first met here take the next indices
        (held weakly while pending, their values being queued), then its new buffers (weakly
        if freed intermediates are skipped, else held until the flush: every value is
        written back). A node of the slow path gets its uids here; a replayed node has the
        trace's, which the replay checked are these. Returns the flush the queue then calls
        for: every op in eager mode, a full buffer, too many pending bytes; or None."""
        token, refs = self.token, self.refs
        uids = [] if node.uids is None else None
        for h in handles:
            if h.seg is not token:
                h.seg, h.ci = token, len(refs)
                refs.append(weakref.ref(h) if h.pending else h)
            if uids is not None:
                uids.append(h.ci)
        cfg = _config.config
        weak = cfg.skip_intermediate
        for h in new:
            h.seg, h.ci = token, len(refs)
            refs.append(weakref.ref(h) if weak else h)
            if uids is not None:
                uids.append(h.ci)
        if uids is not None:
            node.uids = tuple(uids)
        self.nodes.append(node)
        self.pending_bytes += nbytes
        if not lazy:
            return "eager"
        if len(self.nodes) >= cfg.buffer_size_limit:
            return "buffer full"
        if self.pending_bytes > cfg.max_pending_mb * 2**20:
            return "pending memory"
        return None


def record(eng, meta, handles, inputs, vbytes):
    """Queue one op (its cached signature `meta.op`, this call's buffers and runtime inputs)
    as a Node, and flush as the policy says. Returns the handles of its new buffers."""
    seg, traces = eng.seg, eng.traces
    op = meta.op
    if op.arg_writes and errors.COPIED[0]:  # Note [Copied views] in errors.py
        errors.refuse_copied_view([handles[li] for li in op.arg_writes])
    if cpu_settings.FTZ_USED[0] and seg.ftz_differs():  # Note [CPU settings]: one
        # flush-to-zero per segment (FTZ_USED first: the call is skipped in most programs)
        eng.flush("settings")
        seg.ftz = cpu_settings.thread_ftz()
    if cpu_settings.THREADS_SET[0] and seg.threads_differ():  # one thread count per segment
        eng.flush("settings")
        seg.threads = cpu_settings.thread_count()
    seg.admit(eng, op.new_total)
    new = [Handle(b, None, True) for b in op.new_bytes]
    if meta.f64:
        eng.check_dtype_f64()
    before = traces.slow_path(seg)  # Note [Replay]: the trace's answers stop here
    # Frames known to be ours: this, Engine.dispatch_plain (our code's only entry here), its
    # caller (Engine.dispatch or one of the engine's op handlers) and that one's caller (a
    # __torch_dispatch__, Engine.dispatch, or a kernel of ours that copies).
    node = Node(op, None, inputs, tuple(vbytes) + op.new_bytes, _source(4))
    lazy = eng.is_lazy()
    cut = None
    if lazy:  # eager flushes every op: no open group to track
        ids = [h.uid for h in handles] + [h.uid for h in new]
        cut = seg.online.cut(eng.strategy, node, ids) if seg.nodes else "start"
        if seg.idle_at(eng.device, cut) and not (  # Note [Substitution]
                _config.config.substitute and substitute.holds(seg.nodes, node)):
            eng.flush("device idle")
        seg.online.add(node, cut, ids)
    # Only now (a flush above may have started a new segment and written pending inputs
    # back): the node is numbered and queued in the segment.
    reason = seg.enqueue(node, handles, new, op.new_total, lazy)
    traces.recorded(seg, node, meta, cut, before)
    if reason is not None:
        eng.flush(reason)
    return new
