"""Small models shared by the demo, the benchmarks and the tests."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d=32, hidden=64, classes=10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, hidden),
                                 nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


class CNN(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16 * 4 * 4, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(x.flatten(1))


class Encoder(nn.Module):
    def __init__(self, d=32, heads=4, classes=10, dropout=0.0):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=64, dropout=dropout,
                                                batch_first=True)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.layer(x).mean(1))


class GPT(nn.Module):
    """A small GPT-style decoder: embeddings, pre-LN blocks with causal attention, LM head.
    `kernels`: attention through the kernel library's flash_attention (no dropout)."""

    def __init__(self, vocab=64, d=32, heads=4, layers=2, seq=16, dropout=0.0, kernels=False):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout, kernels) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1))

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for b in self.blocks:
            x = b(x, self.mask[:t, :t])
        return self.head(self.ln(x))


class Block(nn.Module):
    def __init__(self, d, heads, dropout, kernels=False):
        super().__init__()
        self.heads = heads
        if kernels and dropout:
            raise ValueError("GPT(kernels=True): flash_attention takes no dropout")
        self.kernels = kernels
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.kernels:  # the same causal mask (the model's is -inf above the diagonal)
            from adaptive_eager.integration.kernels import flash_attention
            y = flash_attention(q, k, v, causal=True, scale=(d // self.heads) ** -0.5)
        else:
            att = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5 + mask
            y = self.drop(att.softmax(-1)) @ v
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


def batches(kind, n, seed=0, seq=16):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        if kind == "mlp":
            out.append((torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)))
        elif kind == "cnn":
            out.append((torch.randn(4, 3, 16, 16, generator=g),
                        torch.randint(0, 10, (4,), generator=g)))
        elif kind == "encoder":
            out.append((torch.randn(4, 8, 32, generator=g),
                        torch.randint(0, 10, (4,), generator=g)))
        elif kind == "gpt":
            x = torch.randint(0, 64, (4, seq), generator=g)
            out.append((x, torch.roll(x, -1, 1)))
    return out


MODELS = {"mlp": MLP, "cnn": CNN, "encoder": Encoder, "gpt": GPT}


def train(kind, device, steps=3, seed=0, foreach=None, dropout=None, compile=False, **kw):
    """Train a fresh model for a few steps; returns the losses (floats) and the model.
    `compile`: the model runs through torch.compile(backend="neuron")."""
    torch.manual_seed(seed)
    extra = {} if dropout is None else {"dropout": dropout}
    model = MODELS[kind](**extra, **kw).to(device)
    torch.manual_seed(seed + 1)  # CPU and neuron generators start random ops level
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
    losses = []
    forward = torch.compile(model, backend="neuron") if compile else model
    for x, y in batches(kind, steps, seed):
        x, y = x.to(device), y.to(device)
        out = forward(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model
