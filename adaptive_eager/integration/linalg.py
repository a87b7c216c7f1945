"""Eigen- and singular values on neuron, computed as CPU computes them.

`linalg_svdvals` and `linalg_eigvalsh` ask LAPACK for vectors too when the input may need
gradients, and PyTorch counts every tensor subclass as such (`isTensorSubclassLike`): so on
neuron they computed vectors CPU does not, a different LAPACK call, a few ulps off (and
`matrix_norm("nuc")`, `cond`, `svd(compute_uv=False)` with them). Here the decision is CPU's
(`_may_require_fw_or_bw_grad`): vectors only when the input needs a backward or forward
gradient.
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
