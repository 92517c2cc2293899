"""Hugging Face GPT-2 as smp's distributed transformer (SPEC §7.6): what a `GPT2LMHeadModel`
created under `smp.tensor_parallelism()` / `smp.model_creation(tensor_parallelism=True)` becomes
when the DistributedModel is created.

`DistributedGPT2LMHead` is a `DistributedTransformerLMHead` built from the GPT-2 config: word and
position embeddings (split over the hidden size), `transformer.seq_layers` (an nn.Sequential of
pre-layernorm, causal `DistributedTransformerLayer`s, each with `.attention` and `.output`), a final
layernorm and the LM head tied to the word embedding. It computes exactly what the GPT-2 model
computes (GPT-2 block = pre-layernorm attention + pre-layernorm MLP, both residual; "gelu_new" is
the tanh GELU), takes Hugging Face's keyword arguments and returns Hugging Face's output type, and
starts from the Hugging Face model's own weights (translated, hf_layouts.py), so replacing the model
does not change what it computes. Its state dict is smp's layout (the translators' target).

Batch gathering (prescaled_batch false) happens per distributed child (embeddings, each layer,
the head), not around the whole forward: with pipeline parallelism the layers may run on another
rank, where an enclosing gather would not be visible.

`gpt2_config_problem` says why a config cannot be mapped exactly (cross attention, unscaled or
layer-scaled attention, an activation without a counterpart); such a model is not replaced (its
blocks may still be split in place, hf_gpt2.py).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from smshim.modelparallel.torch.tensor_parallel import collectives as tp_comm
from smshim.modelparallel.torch.errors import SMPUnsupportedError
from smshim.modelparallel.torch.tensor_parallel.nn.base import DistributedModule
from smshim.modelparallel.torch.tensor_parallel.nn.hf_common import is_hf_class
from smshim.modelparallel.torch.tensor_parallel.nn.transformer import DistributedTransformerLMHead

logger = logging.getLogger(__name__)

__all__ = ["DistributedGPT2LMHead", "is_gpt2_lm", "gpt2_config_problem", "TiedLMHead",
           "refuse_arguments", "replace_model", "causal_lm_loss", "build_replacement"]

# Hugging Face activation names -> smp.nn's ("gelu_new" and "gelu_pytorch_tanh" are both the
# tanh approximation).
_ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu",
                "relu": "relu"}


def is_gpt2_lm(module: nn.Module) -> bool:
    return is_hf_class(module, "GPT2LMHeadModel")


def gpt2_config_problem(config: Any) -> Optional[str]:
    """Why smp's transformer cannot compute exactly what this GPT-2 config does (None if it can)."""
    if getattr(config, "add_cross_attention", False):
        return "it has cross attention"
    if not getattr(config, "scale_attn_weights", True):
        return "its attention scores are not scaled (scale_attn_weights=False)"
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        return "its attention scores are scaled by the layer index"
    if config.activation_function not in _ACTIVATIONS:
        return f"its activation {config.activation_function!r} has no smp counterpart"
    return None


