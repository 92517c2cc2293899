"""Hugging Face GPT-Neo as smp's distributed transformer (SPEC §7.6): what a `GPTNeoForCausalLM`
created under `smp.tensor_parallelism()` becomes when the DistributedModel is created.

GPT-Neo is GPT-2's structure (pre-layernorm blocks, learned positions, final layernorm, tied head;
hf_gpt2_lm.py) with three differences in the attention, set on each layer's
`DistributedAttentionLayer`: its scores are not scaled by 1/sqrt(head size), its q/k/v projections
have no bias, and the layers listed "local" in `config.attention_layers` attend only to the last
`window_size` positions.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

from torch import nn

from smshim.modelparallel.torch.tensor_parallel.nn.hf_common import is_hf_class
from smshim.modelparallel.torch.tensor_parallel.nn.hf_gpt2_lm import DistributedGPT2LMHead, build_replacement, gpt2_config_problem
from smshim.modelparallel.torch.tensor_parallel.nn.transformer import _LinearShard

__all__ = ["DistributedGPTNeoForCausalLM", "is_gptneo_lm", "gptneo_config_problem",
           "replace_model"]


def is_gptneo_lm(module: nn.Module) -> bool:
    return is_hf_class(module, "GPTNeoForCausalLM")


def _as_gpt2(config: Any) -> SimpleNamespace:
    """GPT-Neo's config under GPT-2's names (what DistributedGPT2LMHead reads)."""
    return SimpleNamespace(
        n_embd=config.hidden_size, n_head=config.num_heads, n_layer=config.num_layers,
        n_inner=config.intermediate_size, vocab_size=config.vocab_size,
        n_positions=config.max_position_embeddings, attn_pdrop=float(config.attention_dropout),
        resid_pdrop=float(config.resid_dropout), embd_pdrop=float(config.embed_dropout),
        activation_function=config.activation_function,
        layer_norm_epsilon=config.layer_norm_epsilon, initializer_range=config.initializer_range,
        tie_word_embeddings=getattr(config, "tie_word_embeddings", True))


def gptneo_config_problem(config: Any) -> Optional[str]:
    if len(config.attention_layers) != config.num_layers:
        return "its attention_layers do not list every layer"
    if set(config.attention_layers) - {"global", "local"}:
        return f"its attention layer kinds {sorted(set(config.attention_layers))}"
    return gpt2_config_problem(_as_gpt2(config))


class DistributedGPTNeoForCausalLM(DistributedGPT2LMHead):
    """GPTNeoForCausalLM as smp's distributed transformer (see the module docstring)."""

    def __init__(self, config: Any) -> None:
        super().__init__(_as_gpt2(config))
        self.config = config
        hidden, std = config.hidden_size, config.initializer_range
        for layer, kind in zip(self.transformer.seq_layers, config.attention_layers):
            att = layer.attention
            att.score_scale = 1.0
            if kind == "local":
                att.local_window = config.window_size
            for name in ("query", "key", "value"):
                setattr(att, name, _LinearShard(hidden, hidden, 0, False, True, std))


def replace_model(hf_model: nn.Module) -> Optional[nn.Module]:
    """The DistributedGPTNeoForCausalLM for a GPTNeoForCausalLM (see hf_gpt2_lm.replace_model)."""
    return build_replacement(hf_model, DistributedGPTNeoForCausalLM, "gptneo",
                             gptneo_config_problem(hf_model.config))
