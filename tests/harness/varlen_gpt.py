"""Issue 28's variable-length GPT: a 2-layer GPT (d=64) trained on batches of random length
(8..128 tokens), each batch padded to its longest sequence as Hugging Face's
DataCollatorWithPadding does, so every new length is a new shape and compiles again.
`--bucket N` pads each batch further, to a multiple of N (`ae.bucketing_collate`); padding
is at the end, tokens 0 with labels -100 (ignored by the loss; causal attention keeps the
real tokens from seeing it), so the loss is the same.

    python -m adaptive_eager run --modes eager,graph tests/harness/varlen_gpt.py --steps 12
    python tests/harness/varlen_gpt.py --steps 12 --bucket 32
"""
import argparse

import torch
import torch.nn.functional as F

import adaptive_eager as ae
from adaptive_eager.tools.models import GPT

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--bucket", type=int, default=0, help="pad each batch to a multiple of this")
p.add_argument("--seed", type=int, default=0)
args = p.parse_args()


def collate(seqs):
    """Pad to the longest sequence of the batch (as DataCollatorWithPadding)."""
    n = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), n, dtype=torch.long)
    labels = torch.full((len(seqs), n), -100, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s) - 1], labels[i, :len(s) - 1] = s[:-1], s[1:]
    return {"input_ids": ids, "labels": labels}


if args.bucket:
    collate = ae.bucketing_collate(collate, dim=1, multiple=args.bucket,
                                   values={"input_ids": 0, "labels": -100})
torch.manual_seed(args.seed)
model = GPT(vocab=64, d=64, heads=4, layers=2, seq=128).to("neuron")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(args.seed)
for step in range(args.steps):
    n = int(torch.randint(8, 129, (1,), generator=g))  # this batch's length
    batch = collate([torch.randint(0, 64, (n + 1,), generator=g) for _ in range(args.batch)])
    x = batch["input_ids"].to("neuron")  # the batch enters the device
    y = batch["labels"].to("neuron")
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
    loss.backward()
    opt.step()
    opt.zero_grad()
print(f"loss {loss.item():.4f}")