class TiedLMHead(DistributedModule):
    """logits = hidden @ weight.T (+ bias) with `weight` the word embedding's (split over the
    hidden size: each rank multiplies its hidden columns by its columns of the table; partial
    logits summed). The bias is a plain parameter added to this rank's rows after the region."""

    def __init__(self, weight: nn.Parameter, bias: Optional[nn.Parameter] = None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self._forward_region(self._local, hidden)
        return out if self.bias is None else out + self.bias

    def _local(self, hidden: torch.Tensor) -> torch.Tensor:
        local = tp_comm.scatter_to_tp(hidden, -1)
        return tp_comm.reduce_from_tp(torch.matmul(local, self.weight.t()))


class DistributedGPT2LMHead(DistributedTransformerLMHead):
    """GPT2LMHeadModel as smp's distributed transformer (see the module docstring)."""

    def __init__(self, config: Any) -> None:
        problem = gpt2_config_problem(config)
        if problem is not None:
            raise SMPUnsupportedError(f"GPT-2 config cannot run as smp's transformer: {problem}")
        hidden, heads = config.n_embd, config.n_head
        super().__init__(
            num_layers=config.n_layer, num_attention_heads=heads,
            attention_head_size=hidden // heads, hidden_size=hidden,
            intermediate_size=config.n_inner or 4 * hidden, vocab_size=config.vocab_size,
            num_positions=config.n_positions, attention_dropout_prob=config.attn_pdrop,
            hidden_dropout_prob=config.resid_pdrop,
            activation=_ACTIVATIONS[config.activation_function],
            layernorm_epsilon=config.layer_norm_epsilon, causal_mask_size=config.n_positions,
            initializer_range=config.initializer_range, use_normal_initialization=True,
            pre_layernorm=True, post_layernorm=False)
        self.config = config
        self.dropout = nn.Dropout(config.embd_pdrop)
        # Not a tensor-parallel parameter: it runs outside the distributed modules, on this
        # rank's rows only, so its gradient is averaged over the whole DP group like any plain
        # module's (a TP-replicated mark would skip the TP ranks' share of the batch).
        self.final_layernorm = nn.LayerNorm(hidden, eps=config.layer_norm_epsilon)
        if getattr(config, "tie_word_embeddings", True):
            self.lm_head = TiedLMHead(self.word_embedding.weight)
        else:
            self.lm_head = TiedLMHead(self._sharded(
                torch.empty(config.vocab_size, hidden).normal_(0.0, config.initializer_range), 1))

    def forward(self, input_ids: Optional[torch.Tensor] = None, past_key_values: Any = None,
                attention_mask: Optional[torch.Tensor] = None,
                token_type_ids: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, head_mask: Any = None,
                inputs_embeds: Optional[torch.Tensor] = None,
                encoder_hidden_states: Any = None, encoder_attention_mask: Any = None,
                labels: Optional[torch.Tensor] = None, use_cache: Optional[bool] = None,
                output_attentions: Optional[bool] = None,
                output_hidden_states: Optional[bool] = None,
                return_dict: Optional[bool] = None, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

        refuse_arguments(type(self).__name__, past_key_values=past_key_values,
                         head_mask=head_mask,
                         inputs_embeds=inputs_embeds,
                         encoder_hidden_states=encoder_hidden_states,
                         output_attentions=output_attentions or None,
                         output_hidden_states=output_hidden_states or None)
        if input_ids is None:
            raise ValueError("DistributedGPT2LMHead.forward: pass input_ids")
        n, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(n, s)
        h = self._embed(input_ids, position_ids)
        if token_type_ids is not None:  # GPT-2 embeds token types with the word embedding
            h = h + self.word_embedding(token_type_ids)
        h = self.dropout(h)
        # Additive mask [N, 1, 1, S] (one row per example, so it is gathered with the batch).
        if attention_mask is None:
            mask = torch.zeros(n, 1, 1, s, dtype=h.dtype, device=h.device)
        else:
            keep = attention_mask.reshape(n, 1, 1, s).to(h.dtype)
            mask = (1.0 - keep) * torch.finfo(h.dtype).min
        h = self.transformer.seq_layers(self._layer_inputs(h, mask, position_ids))[0]
        logits = self.lm_head(self.final_layernorm(h))
        loss = None
        if labels is not None:
            loss = causal_lm_loss(logits, labels, kwargs.get("num_items_in_batch"))
        if return_dict is False:
            return (loss, logits) if loss is not None else (logits,)
        return CausalLMOutputWithCrossAttentions(loss=loss, logits=logits)


    def _embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.word_embedding(input_ids) + self.position_embedding(position_ids)

    def _layer_inputs(self, h: torch.Tensor, mask: torch.Tensor,
                      position_ids: torch.Tensor) -> "tuple[torch.Tensor, ...]":
        return (h, mask)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor,
                   num_items_in_batch: Any = None) -> torch.Tensor:
    """Hugging Face's causal-LM loss: position t predicts label t + 1, -100 ignored, in fp32."""
    shift_logits = logits[..., :-1, :].float().reshape(-1, logits.shape[-1])
    shift_labels = labels[..., 1:].reshape(-1).to(logits.device)
    if num_items_in_batch is None:
        return F.cross_entropy(shift_logits, shift_labels, ignore_index=-100)
    total = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum")
    return total / num_items_in_batch


def refuse_arguments(cls: str, **given: Any) -> None:
    """Hugging Face forward arguments smp's transformer does not implement: a clear error."""
    used = [k for k, v in given.items() if v is not None]
    if used:
        raise SMPUnsupportedError(
            f"{cls} (smp's transformer made of a Hugging Face model created under "
            f"smp.tensor_parallelism) does not take {used} in smshim; create the model outside "
            "the tensor-parallel context to keep Hugging Face's implementation, or leave these "
            "arguments out")


def replace_model(hf_model: nn.Module) -> Optional[nn.Module]:
    """The DistributedGPT2LMHead computing what `hf_model` (a GPT2LMHeadModel) computes, with its
    weights, dtype and train/eval mode; None (logged) when the config cannot be mapped exactly.
    Raises ValueError when the sizes do not divide by tensor_parallel_degree."""
    return build_replacement(hf_model, DistributedGPT2LMHead, "gpt2",
                             gpt2_config_problem(hf_model.config))


def build_replacement(hf_model: nn.Module, cls: type, family: str,
                      problem: Optional[str]) -> Optional[nn.Module]:
    """`cls(hf_model.config)` holding `hf_model`'s weights (translated to smp's layout), in its
    dtype and train/eval mode; None (logged) when `problem` says the mapping is not exact."""
    from smshim.modelparallel.torch.tensor_parallel.nn.hf_layouts import hf_to_smp

    if problem is not None:
        logger.info("%s kept as Hugging Face's implementation: %s", type(hf_model).__name__,
                    problem)
        return None
    new = cls(hf_model.config)
    new.load_state_dict(hf_to_smp(family, hf_model.state_dict()), strict=True)
    dtypes = {p.dtype for p in hf_model.parameters()}
    if len(dtypes) == 1:
        new.to(dtype=dtypes.pop())
    return new.train(hf_model.training)
