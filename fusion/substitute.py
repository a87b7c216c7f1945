"""Pattern substitution: hand-written attention and RMSNorm in a flush become one launch of the
kernel library's flash_attention / rms_norm (adaptive mode, `ADAPTIVE_EAGER_SUBSTITUTE=1`).

Note [Substitution]: the queue sits below autograd, so a rewrite here is safe only where no
value of the pattern but its result is needed by anything else. `rewrite` replaces a matched
run of ops by one kernel node only when every intermediate value
  - is made by the pattern's op and read by the pattern's next op alone, in this flush;
  - has no live tensor at the flush (not user-visible, not saved for backward: autograd's
    saved tensors keep theirs alive, so a training step's softmax output is never replaced;
    inference and no_grad are where this applies);
and when nothing between the pattern's first and last op writes a buffer the pattern reads
(the kernel runs at the last op's place). Values: the kernel's, which match the ATen ops
within its documented float32 tolerance (tests/integration/test_substitution.py); only
float32 patterns are matched. Runtime scalars the match depends on (the scale, eps, the
exponent 2) are checked here, every flush (the rewrite runs before the plan cache's lookup,
so a plan never outlives the values it was matched on); the kernel node carries them as
static arguments (its signature, and so the plan's key). Patterns:
  attention  bmm(Q, Kᵀ) [-> mul/div by a scalar] [-> add(mask)] -> _softmax(-1) -> bmm(., V)
             (torch.matmul's ATen form; `q @ k.transpose(-2, -1) * s + mask`, HF's eager
             attention, SDPA's math path)
  rms_norm   pow(X, 2) -> mean(-1, keepdim) -> add(eps) -> rsqrt -> mul(X, .) -> mul(., W)
             (HF's LlamaRMSNorm in float32: `x * torch.rsqrt(x.pow(2).mean(-1, True) + eps)
             * w`)
Not matched (named in adaptive_eager/LIMITS.md): masked_fill / boolean masks, dropout between
softmax and the second matmul, bf16/fp16 patterns (their casts), and any pattern a flush cuts in two.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from .ir import Node, OpSig, extent_bytes
from .kernels import cost_of
from .ops import KERNEL

# name -> the kernel's OpOverload; filled by adaptive_eager/integration/kernels.py at import.
LIBRARY: dict = {}
# Imports the library the first time it is needed (set by the integration's registration:
# fusion never imports the front package).
LOADER = None
_SIGS: dict = {}  # (kernel, static key) -> OpSig: one object per signature (plan cache hits)
_F32 = "float32"


@dataclasses.dataclass
class Substitution:
    """One rewrite in a flush: the kernel, the ops it replaced, the user's line."""

    kernel: str
    ops: tuple  # names of the replaced ops, in order
    source: object  # the last replaced op's source (the kernel node's)
    replaced: list = None  # indices of the replaced nodes in the flush, in order
    node: Node = None  # the kernel's node
    # (launches, device us, HBM bytes) the flush saves by it (negative: costs), the other
    # substitutions made as chosen: filled by the runner when it plans the flush
    saved: tuple = None


def _contiguous(size, stride) -> bool:
    expect = 1
    for n, st in zip(reversed(size), reversed(stride)):
        if n != 1 and st != expect:
            return False
        expect *= n
    return True


def _strides(size) -> tuple:
    out, acc = [], 1
    for n in reversed(size):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


