"""Hugging Face GPT-J as smp's distributed transformer (SPEC §7.6): what a `GPTJForCausalLM`
created under `smp.tensor_parallelism()` becomes when the DistributedModel is created.

GPT-J differs from GPT-2 (hf_gpt2_lm.py) in its block and its positions. Its block normalises once
and runs attention and MLP side by side: x + attn(ln_1(x)) + mlp(ln_1(x)), so each
`seq_layers` entry is a `GPTJLayer` (a DistributedTransformerLayer whose `attention` holds ln_1 and
the bias-free q/k/v/out projections and whose `output` holds the MLP; its own forward combines
them, so marking `.attention` / `.output` for activation checkpointing has no effect: mark the
layers). Positions are rotary (GPT-J's interleaved form, on the first `rotary_dim` features of
each head), computed per example from position_ids and handed to the layers as a third tuple entry
[N, S, rotary_dim] (sin | cos), so that they are gathered with the batch. No position embedding;
the LM head is not tied and has a bias.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any, Optional, Tuple

import torch
from torch import nn

from smshim.modelparallel.torch.tensor_parallel import collectives as tp_comm
from smshim.modelparallel.torch.tensor_parallel.nn.hf_common import is_hf_class
from smshim.modelparallel.torch.tensor_parallel.nn.hf_gpt2_lm import _ACTIVATIONS as _GPT2_ACTIVATIONS
from smshim.modelparallel.torch.tensor_parallel.nn.hf_gpt2_lm import DistributedGPT2LMHead, build_replacement, gpt2_config_problem
from smshim.modelparallel.torch.tensor_parallel.nn.transformer import _ACTIVATIONS, DistributedTransformerLayer, _LinearShard

__all__ = ["DistributedGPTJForCausalLM", "GPTJLayer", "is_gptj_lm", "gptj_config_problem",
           "replace_model"]


def is_gptj_lm(module: nn.Module) -> bool:
    return is_hf_class(module, "GPTJForCausalLM")


def _as_gpt2(config: Any) -> SimpleNamespace:
    return SimpleNamespace(
        n_embd=config.n_embd, n_head=config.n_head, n_layer=config.n_layer,
        n_inner=config.n_inner, vocab_size=config.vocab_size, n_positions=config.n_positions,
        attn_pdrop=config.attn_pdrop, resid_pdrop=config.resid_pdrop,
        embd_pdrop=config.embd_pdrop, activation_function=config.activation_function,
        layer_norm_epsilon=config.layer_norm_epsilon, initializer_range=config.initializer_range,
        tie_word_embeddings=False)


def gptj_config_problem(config: Any) -> Optional[str]:
    if getattr(config, "tie_word_embeddings", False):
        return "its LM head is tied to the word embedding"
    head = config.n_embd // config.n_head
    if config.rotary_dim is not None and (config.rotary_dim > head or config.rotary_dim % 2):
        return f"its rotary_dim {config.rotary_dim} does not fit heads of {head} features"
    return gpt2_config_problem(_as_gpt2(config))


def _sinusoids(num_pos: int, dim: int) -> torch.Tensor:
    """[num_pos, dim]: sin then cos of position x frequency (GPT-J's table)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64) / dim))
    angles = torch.arange(num_pos, dtype=torch.int64).float()[:, None] * inv_freq
    return torch.cat((torch.sin(angles), torch.cos(angles)), dim=1)


def _rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _rotary(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """x [N, S, heads, d]; sin/cos [N, S, d/2]."""
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    return x * cos + _rotate_every_two(x) * sin


class GPTJLayer(DistributedTransformerLayer):
    """One GPT-J block (see the module docstring); forward((hidden, mask, sincos))."""

    def setup_gptj(self, rotary_dim: Optional[int], std: float) -> None:
        att, out = self.attention, self.output
        hidden = att.hidden_size
        inner = att.num_heads * att.head_size
        for name in ("query", "key", "value"):
            setattr(att, name, _LinearShard(hidden, inner, 0, False, True, std))
        att.dense = _LinearShard(inner, hidden, 1, False, True, std)
        del out.pre_layernorm_module  # one layernorm (the attention's) feeds both
        out.pre_layernorm = False
        self.rotary_dim = rotary_dim or att.head_size

    def forward(self, inputs: Tuple[torch.Tensor, ...]) -> Tuple[torch.Tensor, ...]:
        inputs = tuple(inputs)
        if len(inputs) != 3:
            raise ValueError(f"GPTJLayer.forward takes (hidden_states, attention_mask, "
                             f"rotary sincos), got {len(inputs)} tensors")
        return (self._forward_region(self._local, *inputs),) + inputs[1:]

    def _local(self, hidden: torch.Tensor, mask: torch.Tensor,
               sincos: torch.Tensor) -> torch.Tensor:
        att, out = self.attention, self.output
        xc = tp_comm.copy_to_tp(att.pre_layernorm_module(hidden))
        n, s = hidden.shape[0], hidden.shape[1]

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, s, att.local_heads, att.head_size)

        q, k, v = heads(att.query(xc)), heads(att.key(xc)), heads(att.value(xc))
        rd = self.rotary_dim
        sin, cos = sincos.to(q.dtype).split(rd // 2, dim=-1)
        q = torch.cat([_rotary(q[..., :rd], sin, cos), q[..., rd:]], dim=-1).transpose(1, 2)
        k = torch.cat([_rotary(k[..., :rd], sin, cos), k[..., rd:]], dim=-1).transpose(1, 2)
        v = v.transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(att.head_size)
        causal = torch.ones(s, s, dtype=torch.bool, device=hidden.device).tril()
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min) + mask
        probs = att.attention_dropout(torch.softmax(scores, dim=-1))
        context = torch.matmul(probs, v).transpose(1, 2).reshape(n, s, -1)
        a = att.hidden_dropout(tp_comm.reduce_from_tp(att.dense(context)))
        m = _ACTIVATIONS[out.activation](out.dense_h_to_4h(xc))
        m = out.dropout(tp_comm.reduce_from_tp(out.dense_4h_to_h(m)) + out.dense_4h_to_h.bias)
        return a + m + hidden


class DistributedGPTJForCausalLM(DistributedGPT2LMHead):
    """GPTJForCausalLM as smp's distributed transformer (see the module docstring)."""

    def __init__(self, config: Any) -> None:
        super().__init__(_as_gpt2(config))
        self.config = config
        del self.position_embedding
        g = _as_gpt2(config)
        layers = []
        for _ in range(config.n_layer):
            layer = GPTJLayer(
                num_attention_heads=g.n_head, attention_head_size=g.n_embd // g.n_head,
                hidden_size=g.n_embd, intermediate_size=g.n_inner or 4 * g.n_embd,
                attention_dropout_prob=g.attn_pdrop, hidden_dropout_prob=g.resid_pdrop,
                activation=_GPT2_ACTIVATIONS[g.activation_function],
                layernorm_epsilon=g.layer_norm_epsilon, initializer_range=g.initializer_range,
                use_normal_initialization=True, causal_mask_size=g.n_positions,
                pre_layernorm=True, post_layernorm=False)
            layer.setup_gptj(config.rotary_dim, config.initializer_range)
            layers.append(layer)
        self.transformer.seq_layers = nn.Sequential(*layers)
        self.lm_head.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.register_buffer("embed_positions",
                             _sinusoids(config.n_positions, config.rotary_dim or
                                        config.n_embd // config.n_head), persistent=False)

    def _embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.word_embedding(input_ids)

    def _layer_inputs(self, h: torch.Tensor, mask: torch.Tensor,
                      position_ids: torch.Tensor) -> "tuple[torch.Tensor, ...]":
        return (h, mask, self.embed_positions[position_ids].to(h.dtype))


def replace_model(hf_model: nn.Module) -> Optional[nn.Module]:
    """The DistributedGPTJForCausalLM for a GPTJForCausalLM (see hf_gpt2_lm.replace_model)."""
    return build_replacement(hf_model, DistributedGPTJForCausalLM, "gptj",
                             gptj_config_problem(hf_model.config))
