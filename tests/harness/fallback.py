"""A CPU fallback for tests of fallback behaviour: an op the device deliberately leaves to the
CPU (fusion/ops.py: Inductor decomposes it wrongly). `torch.linalg.det` served until linear
algebra became device ops (Note [Linear algebra on the device] in fusion/ops.py)."""
import torch
import torch.nn.functional as F

FALLBACK_OP = "aten::multilabel_margin_loss_forward"


def fallback(x):
    """A CPU-fallback op of float tensor `x` (n, c): its multilabel margin loss (0-d)."""
    return F.multilabel_margin_loss(x, torch.zeros(x.shape, dtype=torch.long, device=x.device))
