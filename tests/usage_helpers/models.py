"""A small Hugging Face-style model (keyword inputs, dict output with the loss) and its data,
plus single-process reference training, for the usage-pattern tests."""

from typing import Dict, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

N_IN, N_OUT = 8, 4


class Classifier(nn.Module):
    """Not a Sequential: a ModuleList loop with a skip connection; the loss is computed in forward
    when labels are given, as Hugging Face models do."""

    def __init__(self, d: int = 16, n_blocks: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(N_IN, d)
        self.blocks = nn.ModuleList([nn.Linear(d, d) for _ in range(n_blocks)])
        self.head = nn.Linear(d, N_OUT)

    def forward(self, x: torch.Tensor, labels: torch.Tensor = None) -> Dict[str, torch.Tensor]:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        logits = self.head(h)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def make_model(seed: int = 0) -> Classifier:
    torch.manual_seed(seed)
    return Classifier()


def batches(n: int, batch: int, seed: int = 1) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, N_IN, generator=g), torch.randint(0, N_OUT, (batch,), generator=g))
            for _ in range(n)]


def shard(x: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    k = len(x) // dp_size
    return x[dp_rank * k:(dp_rank + 1) * k]


def merge_local(results: List[dict], key: str = "params") -> Dict[str, torch.Tensor]:
    """Full parameters from the ranks of replica 0 (each returns its local parameters)."""
    merged: Dict[str, torch.Tensor] = {}
    for r in results:
        if r.get("dp_rank", 0) == 0:
            merged.update(r[key])
    return merged


def assert_close(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], tol: float = 1e-5) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    for n, p in want.items():
        diff = (got[n] - p).abs().max().item()
        assert diff < tol, f"{n}: max abs diff {diff}"


def reference(data: List[Tuple[torch.Tensor, torch.Tensor]], make_opt, make_sched=None, ga: int = 1,
              seed: int = 0) -> Dict[str, torch.Tensor]:
    """Single-process training on the global batches: `ga` backward passes per optimizer step
    (each loss divided by `ga`), the scheduler stepped after each optimizer step."""
    model = make_model(seed)
    opt = make_opt(model.parameters())
    sched = make_sched(opt) if make_sched else None
    for i, (x, y) in enumerate(data):
        (model(x, labels=y)["loss"] / ga).backward()
        if (i + 1) % ga == 0:
            opt.step()
            if sched is not None:
                sched.step()
            opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}
