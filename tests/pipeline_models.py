"""Models and training loops shared by the pipeline tests (importable by spawned ranks)."""

import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.seconds)
        return g, None


def slow_backward(x: torch.Tensor, seconds: float) -> torch.Tensor:
    """Identity whose backward takes `seconds` off the CPU, as a device's kernel would."""
    return _SlowBackward.apply(x, seconds)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.lin = nn.Linear(d, d)

    def forward(self, x, scale=1.0):
        return x + scale * torch.tanh(self.lin(self.norm(x)))


class Net(nn.Module):
    """Not a Sequential: skip connection, functional ops, a ModuleList loop, a module called
    twice, a keyword argument, data-dependent control flow and a dict output."""

    def __init__(self, d: int = 16, n_blocks: int = 4, n_in: int = 8, n_out: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(n_in, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(n_blocks)])
        self.shared = nn.Linear(d, d)
        self.head = nn.Linear(d, n_out)

    def forward(self, x, scale=1.0):
        h = F.gelu(self.inp(x))
        skip = h
        for i, block in enumerate(self.blocks):
            h = block(h, scale=scale)
            if i == 1:
                h = self.shared(h)  # first visit of `shared`
        if h.abs().mean() > 1e6:  # data-dependent branch (never taken)
            h = h * 0
        h = self.shared(h) + skip  # second visit
        return {"logits": self.head(h), "hidden": h}


class TiedLM(nn.Module):
    """An embedding reused as the output projection (tied weights)."""

    def __init__(self, vocab: int = 11, d: int = 12, n_blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(n_blocks)])
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        h = self.embed(tokens)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def batches(kind: str, steps: int, batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if kind == "net":
            out.append((torch.randn(batch, 8, generator=g), torch.randint(0, 3, (batch,), generator=g)))
        else:
            tok = torch.randint(0, 11, (batch, 5), generator=g)
            out.append((tok, torch.roll(tok, -1, dims=1)))
    return out


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return Net() if kind == "net" else TiedLM()


def loss_fn(kind: str, out, y):
    if kind == "net":
        return F.cross_entropy(out["logits"], y)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def make_train_step(kind: str = "net"):
    """The @smp.step training function the pipeline tests share (call after smp.init)."""
    import smdistributed.modelparallel.torch as smp

    @smp.step
    def train_step(model, x, y):
        out = model(x, scale=0.5) if kind == "net" else model(x)
        loss = loss_fn(kind, out, y)
        model.backward(loss)
        return loss

    return train_step


def reference(kind: str, steps: int = 3, batch: int = 8):
    """Single-process training on the same global batches."""
    model = make_model(kind)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for x, y in batches(kind, steps, batch):
        opt.zero_grad()
        out = model(x, scale=0.5) if kind == "net" else model(x)
        loss_fn(kind, out, y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}