class _Flush:
    """The nodes of one flush and who reads and writes each buffer."""

    def __init__(self, nodes, handles):
        self.nodes, self.handles = nodes, handles
        self.readers: dict[int, list[int]] = {}
        self.writers: dict[int, list[int]] = {}
        for i, n in enumerate(nodes):
            for li in n.reads:
                self.readers.setdefault(n.uids[li], []).append(i)
            for li in n.writes:
                self.writers.setdefault(n.uids[li], []).append(i)

    def tensor(self, i, k):
        """Argument k of node i if it is a device tensor: (uid, size, stride, offset, dtype)."""
        args = self.nodes[i].sig[2]
        t = args[k] if k < len(args) else None
        if type(t) is tuple and t and t[0] == "T":
            return (self.nodes[i].uids[t[1]],) + t[2:6]
        return None

    def scalar(self, i, k):
        """Argument k of node i if it is a runtime scalar: its value, else None."""
        args = self.nodes[i].sig[2]
        t = args[k] if k < len(args) else None
        if type(t) is tuple and t and t[0] == "S":
            v = self.nodes[i].inputs[t[1]]
            return v if type(v) in (int, float) else None
        return None

    def out(self, i):
        """The one new output of node i: (uid, size, stride, dtype), or None."""
        n = self.nodes[i]
        outs = [o for o in n.outs if o is not None]
        if len(outs) != 1 or len(n.op.arg_writes):
            return None
        o = outs[0]
        return n.uids[o[1]], o[2], o[3], o[4]

    def producer(self, uid):
        w = self.writers.get(uid, ())
        return w[0] if len(w) == 1 else None

    def private(self, uid, producer, consumer) -> bool:
        """Note [Substitution]: made by `producer`, read by `consumer` alone, no live tensor."""
        return (self.handles[uid] is None and self.writers.get(uid) == [producer]
                and self.readers.get(uid) == [consumer])

    def whole(self, view, uid, size=None) -> bool:
        """Does `view` read the whole of buffer `uid` (made in this flush) in row-major order?"""
        if view is None or view[0] != uid or view[3] != 0 or view[4] != _F32:
            return False
        if size is not None and tuple(view[1]) != tuple(size):
            return False
        return _contiguous(view[1], view[2])

    def untouched(self, uids, first, last, skip) -> bool:
        """No node in (first, last), other than `skip`, writes any of `uids`."""
        return not any(w for u in uids for w in self.writers.get(u, ())
                       if first < w < last and w not in skip)

    def plain(self, i, n_args) -> bool:
        """Node i has `n_args` positional arguments and no keyword ones (no alpha, no dtype)."""
        return len(self.nodes[i].sig[2]) == n_args and not self.nodes[i].sig[3]

    def name(self, i):
        return self.nodes[i].name


def _attention(f: _Flush, sm: int):
    """Match attention around the `_softmax` node `sm`: (nodes replaced, kernel node) or None."""
    n = f.nodes[sm]
    args = n.sig[2]
    x, o = f.tensor(sm, 0), f.out(sm)
    if x is None or o is None or len(args) != 3 or args[2] is not False:
        return None
    size = tuple(x[1])
    if len(size) < 3 or args[1] not in (-1, len(size) - 1) or o[3] != _F32:
        return None
    chain, cur, view = [sm], x[0], x
    scale, mask = 1.0, None
    # backwards: [add(mask)], [mul/div by a scalar], then bmm
    p = f.producer(cur)
    if p is not None and f.name(p) == "add.Tensor" and f.plain(p, 2) and (
            f.whole(view, cur, size) and f.private(cur, p, chain[-1])):
        a, b = f.tensor(p, 0), f.tensor(p, 1)
        for mine, other in ((a, b), (b, a)):  # the scores' side: made by mul, div or bmm
            if mine is None or other is None or mine[0] == other[0]:
                continue
            pm = f.producer(mine[0])
            if (pm is not None and f.name(pm) in ("mul.Tensor", "div.Tensor", "bmm")
                    and f.whole(mine, mine[0], size) and other[4] == _F32
                    and torch.broadcast_shapes(tuple(other[1]), size) == size):
                chain.append(p)
                mask, cur, view = other, mine[0], mine
                p = pm
                break
    if p is not None and f.name(p) in ("mul.Tensor", "div.Tensor") and f.plain(p, 2):
        t, s = f.tensor(p, 0), f.scalar(p, 1)
        if t is not None and s is not None and s != 0 and f.whole(view, cur, size) and (
                f.private(cur, p, chain[-1])):
            chain.append(p)
            scale = float(s) if f.name(p) == "mul.Tensor" else 1.0 / float(s)
            cur, view = t[0], t
            p = f.producer(cur)
    if p is None or f.name(p) != "bmm" or not f.private(cur, p, chain[-1]) or not f.plain(p, 2):
        return None
    qv, ktv = f.tensor(p, 0), f.tensor(p, 1)
    bo = f.out(p)
    if qv is None or ktv is None or bo is None or qv[4] != _F32 or ktv[4] != _F32:
        return None
    bh, s_q, s_k = bo[1]
    lead = size[:-2]
    if size[-2:] != (s_q, s_k) or math.prod(lead) != bh or not f.whole(view, cur, size):
        return None
    chain.append(p)
    # forwards: the softmax output read by one bmm, as (bh, s_q, s_k)
    pv = f.readers.get(o[0], ())
    if len(pv) != 1 or f.name(pv[0]) != "bmm" or not f.private(o[0], sm, pv[0]) or (
            not f.plain(pv[0], 2)):
        return None
    e = pv[0]
    if not f.whole(f.tensor(e, 0), o[0], (bh, s_q, s_k)) or not _contiguous(o[1], o[2]):
        return None
    vv, eo = f.tensor(e, 1), f.out(e)
    if vv is None or eo is None or vv[4] != _F32 or eo[3] != _F32:
        return None
    first = min(chain)
    reads = [qv[0], ktv[0]] + ([mask[0]] if mask is not None else [])
    if not f.untouched(reads, first, e, set(chain)):
        return None

    def unflatten(v):  # a (bh, a, b) view as lead + (a, b): dim 0's stride split over lead
        _, (n0, a, b), (s0, sa, sb), off, dt = v
        st = tuple(s0 * math.prod(lead[j + 1:]) for j in range(len(lead)))
        return (lead + (a, b), st + (sa, sb), off, dt)

    q_l = unflatten(qv)
    kt_size, kt_stride, kt_off, _ = unflatten(ktv)
    k_l = (kt_size[:-2] + (kt_size[-1], kt_size[-2]), kt_stride[:-2]
           + (kt_stride[-1], kt_stride[-2]), kt_off, _F32)
    v_l = unflatten(vv)
    d_v = v_l[0][-1]
    out_size = lead + (s_q, d_v)
    tensors = [(qv[0],) + q_l, (ktv[0],) + k_l, (vv[0],) + v_l]
    if mask is not None:
        tensors.append(mask)
    static = (False, scale)
    node = _kernel_node(f, "flash_attention", tensors, static, mask is not None,
                        [(eo[0], out_size), (None, lead + (s_q,))], e)
    return sorted(chain) + [e], node


