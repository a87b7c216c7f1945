"""Pattern substitution: hand-written attention and RMSNorm in a flush become one launch of the
kernel library's flash_attention / rms_norm (adaptive mode, `ADAPTIVE_EAGER_SUBSTITUTE=1`);
attention's forward and its backward in one flush become flash_attention_fwd and _bwd.

Note [Substitution]: the queue sits below autograd, so a rewrite here is safe only where no
value of the pattern but its results is needed by anything else. `find` replaces a matched
set of ops by kernel nodes only when every intermediate value
  - is made by the pattern's op and read by the pattern's own ops alone, in this flush;
  - has no live tensor at the flush (not user-visible, not saved for backward: a saved
    tensor keeps its handle alive);
and when nothing between the pattern's first and last op writes a buffer the pattern reads
(each kernel runs at the place of its part's last op). Values: the kernels', which match
the ATen ops within their documented float32 tolerance (tests/integration/
test_substitution.py); only float32 patterns are matched. Runtime scalars the match depends
on (the scale, eps, the exponent 2) are checked here, every flush (the rewrite runs before
the plan cache's lookup, so a plan never outlives the values it was matched on); the kernel
nodes carry them as static arguments (their signatures, and so the plan's key). Patterns:
  attention  bmm(Q, Kᵀ) [-> mul/div by a scalar] [-> add(mask)] -> _softmax(-1) -> bmm(., V)
             (torch.matmul's ATen form; `q @ k.transpose(-2, -1) * s + mask`, HF's eager
             attention, SDPA's math path)
  rms_norm   pow(X, 2) -> mean(-1, keepdim) -> add(eps) -> rsqrt -> mul(X, .) -> mul(., W)
             (HF's LlamaRMSNorm in float32: `x * torch.rsqrt(x.pow(2).mean(-1, True) + eps)
             * w`)
Training. Autograd saves the softmax output P for its backward, so in a flush that holds the
forward alone P has a live tensor and nothing is replaced (the default policy's idle flush
runs the forward before the backward is queued: no substitution there). When the backward
is queued before the flush (the purely lazy policy, queue_low_threshold=0: forward, backward
and optimizer in one flush), backward() has freed the saved P by the flush, and P's other
readers are the backward's ops. `_attention_backward` matches them (autograd's matmul,
scale and softmax backward; the mask's add passes the gradient through), and the pair is
one substitution: flash_attention_fwd at P @ V's place and flash_attention_bwd at the last
backward op's, the forward's log-sum-exp passed from one to the other in a buffer of the
rewrite, P, dP and dS never written. The intermediates' rules extend to the pair (P, dP, dS
read by the pair's ops alone, no live tensor), the forward's inputs (Q, Kᵀ, V, the mask) are
untouched from the forward's first op to the backward's last, dO within the backward, and
nothing reads the gradients dQ, dKᵀ, dV before the backward kernel has run. Replacing the
forward alone would not do (the backward reads P); keeping P as an extra output of the
forward kernel would save none of its HBM traffic. A mask that requires grad reads dS: no
match. RMSNorm's backward (a dozen elementwise ops and reductions in several orders) is not
matched: RMSNorm in a training step is never replaced.
Not matched (named in adaptive_eager/LIMITS.md): masked_fill / boolean masks, dropout between
softmax and the second matmul, bf16/fp16 patterns (their casts), and any pattern a flush cuts
in two.
"""
from __future__ import annotations

# name -> the kernel's OpOverload; filled by adaptive_eager/integration/kernels.py at import.
LIBRARY: dict = {}
# Imports the library the first time it is needed (set by the integration's registration:
# fusion never imports the front package). Defined before `import torch`: when this module is
# imported first, torch's import registers the device (backend autoload), and the
# registration sets LOADER on this half-imported module; a later `LOADER = None` undid it.
LOADER = None

import dataclasses  # noqa: E402
import math  # noqa: E402

import torch  # noqa: E402

