"""Tensor parallelism for Hugging Face GPT-NeoX blocks (`transformers`' GPTNeoXLayer), exact.

The block is distributed in place (same class, forward code and state-dict keys; hf_common.py);
its four nn.Linear projections become shards (nn.Linear weights are [out, in]):
    attention.query_key_value [3H, H]  column parallel, split by heads (dim 0)
    attention.dense           [H, H]   row parallel (dim 1), bias after the all-reduce
    mlp.dense_h_to_4h         [I, H]   column parallel (dim 0)
    mlp.dense_4h_to_h         [H, I]   row parallel (dim 1), bias after the all-reduce

Why the fused q/k/v is a plain split (one chunk), unlike GPT-2's c_attn. GPTNeoXAttention views
the projection's output as (..., -1, 3 * head_size) and chunks the last dimension into q, k, v:
its output features are laid out per head as [heads, 3, head_size], so heads h..h+k are one
contiguous block of rows, and rank r's rows r*3H/t .. (r+1)*3H/t are exactly the q, k and v of its
heads. The attention reads the head count from that `-1` (no attribute holds it; `head_size`,
`rotary_ndims` and `scaling` are per head and unchanged), and the rotary embedding is applied per
head with the same cos/sin for every head, so the same forward code runs this rank's heads; every
attention implementation (eager, sdpa, flex) works per head from the tensors' shapes. The shared
config is not touched. `use_parallel_residual` either way: the MLP's input is either the block
input or the post-attention residual, both complete (after the row-parallel all-reduce) on every
rank. LayerNorms stay replicated. Unless prescaled_batch, the forward gathers the TP ranks'
batches (including a per-example (cos, sin) pair) and returns this rank's rows; under sdpa, a TP
rank whose batch has no padding (mask None: causal) while a peer's has passes the causal mask.

Exact only when the heads and the intermediate size divide by tp_size, the block holds nothing
but these projections and its LayerNorms (no parametrised activation such as PReLU, whose
parameter would see only this rank's features), and the activation is one of transformers'
elementwise ACT2FN activations; otherwise `distribute_block` returns None and the block stays
whole (logged).
"""

from __future__ import annotations

import logging
from typing import Optional

from torch import nn

from smshim.modelparallel.torch.tensor_parallel.nn.base import tp_rank_size
from smshim.modelparallel.torch.tensor_parallel.nn.hf_common import (
    ShardedLinear,
    gather_batch_forward,
    gather_recorded_attention,
    is_hf_class,
    mark_replicated,
    not_linear,
    not_splittable,
    sdpa_causal_mask,
)

logger = logging.getLogger(__name__)

__all__ = ["is_gpt_neox_layer", "distribute_block"]

_PARAMS = ("input_layernorm", "post_attention_layernorm", "attention.query_key_value",
           "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")


def is_gpt_neox_layer(module: nn.Module) -> bool:
    return is_hf_class(module, "GPTNeoXLayer")


def _why_not(block: nn.Module, size: int) -> Optional[str]:
    attn, mlp = block.attention, block.mlp
    reason = not_linear(block, _PARAMS[2:])
    if reason:
        return reason
    head_size = attn.head_size
    qkv_out = attn.query_key_value.out_features
    if qkv_out % (3 * head_size) or attn.dense.in_features * 3 != qkv_out:
        return f"query_key_value has {qkv_out} outputs for head_size {head_size}"
    heads = qkv_out // (3 * head_size)
    return not_splittable(block, size, heads, mlp.dense_h_to_4h.out_features, _PARAMS, mlp.act)


def distribute_block(block: nn.Module) -> Optional[nn.Module]:
    """Distribute a GPTNeoXLayer in place (see the module docstring); None if not exact."""
    _, size = tp_rank_size()
    reason = _why_not(block, size)
    if reason is not None:
        logger.info("GPTNeoXLayer left undistributed: %s", reason)
        return None
    # First: it may refuse the block, which must then be unchanged.
    gather_batch_forward(block, {"attention_mask": sdpa_causal_mask(block.attention.config)})
    attn, mlp = block.attention, block.mlp
    attn.query_key_value = ShardedLinear(attn.query_key_value, 0)
    attn.dense = ShardedLinear(attn.dense, 1)
    mlp.dense_h_to_4h = ShardedLinear(mlp.dense_h_to_4h, 0)
    mlp.dense_4h_to_h = ShardedLinear(mlp.dense_4h_to_h, 1)
    gather_recorded_attention(attn)
    mark_replicated(block.input_layernorm, block.post_attention_layernorm)
    return block