def _sole_mul(f, buf, producer):
    """The one reader of `buf` (made by `producer`, read by nothing else) when it is a plain
    `mul.Tensor` of two tensors: (that node, its operand reading `buf`, the other operand);
    else None."""
    readers = f.readers.get(buf, ())
    if len(readers) != 1 or f.name(readers[0]) != "mul.Tensor" or (
            not f.private(buf, producer, readers[0]) or not f.plain(readers[0], 2)):
        return None
    n = readers[0]
    a, b = f.tensor(n, 0), f.tensor(n, 1)
    if a is None or b is None:
        return None
    return (n, a, b) if a[0] == buf else (n, b, a)


def _rms_norm(f: _Flush, r: int):
    """Match RMSNorm around the `rsqrt` node `r`: (nodes replaced, kernel node) or None."""
    ro, rv = f.out(r), f.tensor(r, 0)
    if ro is None or rv is None or ro[3] != _F32:
        return None
    a = f.producer(rv[0])  # add(mean, eps)
    if a is None or f.name(a) != "add.Tensor" or not f.plain(a, 2):
        return None
    eps = f.scalar(a, 1)
    mv = f.tensor(a, 0)
    if eps is None or mv is None or not f.private(rv[0], a, r) or not f.whole(rv, rv[0]):
        return None
    m = f.producer(mv[0])  # mean(pow, [-1], keepdim=True)
    if m is None or f.name(m) != "mean.dim" or not f.private(mv[0], m, a) or (
            not f.whole(mv, mv[0])):
        return None
    margs = f.nodes[m].sig[2]
    pvw = f.tensor(m, 0)
    if pvw is None or len(margs) != 3 or margs[2] is not True or not f.plain(m, 3):
        return None
    nd = len(pvw[1])
    if margs[1] not in (("L", -1), ("L", nd - 1)):
        return None
    p = f.producer(pvw[0])  # pow(X, 2)
    if p is None or f.name(p) != "pow.Tensor_Scalar" or f.scalar(p, 1) != 2 or (
            not f.plain(p, 2) or not f.private(pvw[0], p, m) or not f.whole(pvw, pvw[0])):
        return None
    x = f.tensor(p, 0)
    if x is None or x[4] != _F32:
        return None
    # forwards: mul(X, rstd) then mul(., W) (either order)
    found = _sole_mul(f, ro[0], r)
    if found is None:
        return None
    m1, rs, xs = found
    if xs != x or rs[0] != ro[0] or not f.whole(rs, ro[0]):
        return None
    h = f.out(m1)
    if h is None or h[3] != _F32 or tuple(h[1]) != tuple(x[1]):
        return None
    found = _sole_mul(f, h[0], m1)
    if found is None:
        return None
    m2, hs, w = found
    y = f.out(m2)
    if (hs[0] != h[0] or not f.whole(hs, h[0], x[1]) or w[0] == h[0] or w[4] != _F32
            or tuple(w[1]) != (x[1][-1],) or y is None or tuple(y[1]) != tuple(x[1])
            or y[3] != _F32):
        return None
    chain = [p, m, a, r, m1, m2]
    if not f.untouched([x[0], w[0]], p, m2, set(chain)):
        return None
    node = _kernel_node(f, "rms_norm", [x, w], (float(eps),), False,
                        [(y[0], tuple(y[1]), tuple(y[2])), (None, tuple(x[1][:-1]))], m2)
    return chain, node


