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

import logging
from typing import Optional

from torch import nn

from smshim.modelparallel.torch.tensor_parallel.nn.base import tp_rank_size
from smshim.modelparallel.torch.tensor_parallel.nn.hf_common import (
    ShardedConv1D,
    gather_batch_forward,
    gather_recorded_attention,
    is_hf_class,
    mark_replicated,
)

logger = logging.getLogger(__name__)

__all__ = ["is_gpt2_block", "distribute_block", "ShardedConv1D"]


def is_gpt2_block(module: nn.Module) -> bool:
    return is_hf_class(module, "GPT2Block")


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
    gather_batch_forward(block)  # first: it may refuse the block
    attn.c_attn = ShardedConv1D(attn.c_attn, 1, chunks=3)
    attn.c_proj = ShardedConv1D(attn.c_proj, 0)
    attn.num_heads //= size
    attn.split_size //= size
    mlp.c_fc = ShardedConv1D(mlp.c_fc, 1)
    mlp.c_proj = ShardedConv1D(mlp.c_proj, 0)
    gather_recorded_attention(attn)
    mark_replicated(block.ln_1, block.ln_2)
    return block
