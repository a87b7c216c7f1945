"""nn.SyncBatchNorm on neuron: the five batch-norm ops it calls, composed of ATen ops.

Note [SyncBatchNorm ops]: SyncBatchNorm's autograd function (torch/nn/modules/_functions.py)
calls `batch_norm_stats`, `batch_norm_gather_stats_with_counts`, `batch_norm_elemt`,
`batch_norm_backward_reduce` and `batch_norm_backward_elemt`, which have CUDA kernels only
(no CPU kernel for the engine to run, no decomposition). Each is composed here from ATen ops
on the neuron tensors, as CUDA's kernels compute them (aten/src/ATen/native/cuda/
Normalization.cuh): per channel (dim 1), statistics in float32 for half inputs, the biased
variance for normalizing and the unbiased one for the running variance, and the ranks'
statistics combined with their element counts (Chan's parallel formula, here in closed
form: the combined sum of squares is each rank's plus its count times its mean's squared
distance from the global mean). Every op inside is a device op as any other: queued and
fused in adaptive mode, never a CPU fallback.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def _dims(x):
    return [0] + list(range(2, x.dim()))


def _per_channel(v, x):
    """A (C,) vector shaped to broadcast against x (N, C, *)."""
    return v.reshape([1, -1] + [1] * (x.dim() - 2))


def _acc(x):
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def batch_norm_stats(input, eps):
    x = _acc(input)
    var, mean = torch.var_mean(x, _dims(x), correction=0)
    return mean, (var + eps).rsqrt()


def batch_norm_gather_stats_with_counts(input, mean, invstd, running_mean, running_var,
                                        momentum, eps, counts):
    counts = counts.to(mean.dtype).reshape(-1, 1)
    n = counts.sum()
    avg = (counts * mean).sum(0) / n
    # each rank's sum of squared deviations from its own mean, then from the global one
    m2 = (counts * (invstd.reciprocal().square() - eps)).sum(0) \
        + (counts * (mean - avg).square()).sum(0)
    var = m2 / n
    with torch.no_grad():
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(avg.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = m2 / (n - 1)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype),
                                                alpha=momentum)
    return avg, (var + eps).rsqrt()


def batch_norm_elemt(input, weight, bias, mean, invstd, eps):
    x = _acc(input)
    out = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
    if weight is not None:
        out = out * _per_channel(weight, x)
    if bias is not None:
        out = out + _per_channel(bias, x)
    return out.to(input.dtype)


def batch_norm_backward_reduce(grad_out, input, mean, invstd, weight, input_g, weight_g,
                               bias_g):
    dy, x = _acc(grad_out), _acc(input)
    dims = _dims(x)
    sum_dy = dy.sum(dims)
    sum_dy_xmu = (dy * (x - _per_channel(mean, x))).sum(dims)
    dtype = weight.dtype if weight is not None else mean.dtype
    grad_weight = (sum_dy_xmu * invstd).to(dtype) if weight_g else None
    grad_bias = sum_dy.to(dtype) if bias_g else None
    if not input_g:
        sum_dy = sum_dy_xmu = None
    return sum_dy, sum_dy_xmu, grad_weight, grad_bias


def batch_norm_backward_elemt(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu,
                              count):
    dy, x = _acc(grad_out), _acc(input)
    n = count.to(torch.float32).sum()
    mean_dy = _per_channel(sum_dy / n, x)
    mean_dy_xmu = _per_channel(sum_dy_xmu / n, x)
    k = _per_channel(invstd, x)
    scale = k if weight is None else k * _per_channel(weight.to(k.dtype), x)
    grad = (dy - mean_dy - (x - _per_channel(mean, x)) * k.square() * mean_dy_xmu) * scale
    return grad.to(input.dtype)


KERNELS = {
    aten.batch_norm_stats.default: batch_norm_stats,
    aten.batch_norm_gather_stats_with_counts.default: batch_norm_gather_stats_with_counts,
    aten.batch_norm_elemt.default: batch_norm_elemt,
    aten.batch_norm_backward_reduce.default: batch_norm_backward_reduce,
    aten.batch_norm_backward_elemt.default: batch_norm_backward_elemt,
}