from .ir import Node, OpSig, extent_bytes  # noqa: E402
from .kernels import cost_of  # noqa: E402
from .ops import KERNEL  # noqa: E402

_SIGS: dict = {}  # (kernel, static key) -> OpSig: one object per signature (plan cache hits)
_F32 = "float32"


@dataclasses.dataclass
class Substitution:
    """One rewrite in a flush: the kernel, the ops it replaced, the user's line."""

    kernel: str
    ops: tuple  # names of the replaced ops, in order
    source: object  # the last replaced op's source (the kernel node's)
    replaced: list = None  # indices of the replaced nodes in the flush, in order
    node: Node = None  # the kernel's node (a forward and backward pair: the forward's)
    # index in the flush -> the kernel node launched there (default: `node` at the last
    # replaced op); a forward and backward pair has two
    at: dict = None

    def __post_init__(self):
        if self.at is None and self.replaced is not None:
            self.at = {self.replaced[-1]: self.node}
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
    """Match attention around the `_softmax` node `sm`: (nodes replaced, kernel node), or
    with its backward (nodes replaced, {index: kernel node}), or None."""
    n = f.nodes[sm]
    args = n.sig[2]
    x, o = f.tensor(sm, 0), f.out(sm)
    if x is None or o is None or len(args) != 3 or args[2] is not False:
        return None
    size = tuple(x[1])
    if len(size) < 3 or args[1] not in (-1, len(size) - 1) or o[3] != _F32:
        return None
    chain, cur, view = [sm], x[0], x
    scale, mask, scale_op = 1.0, None, None
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
            scale_op = (f.name(p), s)
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
    # forwards: the softmax output P read whole, as (bh, s_q, s_k), by one bmm: P @ V
    readers = f.readers.get(o[0], ())
    pv = [r for r in readers if f.name(r) == "bmm" and f.plain(r, 2)
          and f.whole(f.tensor(r, 0), o[0], (bh, s_q, s_k))]
    if len(pv) != 1 or f.handles[o[0]] is not None or f.writers.get(o[0]) != [sm] or (
            not _contiguous(o[1], o[2])):
        return None
    e = pv[0]
    vv, eo = f.tensor(e, 1), f.out(e)
    if vv is None or eo is None or vv[4] != _F32 or eo[3] != _F32:
        return None
    first = min(chain)
    reads = [qv[0], ktv[0]] + ([mask[0]] if mask is not None else [])

    def unflatten(v):  # a (bh, a, b) view as lead + (a, b): dim 0's stride split over lead
        uid, (n0, a, b), (s0, sa, sb), off, dt = v
        st = tuple(s0 * math.prod(lead[j + 1:]) for j in range(len(lead)))
        return _T((uid, lead + (a, b), st + (sa, sb), off, dt))

    q_l, kt_l, v_l = unflatten(qv), unflatten(ktv), unflatten(vv)
    k_l = _T(kt_l[:1] + (_swap(kt_l[1]), _swap(kt_l[2])) + kt_l[3:])
    d_v = v_l[1][-1]
    out_size = lead + (s_q, d_v)
    items = [q_l, k_l, v_l, False, scale, _T(mask) if mask is not None else None]
    outs = [(eo[0], out_size), (None, lead + (s_q,))]
    if list(readers) == [e]:  # inference: P is read by P @ V alone
        if not f.untouched(reads, first, e, set(chain)):
            return None
        return sorted(chain) + [e], _kernel_node(f, "flash_attention", items, outs, e)
    # training (Note [Substitution]): P is also read by the backward's ops; the backward
    # must be in this flush too, and then the pair becomes the forward and backward kernels
    bwd = _attention_backward(f, sm, e, o, (qv, ktv, vv), (bh, s_q, s_k), size, scale_op)
    if bwd is None:
        return None
    back, dout, (dq, dkt, dv) = bwd
    last = max(back)
    replaced = sorted(chain + [e] + back)
    # the inputs are the forward's from its first op to the backward's last; dO is made
    # before the backward's first op (which reads it) and unchanged until its last
    if not f.untouched(reads, first, last, set(replaced)) or (
            not f.untouched([dout[0]], min(back), last, set(back))
            or f.writers.get(eo[0]) != [e]):
        return None
    fwd = _kernel_node(f, "flash_attention", items, outs, e)
    d = q_l[1][-1]
    ks = _strides(lead + (d, s_k))  # dK written as the (bh, d, s_k) buffer dKᵀ
    back_items = [unflatten(dout), q_l, k_l, v_l, _T((eo[0], out_size, _strides(out_size), 0,
                                                      _F32)),
                  _T((fwd.uids[-1], lead + (s_q,), _strides(lead + (s_q,)), 0, _F32))] + items[3:]
    back_outs = [(dq, lead + (s_q, d)), (dkt, lead + (s_k, d), ks[:-2] + (ks[-1], ks[-2])),
                 (dv, lead + (s_k, d_v))]
    bwd_node = _kernel_node(f, "flash_attention_bwd", back_items, back_outs, last)
    return replaced, {e: fwd, last: bwd_node}


