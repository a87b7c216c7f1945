"""The fix for shape churn (Note [Compile causes]): pad a batch's varying dimension up to one
of a few sizes, so each size compiles once. `pad_to_bucket` pads one tensor;
`bucketing_collate` wraps a DataLoader's collate function to pad every tensor of each batch.

Hugging Face's collators do the same with `pad_to_multiple_of`
(`DataCollatorWithPadding(tokenizer, pad_to_multiple_of=32)`, also in
DataCollatorForLanguageModeling and DataCollatorForSeq2Seq); `bucketing_collate` adds it to
any collate function, and offers the what-if's other bucketings (a list of sizes, or powers
of two). The what-if in `ae.metrics_report()` / `python -m adaptive_eager run` prices each
(adaptive_eager/tools/lines.py, `churn`).
"""
from __future__ import annotations

from collections.abc import Mapping, MutableMapping

import torch
import torch.nn.functional as F


def bucket_size(n: int, multiple: int | None = None, buckets=None) -> int:
    """The size `n` is padded to: the next multiple of `multiple`, or the smallest of
    `buckets` (sizes, or "power of two") that holds it."""
    if (multiple is None) == (buckets is None):
        raise ValueError("give one of multiple= or buckets=")
    if multiple is not None:
        if multiple < 1:
            raise ValueError(f"multiple must be positive, got {multiple}")
        return -(-n // multiple) * multiple
    if buckets == "power of two":
        return 1 << max(0, (n - 1).bit_length())
    fits = [b for b in buckets if b >= n]
    if not fits:
        raise ValueError(f"size {n} is larger than every bucket {sorted(buckets)}")
    return min(fits)


def pad_to_bucket(tensor: torch.Tensor, dim: int = -1, *, multiple: int | None = None,
                  buckets=None, value=0) -> torch.Tensor:
    """`tensor` padded at the end of `dim` with `value` up to `bucket_size` (itself if it is
    already that size)."""
    dim = dim % tensor.dim() if tensor.dim() else 0
    n = tensor.shape[dim]
    target = bucket_size(n, multiple, buckets)
    if target == n:
        return tensor
    pad = [0, 0] * (tensor.dim() - 1 - dim) + [0, target - n]  # F.pad: last dim first
    return F.pad(tensor, pad, value=value)


def bucketing_collate(collate_fn=None, *, dim: int = 1, multiple: int | None = None,
                      buckets=None, values=0):
    """`collate_fn` (default: torch's default_collate) whose batches have every tensor with a
    dimension `dim` padded by `pad_to_bucket`. `values`: the padding value, or a dict from a
    batch key to its value (e.g. {"input_ids": pad_id, "labels": -100, "attention_mask": 0};
    keys not named pad with 0)."""
    bucket_size(1, multiple, buckets)  # the bucketing is checked now, not at the first batch
    if collate_fn is None:
        from torch.utils.data import default_collate as collate_fn

    def pad(x, key=None):
        if isinstance(x, torch.Tensor):
            if x.dim() <= (dim if dim >= 0 else -dim - 1):
                return x
            v = values.get(key, 0) if isinstance(values, Mapping) else values
            return pad_to_bucket(x, dim, multiple=multiple, buckets=buckets, value=v)
        if isinstance(x, MutableMapping):  # dict, Hugging Face's BatchEncoding: in place
            for k in list(x.keys()):
                x[k] = pad(x[k], k)
            return x
        if isinstance(x, Mapping):
            return {k: pad(v, k) for k, v in x.items()}
        if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            return type(x)(pad(v, key) for v in x)
        return x

    def collate(batch):
        return pad(collate_fn(batch))

    collate.__wrapped__ = collate_fn
    return collate
