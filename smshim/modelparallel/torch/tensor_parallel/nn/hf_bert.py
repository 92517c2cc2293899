"""Tensor parallelism for Hugging Face BERT blocks (`transformers`' BertLayer), exact.

The block is distributed in place (same class, forward code and state-dict keys; hf_common.py);
its six nn.Linear projections become shards (nn.Linear weights are [out, in]):
    attention.self.query / key / value [A, H]  column parallel, split by heads (dim 0)
    attention.output.dense             [H, A]  row parallel (dim 1), bias after the all-reduce
    intermediate.dense                 [I, H]  column parallel (dim 0)
    output.dense                       [H, I]  row parallel (dim 1), bias after the all-reduce
The q/k/v outputs are laid out [heads, head_size], so a rank's heads are one contiguous block of
rows. BertSelfAttention reads the head count from a `-1` view with the per-head
`attention_head_size` (unchanged, as is `scaling`); its `num_attention_heads` / `all_head_size`
attributes are not read by forward but are set to the per-rank values so that they describe the
module. Every attention implementation (eager, sdpa, flex) works per head from the tensors'
shapes; the shared config is not touched. The residual adds and both LayerNorms (replicated) run
on complete tensors after the row-parallel all-reduces; `chunk_size_feed_forward` only cuts the
sequence, which every TP rank does alike. Unless prescaled_batch, the forward gathers the TP
ranks' batches and returns this rank's rows; a TP rank whose batch has no padding (sdpa's mask
then None) while a peer's has passes the all-attend mask, which means the same in a bidirectional
block.

Exact only when the heads and the intermediate size divide by tp_size, the block has no cross
attention (`add_cross_attention`: its keys/values come from the encoder's states, a second input
the batch gathering and the mapping are not written for), the block holds nothing but these
projections and its LayerNorms, and the activation is one of transformers' elementwise ACT2FN
activations; otherwise `distribute_block` returns None and the block stays whole (logged).
"""

from __future__ import annotations

import logging
from typing import Optional

from torch import nn

from smshim.modelparallel.torch.tensor_parallel.nn.base import tp_rank_size
from smshim.modelparallel.torch.tensor_parallel.nn.hf_common import (
    ShardedLinear,
    all_attend_mask,
    gather_batch_forward,
    gather_recorded_attention,
    is_hf_class,
    mark_replicated,
    not_linear,
    not_splittable,
)

logger = logging.getLogger(__name__)

__all__ = ["is_bert_layer", "distribute_block"]

_COLUMN = ("attention.self.query", "attention.self.key", "attention.self.value",
           "intermediate.dense")
_ROW = ("attention.output.dense", "output.dense")
_PARAMS = _COLUMN + _ROW + ("attention.output.LayerNorm", "output.LayerNorm")


def is_bert_layer(module: nn.Module) -> bool:
    return is_hf_class(module, "BertLayer")


def _why_not(block: nn.Module, size: int) -> Optional[str]:
    if hasattr(block, "crossattention") or getattr(block, "add_cross_attention", False):
        return "it has cross attention"
    if not is_hf_class(block.attention.self, "BertSelfAttention"):
        return f"its attention is a {type(block.attention.self).__name__}"
    reason = not_linear(block, _COLUMN + _ROW)
    if reason:
        return reason
    sa = block.attention.self
    heads, head_size = sa.num_attention_heads, sa.attention_head_size
    for name in ("query", "key", "value"):
        if getattr(sa, name).out_features != heads * head_size:
            return f"{name} has {getattr(sa, name).out_features} outputs for {heads} heads"
    return not_splittable(block, size, heads, block.intermediate.dense.out_features, _PARAMS,
                          block.intermediate.intermediate_act_fn)


def distribute_block(block: nn.Module) -> Optional[nn.Module]:
    """Distribute a BertLayer in place (see the module docstring); None if not exact."""
    _, size = tp_rank_size()
    reason = _why_not(block, size)
    if reason is not None:
        logger.info("BertLayer left undistributed: %s", reason)
        return None
    # First: it may refuse the block, which must then be unchanged.
    gather_batch_forward(block, {"attention_mask": all_attend_mask})
    for names, dim in ((_COLUMN, 0), (_ROW, 1)):
        for name in names:
            parent, _, attr = name.rpartition(".")
            owner = block.get_submodule(parent)
            setattr(owner, attr, ShardedLinear(getattr(owner, attr), dim))
    sa = block.attention.self
    sa.num_attention_heads //= size
    sa.all_head_size //= size
    gather_recorded_attention(sa)
    mark_replicated(block.attention.output.LayerNorm, block.output.LayerNorm)
    return block
