"""Exact cross entropy on logits split over the vocabulary, and the full logits from the slices.

The softmax statistics (row max, sum of exponentials, the target's logit) are all-reduced over the
TP group, so no rank ever holds the full [tokens, vocab] matrix for the loss; gradients are
softmax - one_hot on each rank's own slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, group, ignore_index):  # noqa: D102
        logits = logits.float()
        row_max = logits.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        n_local = logits.shape[-1]
        valid = target != ignore_index
        mine = valid & (target >= vocab_start) & (target < vocab_start + n_local)
        idx = (target - vocab_start).clamp(0, n_local - 1)
        target_logit = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * mine
        dist.all_reduce(target_logit, group=group)
        loss = (sum_exp.log() - target_logit) * valid
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), idx, mine, valid)
        return loss

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        softmax, idx, mine, valid = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, idx.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        g *= (grad * valid).unsqueeze(-1)
        return g, None, None, None, None


def vocab_parallel_token_losses(local_logits: torch.Tensor, target: torch.Tensor, mesh: DeviceMesh,
                                ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross entropy (0 at ignore_index) of logits whose last dim is this rank's
    contiguous slice of the vocabulary; local_logits [N, V/tp], target [N]."""
    start = mesh.get_local_rank() * local_logits.shape[-1]
    return _VocabParallelCE.apply(local_logits, target, start, mesh.get_group(), ignore_index)


def gather_vocab(local_logits: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Full logits from the vocabulary slices (differentiable: the gradient of the full logits
    flows back to each rank's own slice)."""
    return DTensor.from_local(local_logits, mesh, [Shard(local_logits.ndim - 1)],
                              run_check=False).full_tensor()
