"""A CPU fallback for tests of fallback behaviour: one of ATen's own test ops, which no device
implements. `torch.linalg.det` served until linear algebra became device ops (Note [Linear
algebra on the device] in fusion/ops.py), then `multilabel_margin_loss` until it did too."""
import torch

FALLBACK_OP = "aten::_test_functorch_fallback"


def fallback(x):
    """A CPU-fallback op of tensor `x`: a tensor of its shape."""
    return torch.ops.aten._test_functorch_fallback(x, x)
