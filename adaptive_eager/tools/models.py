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


class RMSNorm(nn.Module):
    """LLaMA's RMSNorm, written out as Transformers' LlamaRMSNorm writes it."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(dtype)


class Llama(nn.Module):
    """A tiny LLaMA-style decoder (no rotary embedding): RMSNorm, causal attention and a SwiGLU
    MLP per block. `sdpa`: attention through F.scaled_dot_product_attention; else written
    out as Transformers' eager attention (matmul, scale, additive mask, float32 softmax,
    matmul)."""

    def __init__(self, vocab=64, d=32, heads=4, layers=2, seq=16, sdpa=False):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(LlamaBlock(d, heads, sdpa) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1))

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx)
        for b in self.blocks:
            x = b(x, self.mask[:t, :t])
        return self.head(self.norm(x))


class LlamaBlock(nn.Module):
    def __init__(self, d, heads, sdpa=False):
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.ln1, self.ln2 = RMSNorm(d), RMSNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate = nn.Linear(d, 2 * d, bias=False)
        self.up = nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x, mask):
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (p(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            w = torch.matmul(q, k.transpose(2, 3)) * (d // self.heads) ** -0.5 + mask
            w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
            y = torch.matmul(w, v)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, d))
        h = self.ln2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


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
        elif kind in ("gpt", "llama"):
            x = torch.randint(0, 64, (4, seq), generator=g)
            out.append((x, torch.roll(x, -1, 1)))
    return out


MODELS = {"mlp": MLP, "cnn": CNN, "encoder": Encoder, "gpt": GPT, "llama": Llama}


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
