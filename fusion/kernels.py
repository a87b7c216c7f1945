"""Custom kernels: a user's PyTorch custom op with a neuron kernel, and what it costs.

Note [Custom kernels]: an op of another namespace than aten with a kernel for the device's
dispatch key (`torch.library.custom_op(...).register_kernel("neuron")`, or
`torch.library.impl(..., "PrivateUse1")`) is a kernel (op class KERNEL). The engine queues it
like any op (its fake impl gives its outputs at the call); the partitioner gives it a launch
of its own (Note [Partitioning]: a boundary before and after it, which explain() names), and
the device runs the user's Python body over the host memory of the device buffers, as it runs
CPU's kernels for ATen ops. Its simulated cost is what the user declares (`register_cost`),
else a roofline over its inputs and outputs (`roofline`).

The costs of the library kernels (`ae.kernels`: adaptive_eager/integration/kernels.py) are
here too: they model how each kernel tiles its work through SBUF (`flash_attention_cost`...).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import torch
from torch.utils._pytree import tree_flatten

_KEY = torch._C.DispatchKey.PrivateUse1


@dataclasses.dataclass(frozen=True)
class Cost:
    """The simulated cost of one launch of a kernel.

    flops: floating-point operations; bytes_read / bytes_written: HBM traffic; sbuf_bytes:
    on-chip working set (refused at the call if above the device's SBUF); overhead_us: fixed
    time added to the launch's (on top of the device's launch overhead). Launch time =
    launch overhead + overhead_us + max(HBM bytes / bandwidth, flops / peak)."""

    flops: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    sbuf_bytes: int = 0
    overhead_us: float = 0.0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0:
                raise ValueError(f"Cost.{f.name} must be a number of at least 0, got {v!r}")

    @property
    def hbm_bytes(self) -> int:
        return int(self.bytes_read + self.bytes_written)


_COSTS: dict[str, Callable] = {}  # qualified op name -> cost function


def _qualname(op) -> str:
    if isinstance(op, str):
        return op
    if hasattr(op, "_opoverload"):  # a torch.library.custom_op's CustomOpDef
        op = op._opoverload
    if isinstance(op, torch._ops.OpOverloadPacket):
        op = op.default
    if isinstance(op, torch._ops.OpOverload):
        return op._schema.name
    raise TypeError(f"expected an operator (a custom_op, torch.ops.ns.name or 'ns::name'), "
                    f"got {op!r}")


def register_cost(op, fn: Callable | None = None):
    """Declare the simulated cost of custom kernel `op` (a `torch.library.custom_op`,
    `torch.ops.ns.name[.overload]` or `"ns::name"`): `fn` takes the op's arguments (tensors
    as meta tensors: shapes, strides and dtypes, no values) and returns a `Cost`. It runs once
    per argument signature, at the first call. Usable as a decorator. Without a declared cost
    a kernel costs a roofline over its inputs and outputs (`roofline`)."""
    name = _qualname(op)

    def register(f):
        _COSTS[name] = f
        return f
    return register if fn is None else register(fn)


def _tensor_bytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(tree)[0]
               if isinstance(t, torch.Tensor))


def roofline(args, kwargs, out) -> Cost:
    """The default cost: every input read once, every output written once, one FLOP per
    output element (as the engine counts any op without a FLOP formula)."""
    flops = sum(t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
    return Cost(flops=float(flops), bytes_read=_tensor_bytes((args, kwargs)),
                bytes_written=_tensor_bytes(out))


def cost_of(func, args, kwargs, out) -> Cost:
    """The cost of one call of kernel `func` on (meta) `args`; `out`: its fake outputs."""
    fn = _COSTS.get(func._schema.name)
    if fn is None:
        return roofline(args, kwargs, out)
    cost = fn(*args, **kwargs)
    if not isinstance(cost, Cost):
        raise TypeError(f"the cost function of kernel {func._schema.name} returned "
                        f"{type(cost).__name__}, expected adaptive_eager.Cost")
    return cost


def is_kernel(func) -> bool:
    """Note [Custom kernels]: an op of another namespace with a kernel for the device."""
    return func.namespace != "aten" and torch._C._dispatch_has_kernel_for_dispatch_key(
        func.name(), "PrivateUse1")


@functools.lru_cache(maxsize=None)
def body(func) -> Callable:
    """What the device runs for kernel `func`: its neuron kernel, called with host tensors
    over the device buffers (the kernel registered for the device's dispatch key)."""
    def run(*args, **kwargs):
        return func._op_dk(_KEY, *args, **kwargs)
    run.__name__ = run.__qualname__ = func._schema.name
    return run


# -- the library kernels' costs (ae.kernels) ------------------------------------------------
# Note [Kernel tiling]: each library kernel keeps its working tiles in SBUF and reads and
# writes HBM only for what crosses tiles, as NKI-lib's kernels do. The figures below count
# those HBM bytes. FLOPs count multiply-adds as 2.

FLASH_BLOCK = 128  # query / key rows per tile (a NeuronCore's partition count)
FLASH_RESIDENT_BYTES = 16 * 2**20  # assumption: the SBUF share K and V may keep resident


def flash_attention_cost(b: int, h: int, s_q: int, s_k: int, d: int, dv: int, itemsize: int,
                         causal: bool, backward: bool = False, mask: tuple = (0, 1)) -> Cost:
    """Flash attention, tiled: per (batch, head), query blocks of FLASH_BLOCK rows stay in
    SBUF while K and V stream through in blocks; scores and probabilities never leave SBUF.
    HBM: Q, K, V read, O and the row log-sum-exp (float32) written: O(seq * d). K and V are
    read once per query block only if they do not fit in SBUF beside the query block.
    `mask`: (bytes, sharers) of an additive mask shared by `sharers` (batch, head) pairs: read
    once if it fits in SBUF beside K and V (FLASH_RESIDENT_BYTES, assumption), else once per
    pair (an explicit seq x seq mask costs what it weighs; a causal flag costs nothing)."""
    bh = b * h
    q_blocks = math.ceil(s_q / FLASH_BLOCK)
    kv_bytes = s_k * (d + dv) * itemsize
    # a query block, its output accumulator, and a block of scores and probabilities (fp32)
    tile = FLASH_BLOCK * (d + dv) * (itemsize + 4) + FLASH_BLOCK * FLASH_BLOCK * 4 * 2
    resident = kv_bytes + tile <= FLASH_RESIDENT_BYTES  # K and V stay in SBUF for every block
    sbuf = kv_bytes + tile if resident else tile + 2 * FLASH_BLOCK * (d + dv) * itemsize
    kv_passes = 1 if resident else q_blocks  # else streamed once per query block
    pairs = s_q * s_k / (2 if causal else 1)
    mask_bytes, sharers = mask
    mask_read = mask_bytes if mask_bytes + kv_bytes + tile <= FLASH_RESIDENT_BYTES \
        else mask_bytes * sharers
    if not backward:
        flops = bh * pairs * 2 * (d + dv) + bh * pairs * 5  # QK^T, PV; scale, max, exp, sum
        read = bh * (s_q * d * itemsize + kv_passes * kv_bytes)
        written = bh * (s_q * dv * itemsize + s_q * 4)
    else:  # recompute P per tile: QK^T again, dV, dP, dS, dQ, dK
        flops = bh * pairs * 2 * (2 * d + 2 * dv + d) + bh * pairs * 8
        read = bh * (s_q * (d + 2 * dv) * itemsize + s_q * 4 * 2 + kv_passes * kv_bytes)
        written = bh * (s_q * d + s_k * (d + dv)) * itemsize
    return Cost(flops=float(flops), bytes_read=int(read + mask_read), bytes_written=int(written),
                sbuf_bytes=int(sbuf))


def rms_norm_cost(rows: int, n: int, itemsize: int, w_itemsize: int,
                  backward: bool = False) -> Cost:
    """RMSNorm in one pass: each row is read once into SBUF, its mean square reduced there,
    scaled and written once; the weight is read once. Backward reads x, dy (and the weight),
    writes dx and accumulates dweight on chip, written once."""
    row = n * itemsize
    if not backward:
        return Cost(flops=4.0 * rows * n, bytes_read=rows * row + n * w_itemsize,
                    bytes_written=rows * row, sbuf_bytes=min(rows, 128) * row * 2)
    return Cost(flops=9.0 * rows * n, bytes_read=2 * rows * row + n * w_itemsize + rows * 4,
                bytes_written=rows * row + n * w_itemsize, sbuf_bytes=min(rows, 128) * row * 3)


def moe_cost(tokens: int, d: int, f: int, experts: int, top_k: int, itemsize: int,
             w_itemsize: int, backward: bool = False) -> Cost:
    """Blockwise MoE MLP (gated, SwiGLU): tokens are routed in blocks to their top-k experts;
    each expert's weights (gate, up: d x f; down: f x d) are read once per launch (for the
    experts that receive tokens: all of them, taken as a bound), each token read once and its
    output written once; the hidden activations stay in SBUF."""
    routed = tokens * top_k
    w_bytes = experts * 3 * d * f * w_itemsize
    flops = routed * (2 * d * f * 3 + 4 * f) + tokens * experts * 4
    if not backward:
        return Cost(flops=float(flops), bytes_read=tokens * (d * itemsize + experts * 4)
                    + w_bytes, bytes_written=tokens * d * itemsize,
                    sbuf_bytes=min(routed, 512) * (d + 2 * f) * 4)
    return Cost(flops=2.0 * flops, bytes_read=2 * tokens * d * itemsize + w_bytes
                + tokens * experts * 4, bytes_written=tokens * (d * itemsize + experts * 4)
                + w_bytes, sbuf_bytes=min(routed, 512) * (d + 2 * f) * 4 * 2)
