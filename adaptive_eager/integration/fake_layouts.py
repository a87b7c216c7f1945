"""Fake kernels on the neuron device that lay out and shape results as CPU's kernels do.

Note [Fake layouts of the device]: Dynamo and AOTAutograd trace graphs over FakeTensors on
`neuron:k`, and a few of PyTorch's fake and meta kernels answer by the device's type. The
device runs CPU's kernels, but for a PrivateUse1 device those rules give CUDA's (or a generic
backend's) answer: the fake convolution asks `torch._C._select_conv_backend`, which names
PrivateUse1's backend "Overrideable" (memory format: contiguous) where CPU's (mkldnn) keeps a
channels_last input or weight channels_last; `pixel_shuffle`'s meta kernel keeps channels_last
only for device type "cpu". The graph then believed in layouts the device never makes, and a
`reshape` it had turned into `view` failed at run time ("view size is not compatible").

For the ops of `_ops()` (`fusion.ops.LAID_OUT_BY_DEVICE_TYPE`, which the engine reads too, and
`_scaled_mm`), a fake call whose tensors are all on the neuron device is answered by
CPU's own fake kernel: each tensor relabelled as a CPU FakeTensor (a view of the same meta
storage: sizes, strides, offset and requires_grad kept, nothing allocated, so a 10 GB input
costs what a small one does), the op run in the same fake mode, and its results relabelled
back to the neuron device (fresh FakeTensors, so their dispatch keys are the device's). The
entries go into PyTorch's table of fake rules (`fake_impls.op_implementations_dict`, private;
`register_op_impl` fills it), wrapping PyTorch's own entry where there is one; any other call
(CPU, CUDA, meta, a mix of devices) gets exactly what it got before: PyTorch's entry, or
NotImplemented, which sends FakeTensor on to the meta kernel as if the entry were absent.
`torch.library.register_fake` cannot do this: it is per operator, not per device, and
installs a Meta kernel for every device.

Every device-type rule in torch 2.13's fake and meta code (`device_hint`, `device.type`,
`is_cuda`, `_select_conv_backend` in _meta_registrations.py, fake_impls.py, _refs, _decomp,
_prims), decided (tests/integration/test_compile_fake_layouts.py checks the ones here):
- here, as CPU: convolution, _convolution (both overloads), convolution_backward (layouts);
  pixel_shuffle (layout); nonzero_static (CPU's row-major result, not CUDA's column-major);
  _embedding_bag, _embedding_bag_forward_only (CPU's shapes of offset2bag, bag_size,
  max_indices); _fft_c2c (its rule differs only on a torch built without MKL); _scaled_mm,
  _scaled_mm_v2 (CPU's stride checks).
- already CPU's answer for the neuron device (the rule singles out "cuda" or "xpu", not "cpu"):
  _fft_r2c, _fft_c2r, linalg_eig, _linalg_svd and prims.svd (column-major), reflection and
  replication pad2d, upsample_nearest2d and the interpolation decompositions, channel_shuffle's
  view for groups 1 or C, log_sigmoid_forward's buffer, the convolution's empty-output check.
- no layout or shape: median/mode (a determinism alert), group_norm's decomposition and
  get_acc_type (values of decompositions the graph never holds), the RNG decompositions,
  flash attention's seed (CUDA's op; the device takes CPU's attention path).
- the device's own: histc's integer check (CPU refuses integers; the device counts them as
  CUDA does, fusion/ops.py `_histc`, and so does the fake rule for a non-CPU device).
- not followed (adaptive_eager/LIMITS.md): eval-mode batch norm's saved statistics, (C,) for
  any device but CPU: FakeTensor runs the decomposition before any fake rule, and the
  backward (train=False) never reads them; channel_shuffle of channels_last, whose fake
  layout is wrong for CPU too (its decomposition's, not a device rule).
"""
from __future__ import annotations

import contextlib

import torch
import torch.utils._pytree as pytree

from fusion.ops import LAID_OUT_BY_DEVICE_TYPE

from ..config import DEVICE_TYPE

aten = torch.ops.aten
_CPU = torch.device("cpu")


def _ops() -> list:
    """fusion.ops.LAID_OUT_BY_DEVICE_TYPE (shared with the engine's unprobed signatures) and
    the ops only a graph's fake rules need here (CPU's stride checks of `_scaled_mm`, an op
    the device does not run)."""
    names = [("_scaled_mm", "default"), ("_scaled_mm_v2", "default")]
    return [*LAID_OUT_BY_DEVICE_TYPE, *(getattr(getattr(aten, op), overload)
                                        for op, overload in names
                                        if hasattr(getattr(aten, op, None), overload))]


def _relabel(fake_mode, t, device, requires_grad=False):
    """A FakeTensor on `device` over `t`'s meta storage, with its sizes, strides and offset."""
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
    env = fake_mode.shape_env
    with in_kernel_invocation_manager(fake_mode), (
            env.suppress_guards() if env is not None else contextlib.nullcontext()):
        m = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        m.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
    m.requires_grad_(requires_grad)  # (CPU's backend choice reads it: nnpack without grad)
    return FakeTensor(fake_mode, m, device)


def _device_of(leaves):
    """The neuron device all tensor arguments are on, or None (some other device, a mix, or
    a layout other than strided): those calls keep PyTorch's own rule."""
    from torch._subclasses.fake_tensor import FakeTensor
    device = None
    for v in leaves:
        if isinstance(v, torch.Tensor):
            if not isinstance(v, FakeTensor) or v.layout != torch.strided:
                return None
            d = v.fake_device
            if d.type != DEVICE_TYPE or (device is not None and d != device):
                return None
            device = d
    return device


def _as_on_cpu(previous):
    def fake_rule(fake_mode, func, *args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        device = _device_of(leaves)
        if device is None:
            if previous is not None:
                return previous(fake_mode, func, *args, **kwargs)
            return NotImplemented  # FakeTensor goes on to the meta kernel
        leaves = [_relabel(fake_mode, v, _CPU, v.requires_grad) if isinstance(v, torch.Tensor)
                  else v for v in leaves]
        cpu_args, cpu_kwargs = pytree.tree_unflatten(leaves, spec)
        with fake_mode:
            out = func(*cpu_args, **cpu_kwargs)
        return pytree.tree_map_only(torch.Tensor, lambda t: _relabel(fake_mode, t, device), out)
    fake_rule._neuron_cpu_rule = True
    return fake_rule


def register() -> None:
    """Put the CPU-answering fake rules of `_ops()` in PyTorch's table (idempotent)."""
    from torch._subclasses import fake_impls
    table = fake_impls.op_implementations_dict
    for op in _ops():
        if not getattr(table.get(op), "_neuron_cpu_rule", False):
            table[op] = _as_on_cpu(table.get(op))


def registered() -> list:
    """The ops whose fake rule answers as CPU's on the device (pinned by the tests)."""
    from torch._subclasses import fake_impls
    table = fake_impls.op_implementations_dict
    return [op for op in _ops() if getattr(table.get(op), "_neuron_cpu_rule", False)]