_MATCHERS = {"_softmax": _attention, "rsqrt": _rms_norm}
# The patterns' ops: the adaptive policy's idle flush does not cut between two of them while
# substitution is on (a pattern cut in two flushes is never matched)
_CHAIN = frozenset({"bmm", "mul.Tensor", "div.Tensor", "add.Tensor", "_softmax",
                    "pow.Tensor_Scalar", "mean.dim", "rsqrt"})


def holds(queued: list, node: Node) -> bool:
    """Note [Substitution]: would an idle flush before `node` (after the `queued` nodes) cut a
    pattern? A pattern's op, or a copy (matmul's operand made contiguous), after one of the
    last three queued ops is a pattern's."""
    return (node.name in _CHAIN or node.name == "clone") and any(
        n.name in _CHAIN for n in queued[-3:])


def _kernel_node(f: _Flush, kernel: str, tensors, static, with_mask, outs, at) -> Node:
    """The kernel's node: `tensors` (uid, size, stride, offset, dtype) as its tensor
    arguments, then `static`; `outs`: per result (uid or None for a new buffer of the
    rewrite, size[, stride]); its source: node `at`'s."""
    func = LIBRARY[kernel]
    local: dict[int, int] = {}
    for t in tensors:
        local.setdefault(t[0], len(local))
    templates = tuple(("T", local[t[0]]) + tuple(t[1:]) for t in tensors)
    if kernel == "flash_attention":  # (q, k, v, causal, scale, mask)
        args = templates[:3] + static + ((templates[3],) if with_mask else (None,))
    else:  # (x, weight, eps)
        args = templates + static
    n_args = len(local)
    out_t = []
    for j, o in enumerate(outs):
        size = tuple(o[1])
        stride = tuple(o[2]) if len(o) > 2 else _strides(size)
        out_t.append(("N", n_args + j, size, stride, _F32))
    out_t = tuple(out_t)
    key = (kernel, args, out_t)
    op = _SIGS.get(key)
    if op is None:
        meta = [torch.empty_strided(t[1], t[2], dtype=torch.float32, device="meta")
                for t in tensors]
        margs = list(meta[:3]) + list(static) + ([meta[3]] if with_mask else [None]) \
            if kernel == "flash_attention" else meta + list(static)
        new_bytes = tuple(math.prod(o[2]) * 4 for o in out_t)
        cost = cost_of(func, margs, {}, None)
        op = _SIGS[key] = OpSig(func, KERNEL, args, (), out_t, n_args, (), 0.0, new_bytes,
                                cost)
    uids = [None] * n_args
    vbytes = [0] * n_args
    for t in tensors:
        li = local[t[0]]
        uids[li] = t[0]
        vbytes[li] = max(vbytes[li], extent_bytes(tuple(t[1]), tuple(t[2]), t[3], 4))
    for o in outs:
        if o[0] is None:  # a value only the kernel makes (lse, rstd): never read, not kept
            f.handles.append(None)
            uids.append(len(f.handles) - 1)
        else:
            uids.append(o[0])
    return Node(op, tuple(uids), [], tuple(vbytes) + op.new_bytes, f.nodes[at].source)


def find(nodes: list[Node], handles: list) -> list[Substitution]:
    """Note [Substitution]: every pattern of the flush that may be replaced, without overlap.
    `handles`: the flush's handles (None: no live tensor), extended in place with the
    kernels' own new buffers."""
    if not LIBRARY and LOADER is not None:
        LOADER()
    if not LIBRARY or not any(n.name in _MATCHERS for n in nodes):
        return []
    f = _Flush(nodes, handles)
    taken: set[int] = set()
    subs = []
    for i, n in enumerate(nodes):
        match = _MATCHERS.get(n.name)
        if match is None or i in taken:
            continue
        got = match(f, i)
        if got is None or taken.intersection(got[0]):
            continue
        replaced, node = got
        taken.update(replaced)
        subs.append(Substitution(node.op.func._schema.name,
                                 tuple(nodes[k].name for k in replaced), node.source,
                                 replaced, node))
    return subs


def apply(nodes: list[Node], subs) -> list[Node]:
    """The flush's nodes with `subs` made: each kernel node at its pattern's last op."""
    if not subs:
        return nodes
    gone = {k for s in subs for k in s.replaced}
    at = {s.replaced[-1]: s.node for s in subs}
    return [at.get(i, n) for i, n in enumerate(nodes) if i not in gone or i in at]
