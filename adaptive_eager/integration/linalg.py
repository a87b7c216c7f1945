"""Eigen- and singular values on neuron, computed as CPU computes them.

`linalg_svdvals` and `linalg_eigvalsh` ask LAPACK for vectors too when the input may need
gradients, and PyTorch counts every tensor subclass as such (`isTensorSubclassLike`): so on
neuron they computed vectors CPU does not, a different LAPACK call, a few ulps off (and
`matrix_norm("nuc")`, `cond`, `svd(compute_uv=False)` with them). Here the decision is CPU's
(`_may_require_fw_or_bw_grad`): vectors only when the input needs a backward or forward
gradient.

Note [matrix_rank's out=]: PyTorch's `linalg_matrix_rank` out= kernels
(CompositeImplicitAutograd) compute a tensor subclass's rank, or any tensor's under a dispatch
mode, by `result = at::sum(S > tol, -1)` on the out tensor's C++ reference: the reference is
rebound, the tensor never written (`matrix_rank_impl`, isTensorSubclassLike branch, in ATen's
LinearAlgebra.cpp). So `torch.linalg.matrix_rank(A, out=o)` left `o` as it was, on neuron and
for CPU tensors in `ae.adaptive()`, silently. `matrix_rank_out` replaces those kernels: the
functional form, then summed into `out` over a new dimension of one (`sum`'s out= form, as
PyTorch's kernel ends: its resize of `out`, with CPU's warning, and its dtype rules); a plain
CPU call with no dispatch mode takes PyTorch's own kernel.
"""
from __future__ import annotations

import torch
from torch.autograd.forward_ad import unpack_dual


def _may_need_grad(a) -> bool:
    return (torch.is_grad_enabled() and a.requires_grad) or unpack_dual(a).tangent is not None


def svdvals(A, *, driver=None):
    return torch.ops.aten._linalg_svd(A, False, _may_need_grad(A), driver=driver)[1]


def eigvalsh(A, UPLO="L"):
    return torch.ops.aten._linalg_eigh(A, UPLO, _may_need_grad(A))[0]


# linalg_matrix_rank's out= overloads, with their functional forms
MATRIX_RANK_OUT = {"out": "default", "out_tol_tensor": "tol_tensor",
                   "atol_rtol_tensor_out": "atol_rtol_tensor",
                   "atol_rtol_float_out": "atol_rtol_float"}


def matrix_rank_out(overload: str):
    """The kernel of `linalg_matrix_rank.<overload>` (Note [matrix_rank's out=])."""
    packet = torch.ops.aten.linalg_matrix_rank
    own, functional = getattr(packet, overload), getattr(packet, MATRIX_RANK_OUT[overload])

    def kernel(A, *args, out, **kwargs):
        if type(A) is torch.Tensor and type(out) is torch.Tensor \
                and not torch._C._len_torch_dispatch_stack():
            return own.decompose(A, *args, out=out, **kwargs)  # (PyTorch's is right here)
        return torch.sum(functional(A, *args, **kwargs).unsqueeze(-1), -1, out=out)
    return kernel
