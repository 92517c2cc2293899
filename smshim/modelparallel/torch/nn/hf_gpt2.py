"""Tensor parallelism for Hugging Face GPT-2 blocks (`transformers`' GPT2Block), exact.

The block is distributed in place: it keeps its class, its forward code and its state-dict keys;
only its four Conv1D projections are replaced by shards (Conv1D weights are [in, out]):
    attn.c_attn   [H, 3H]  q/k/v blocks, each split by heads (dim 1, 3 chunks)   column parallel
    attn.c_proj   [H, H]   split by input rows (dim 0), bias after the all-reduce  row parallel
    mlp.c_fc      [H, I]   split by output columns (dim 1)                          column parallel
    mlp.c_proj    [I, H]   split by input rows (dim 0), bias after the all-reduce  row parallel
and the attention's `num_heads` / `split_size` become the per-rank values. Hugging Face's own
attention code reshapes with -1 heads, so it then runs this rank's heads unchanged. LayerNorms stay
replicated. Unless prescaled_batch, the block's forward gathers the TP ranks' batches first (every
tensor argument whose first dimension is the batch size) and returns this rank's rows.

Exact only when the heads and the inner size divide by tp_size and the block has no cross
attention; otherwise `distribute_block` returns None and the block stays whole.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import torch
from torch import nn

from .. import tp_comm, tp_shard
from .base import DistributedModule, tp_rank_size

logger = logging.getLogger(__name__)

__all__ = ["is_gpt2_block", "distribute_block"]


def is_gpt2_block(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ == "GPT2Block" and cls.__module__.startswith("transformers.")


class ShardedConv1D(DistributedModule):
    """This rank's shard of a Hugging Face Conv1D (y = x @ W + b, W [in, out]). `dim` 1:
    column parallel (output columns split; the bias too); `dim` 0: row parallel (input rows
    split; partial results summed over the TP ranks, then the replicated bias added)."""

    def __init__(self, conv: nn.Module, dim: int, chunks: int = 1) -> None:
        super().__init__()
        self.dim = dim
        self.weight = self._sharded(conv.weight.data, dim, chunks)
        self.bias = self._sharded(conv.bias.data, 0 if dim == 1 else None, chunks)
        self.nf = self.weight.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape[:-1] + (self.nf,)
        x2 = x.reshape(-1, x.shape[-1])
        if self.dim == 1:
            return torch.addmm(self.bias, tp_comm.copy_to_tp(x2), self.weight).view(shape)
        return (tp_comm.reduce_from_tp(torch.mm(x2, self.weight)) + self.bias).view(shape)


def distribute_block(block: nn.Module) -> Optional[nn.Module]:
    """Distribute a GPT2Block in place (see the module docstring); None if not exact."""
    _, size = tp_rank_size()
    attn, mlp = block.attn, block.mlp
    inner = mlp.c_fc.weight.shape[1]
    if hasattr(block, "crossattention") or getattr(attn, "is_cross_attention", False):
        logger.info("GPT2Block with cross attention is left undistributed")
        return None
    if attn.num_heads % size or inner % size:
        logger.info("GPT2Block left undistributed: %d heads / inner size %d do not divide by "
                    "tensor_parallel_degree %d", attn.num_heads, inner, size)
        return None
    attn.c_attn = ShardedConv1D(attn.c_attn, 1, chunks=3)
    attn.c_proj = ShardedConv1D(attn.c_proj, 0)
    attn.num_heads //= size
    attn.split_size //= size
    mlp.c_fc = ShardedConv1D(mlp.c_fc, 1)
    mlp.c_proj = ShardedConv1D(mlp.c_proj, 0)
    for name in ("ln_1", "ln_2"):
        for p in getattr(block, name).parameters():
            tp_shard.mark(p, None)  # replicated, but computed on the gathered batch
    forward = block.forward
    block.forward = functools.partial(_gathered_forward, forward)
    return block


def _gathered_forward(forward: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
    with tp_comm.region() as outer:
        if not (outer and tp_comm.gathers_batch()):
            return forward(hidden_states, *args, **kwargs)
        n = hidden_states.shape[0]

        def gather(v: Any) -> Any:
            # Per-example tensors (first dimension = the local batch) are gathered; anything
            # else (broadcast masks, caches, flags) is the same on every rank.
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n:
                return tp_comm.batch_in(v)
            return v

        out = forward(gather(hidden_states), *(gather(a) for a in args),
                      **{k: gather(v) for k, v in kwargs.items()})
        big = n * tp_comm.tp_world()[1]

        def scatter(v: Any) -> Any:
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == big:
                return tp_comm.batch_out(v)
            return v

        if isinstance(out, tuple):
            return tuple(scatter(v) for v in out)
        return scatter(out)
