"""Decompositions that PyTorch runs while tracing a graph and that compute the wrong value,
replaced by corrected ones: in `torch.compile(backend="neuron")` graphs and in the groups the
Inductor executors compile.

Note [Wrong decompositions in graphs]: while AOTAutograd traces a graph (torch.compile,
torch.export, TorchInductor's own entry), PyTorch's Python dispatcher runs the decompositions
registered with `py_impl(DispatchKey.Autograd)` in place of the op's own autograd kernel, for
every backend: the graph holds the decomposition's ops, not the op. Neuron eager runs CPU's
kernel of the op, so a wrong decomposition makes a graph disagree with eager, silently (CPU's
own `torch.compile` gives the same wrong value). Each one is corrected here (PyTorch's own
fix where upstream has one; remove an entry once the torch we require has it), and used twice:
- compile mode (adaptive_eager/integration/compile.py): `register()` installs them for the
  neuron device's autograd key only (`AutogradPrivateUse1`, which PyTorch's resolution looks
  up before the `Autograd` alias: other devices keep PyTorch's);
- the Inductor executors (fusion/executors/fx.py): a group's graph is traced over CPU fake
  tensors, so the key would be CPU's, which is not ours to change; the graph calls the
  corrected function in place of the op (`CORRECTED`), so Inductor traces its ops and never
  meets the op. Their `out=` forms reach Inductor's decomposition table through
  functionalization instead: a group holding one runs interpreted (`check` in fx.py).

- `multilabel_margin_loss_forward`: targets after the first -1 were still counted, as class 0
  (pytorch/pytorch#141017, #185464; fixed by #189552, not in torch 2.13): 3.37 for eager's
  1.15 on a row `[3, 0, -1, 1, 0]`. Also, an unbatched input with reduction 'none' gave a
  1-element result where the kernel gives a 0-d one.
- `multi_margin_loss`: a NaN term was summed (`clamp_min(0)` keeps NaN) where the kernel adds
  a term only if it is > 0 (NaN for eager's inf); the same 0-d shape for one sample. No
  upstream fix yet (found by a scan of compile mode against eager, op by op).
- `softshrink`: NaN took the zero branch (`where(|a| > l, ..., a * 0)`): its gradient in
  compile mode was 0 where the kernel's backward passes it on, and its value under Inductor
  0 (it folds `a * 0`) for the kernel's NaN. No upstream fix yet (the same scan; the value by
  a differential test of the Inductor executor).
"""
from __future__ import annotations

import torch
from torch._decomp.decompositions import Reduction

aten = torch.ops.aten


def _multilabel_margin_loss_forward(input, target, reduction):
    """torch/_decomp/decompositions.py's, with PR #189552's two changes (marked)."""
    orig_input_shape, orig_target_shape = input.shape, target.shape
    input, target = torch.atleast_2d(input), torch.atleast_2d(target)
    dim = input.shape[1]
    torch._check(
        len(orig_input_shape) <= 2 and dim != 0,
        lambda: f"Expected non-empty vector or matrix with optional 0-dim batch size, but "
                f"got: {orig_input_shape}")
    torch._check(
        len(orig_target_shape) <= 2 and orig_target_shape == orig_input_shape,
        lambda: f"inconsistent target size: {orig_target_shape} for input of size: "
                f"{orig_input_shape}")
    idx = torch.arange(dim, device=target.device)
    end_idx = torch.amin(torch.where(target == -1, idx, dim), dim=-1, keepdim=True)
    target_mask = idx < end_idx  # the targets before the first -1
    u = torch.gather(input, dim=-1, index=torch.where(target_mask, target, 0))
    is_target = torch.any(idx == torch.where(target_mask, target, -1).unsqueeze(dim=-1), dim=1)
    z = (1.0 - u.T.unsqueeze(dim=-1) + input).clamp_min(0) / dim  # [target slot, row, class]
    z = torch.where(is_target, 0, z)
    z = torch.where(target_mask.T.unsqueeze(dim=-1), z, 0)  # (fix) slots after the -1: none
    if reduction == Reduction.MEAN.value:
        z = z.sum(dim=(0, -1)).mean()
    elif reduction == Reduction.SUM.value:
        z = z.sum()
    else:
        z = z.sum(dim=(0, -1))
        if len(orig_input_shape) == 1:  # (fix) unbatched: 0-d, as the kernel's
            z = z.squeeze(0)
    return z, is_target.to(input.dtype).reshape(orig_target_shape)


def _multi_margin_loss(input, target, p=1, margin=1, weight=None,
                       reduction=Reduction.MEAN.value):
    """torch/_decomp/decompositions.py's, with the kernel's `z > 0` and the unbatched 0-d
    result (marked)."""
    unbatched = input.ndim == 1
    input, target = torch.atleast_2d(input), torch.atleast_1d(target)
    nframe, dim = input.shape[0], input.shape[1]
    torch._check(p == 1 or p == 2, lambda: "only p == 1 and p == 2 supported")
    torch._check(
        input.ndim == 2 and dim != 0,
        lambda: f"Expected non-empty vector or matrix with optional 0-dim batch size, but "
                f"got: {input.shape}")
    torch._check(
        target.ndim == 1 and target.numel() == nframe,
        lambda: f"inconsistent target size, expected {nframe} but got {target.shape}")
    if weight is not None:
        weight = torch.atleast_1d(weight)
        torch._check(weight.ndim == 1 and weight.numel() == dim,
                     lambda: f"inconsistent weight size, expected {dim} but got {weight.shape}")
    target = target.unsqueeze(1)
    z = margin - torch.gather(input, dim=1, index=target) + input
    z = torch.where(z > 0, z, 0)  # (fix) a term counts only if > 0: NaN terms do not
    z = z if p == 1 else z * z
    if weight is not None:
        z = z * weight[target]
    z = torch.where(torch.arange(dim, device=input.device) != target, z, 0)
    if reduction == Reduction.MEAN.value:
        return z.mean()
    if reduction == Reduction.SUM.value:
        return z.sum() / z.shape[1]
    z = z.mean(dim=1)
    return z.squeeze(0) if unbatched else z  # (fix) unbatched: 0-d, as the kernel's


def _softshrink(a, lambd=0.5):
    """torch/_refs/nn/functional's, its zero branch chosen as the kernel's backward chooses
    it (`-l <= x <= l`), so NaN takes the other branch (and its gradient)."""
    torch._check(
        0 <= lambd <= torch.finfo(a.dtype).max,
        lambda: f"lambda must be in range [0, {torch.finfo(a.dtype).max}] for input dtype "
                f"{a.dtype}, but found {lambd}")
    return torch.where((a >= -lambd) & (a <= lambd), 0, a - torch.sign(a) * lambd)


# op -> its corrected decomposition (the op's default overload: see the Note for out=)
CORRECTED = {aten.multilabel_margin_loss_forward.default: _multilabel_margin_loss_forward,
             aten.multi_margin_loss.default: _multi_margin_loss,
             aten.softshrink.default: _softshrink}


def register(key=torch._C.DispatchKey.AutogradPrivateUse1) -> None:
    """Install the corrected decompositions for the neuron autograd key (idempotent; the
    fuzzer's CPU reference of compile mode installs them for `AutogradCPU` too)."""
    for op, fn in CORRECTED.items():
        if key not in op.py_kernels:
            op.py_impl(key)(fn)