def _swap(t):
    """The last two entries of a size or stride swapped (a transpose(-2, -1))."""
    return tuple(t[:-2]) + (t[-1], t[-2])


def _transposed(view, base) -> bool:
    """Is `view` `base`.transpose(-2, -1) (both (uid, size, stride, offset, dtype))?"""
    return (view is not None and base is not None and view[0] == base[0]
            and tuple(view[1]) == _swap(base[1]) and tuple(view[2]) == _swap(base[2])
            and view[3:] == base[3:])


def _attention_backward(f: _Flush, sm, e, p_out, fwd_views, bss, size, scale_op):
    """Match the backward of the attention whose softmax is node `sm` (output `p_out`) and
    whose P @ V is node `e`: autograd's ops for matmul, the scale and softmax, as
        dV  = bmm(Pᵀ, dO)           dP  = bmm(dO, Vᵀ)
        dS  = _softmax_backward_data(dP, P, dim, float32)   [-> mul/div by the scale]
        dKᵀ = bmm(Qᵀ, dS)           dQ  = bmm(dS, (Kᵀ)ᵀ)
    (the mask's add passes the gradient through; a mask that requires grad adds a reader of
    dS: no match). (the backward's nodes, dO's (bh, s_q, d_v) view, (dQ, dKᵀ, dV) buffers),
    or None. Every intermediate (P, dP, dS) is read by these ops alone and has no live
    tensor; the gradients are new buffers nothing reads or writes before the last of them."""
    qv, ktv, vv = fwd_views
    bh, s_q, s_k = bss
    pid = p_out[0]
    pw = (pid, (bh, s_q, s_k), _strides((bh, s_q, s_k)), 0, _F32)
    others = [r for r in f.readers.get(pid, ()) if r != e]
    dv = [r for r in others if f.name(r) == "bmm" and f.plain(r, 2)
          and _transposed(f.tensor(r, 0), pw)]
    sbd = [r for r in others if f.name(r) == "_softmax_backward_data" and f.plain(r, 4)]
    if len(others) != 2 or len(dv) != 1 or len(sbd) != 1:
        return None
    dv, sbd = dv[0], sbd[0]
    sargs = f.nodes[sbd].sig[2]
    if (sargs[2] != f.nodes[sm].sig[2][1] or sargs[3] != ("dt", _F32)
            or not f.whole(f.tensor(sbd, 1), pid, size)):
        return None
    dout = f.tensor(dv, 1)
    dp_view = f.tensor(sbd, 0)
    if dout is None or dp_view is None or dout[4] != _F32:
        return None
    dp = f.producer(dp_view[0])
    if (dp is None or f.name(dp) != "bmm" or not f.plain(dp, 2) or f.tensor(dp, 0) != dout
            or not _transposed(f.tensor(dp, 1), vv) or not f.whole(dp_view, dp_view[0], size)
            or not f.private(dp_view[0], dp, sbd)):
        return None
    back, ds = [dv, dp, sbd], f.out(sbd)
    if ds is None or tuple(ds[1]) != size or not _contiguous(ds[1], ds[2]):
        return None
    cur, producer = ds[0], sbd
    if scale_op is not None:  # the scale's gradient: the same op by the same scalar
        m = f.readers.get(cur, ())
        if (len(m) != 1 or f.name(m[0]) != scale_op[0] or not f.plain(m[0], 2)
                or f.scalar(m[0], 1) != scale_op[1] or not f.whole(f.tensor(m[0], 0), cur, size)
                or not f.private(cur, sbd, m[0])):
            return None
        back.append(m[0])
        ms = f.out(m[0])
        if ms is None or tuple(ms[1]) != size or not _contiguous(ms[1], ms[2]):
            return None
        cur, producer = ms[0], m[0]
    grads = f.readers.get(cur, ())
    dsw = (cur, (bh, s_q, s_k), _strides((bh, s_q, s_k)), 0, _F32)
    dk = [r for r in grads if f.name(r) == "bmm" and f.plain(r, 2)
          and _transposed(f.tensor(r, 0), qv) and f.tensor(r, 1) == dsw]
    dq = [r for r in grads if f.name(r) == "bmm" and f.plain(r, 2)
          and f.tensor(r, 0) == dsw and _transposed(f.tensor(r, 1), ktv)]
    if (len(grads) != 2 or len(dk) != 1 or len(dq) != 1 or f.handles[cur] is not None
            or f.writers.get(cur) != [producer]):
        return None
    back += [dk[0], dq[0]]
    last = max(back)
    if min(back) <= e:
        return None
    outs = []
    for r in (dq[0], dk[0], dv):  # new, contiguous, untouched until the kernel has run
        g = f.out(r)
        if (g is None or g[3] != _F32 or not _contiguous(g[1], g[2])
                or f.writers.get(g[0]) != [r]
                or any(k <= last for k in f.readers.get(g[0], ()))):
            return None
        outs.append(g[0])
    return back, dout, tuple(outs)


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
    node = _kernel_node(f, "rms_norm", [_T(x), _T(w), float(eps)],
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


class _T(tuple):
    """A tensor argument of a kernel node: (uid, size, stride, offset, dtype)."""


def _kernel_node(f: _Flush, kernel: str, items, outs, at) -> Node:
    """The kernel's node: `items` its arguments in the op's order, each a `_T` (a view of a
    buffer of the flush) or a static value; `outs`: per result (uid or None for a new buffer
    of the rewrite, size[, stride]); its source: node `at`'s."""
    func = LIBRARY[kernel]
    tensors = [t for t in items if type(t) is _T]
    local: dict[int, int] = {}
    for t in tensors:
        local.setdefault(t[0], len(local))
    args = tuple(("T", local[t[0]]) + tuple(t[1:]) if type(t) is _T else t for t in items)
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
        margs = [torch.empty_strided(t[1], t[2], dtype=torch.float32, device="meta")
                 if type(t) is _T else t for t in items]
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
        if o[0] is None:  # a value only the kernel makes (lse, rstd): no live tensor
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
        replaced, at = got if type(got[1]) is dict else (got[0], {got[0][-1]: got[1]})
        taken.update(replaced)
        kernels = [at[k] for k in sorted(at)]  # a pair: "aelib::flash_attention_fwd+bwd"
        name = kernels[0].op.func._schema.name + ("+bwd" if len(kernels) > 1 else "")
        subs.append(Substitution(name, tuple(nodes[k].name for k in replaced),
                                 kernels[0].source, replaced, kernels[0], at))
    return subs


def apply(nodes: list[Node], subs) -> list[Node]:
    """The flush's nodes with `subs` made: each kernel node at its place (`Substitution.at`)."""
    if not subs:
        return nodes
    gone = {k for s in subs for k in s.replaced}
    at = {i: node for s in subs for i, node in s.at.items()}
    return [at.get(i, n) for i, n in enumerate(nodes) if i not in gone or i in at]
