"""Hugging Face BERT and RoBERTa masked LMs as smp's distributed transformer (SPEC §7.6): what a
`BertForMaskedLM` / `RobertaForMaskedLM` created under `smp.tensor_parallelism()` becomes when the
DistributedModel is created (the GPT-2 counterpart and the reasoning: hf_gpt2_lm.py).

`DistributedBertForMaskedLM` is a `DistributedTransformerLMHead` built from the config: word,
position and token-type embeddings (split over the hidden size), the embedding layernorm,
`transformer.seq_layers` (post-layernorm, bidirectional `DistributedTransformerLayer`s: BERT's
attention output and MLP output both add the residual, then normalise), and Hugging Face's MLM
head under its own names (`cls.predictions.*` for BERT, `lm_head.*` for RoBERTa: the translators
pass them through), whose decoder is tied to the word embedding. RoBERTa differs only in its
position ids (counted from padding_idx + 1 over the non-padding tokens) and its head's names and
fixed GELU. The embedding layernorm and the head's transform run outside the distributed modules,
on this rank's rows: plain parameters, averaged over the whole DP group.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from smshim.modelparallel.torch.errors import SMPUnsupportedError
from smshim.modelparallel.torch.tensor_parallel.nn.hf_common import is_hf_class
from smshim.modelparallel.torch.tensor_parallel.nn.hf_gpt2_lm import TiedLMHead, refuse_arguments
from smshim.modelparallel.torch.tensor_parallel.nn.layers import DistributedEmbedding
from smshim.modelparallel.torch.tensor_parallel.nn.transformer import DistributedTransformerLMHead

logger = logging.getLogger(__name__)

__all__ = ["DistributedBertForMaskedLM", "is_bert_mlm", "is_roberta_mlm", "bert_config_problem",
           "replace_model"]

_ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_new",
                "gelu_pytorch_tanh": "gelu_new"}


def is_bert_mlm(module: nn.Module) -> bool:
    return is_hf_class(module, "BertForMaskedLM")


def is_roberta_mlm(module: nn.Module) -> bool:
    return is_hf_class(module, "RobertaForMaskedLM")


def bert_config_problem(config: Any) -> Optional[str]:
    """Why smp's transformer cannot compute exactly what this BERT/RoBERTa config does."""
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        return "it is a decoder (causal or cross attention)"
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        return f"its position embeddings are {config.position_embedding_type!r}"
    if config.hidden_act not in _ACTIVATIONS:
        return f"its activation {config.hidden_act!r} has no smp counterpart"
    if config.hidden_size % config.num_attention_heads:
        return "its hidden size does not divide by its number of heads"
    return None


class _Transform(nn.Module):
    """The MLM head's dense + activation + layernorm, under Hugging Face's attribute names."""

    def __init__(self, hidden: int, eps: float, act: str, norm_name: str) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.act, self.norm_name = act, norm_name
        setattr(self, norm_name, nn.LayerNorm(hidden, eps=eps))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.dense(h)
        h = F.gelu(h, approximate="tanh") if self.act == "gelu_new" else (
            F.relu(h) if self.act == "relu" else F.gelu(h))
        return getattr(self, self.norm_name)(h)


class _Predictions(nn.Module):
    """BERT's `cls.predictions`: transform, then the decoder tied to the word embedding, plus a
    bias (`bias` and `decoder.bias` are one parameter, as in Hugging Face)."""

    def __init__(self, transform: _Transform, decoder: TiedLMHead) -> None:
        super().__init__()
        self.transform, self.decoder = transform, decoder
        self.bias = decoder.bias

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(h))


class _RobertaHead(nn.Module):
    """RoBERTa's `lm_head`: dense, GELU, `layer_norm`, decoder (tied) + bias."""

    def __init__(self, hidden: int, eps: float, decoder: TiedLMHead) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.layer_norm = nn.LayerNorm(hidden, eps=eps)
        self.decoder = decoder
        self.bias = decoder.bias

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.layer_norm(F.gelu(self.dense(h))))


class DistributedBertForMaskedLM(DistributedTransformerLMHead):
    """BertForMaskedLM / RobertaForMaskedLM as smp's distributed transformer."""

    def __init__(self, config: Any, roberta: bool = False) -> None:
        problem = bert_config_problem(config)
        if problem is not None:
            raise SMPUnsupportedError(f"BERT config cannot run as smp's transformer: {problem}")
        hidden, heads = config.hidden_size, config.num_attention_heads
        super().__init__(
            num_layers=config.num_hidden_layers, num_attention_heads=heads,
            attention_head_size=hidden // heads, hidden_size=hidden,
            intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
            num_positions=config.max_position_embeddings,
            attention_dropout_prob=config.attention_probs_dropout_prob,
            hidden_dropout_prob=config.hidden_dropout_prob,
            activation=_ACTIVATIONS[config.hidden_act], layernorm_epsilon=config.layer_norm_eps,
            num_token_types=config.type_vocab_size, causal_mask_size=None,
            initializer_range=config.initializer_range, use_normal_initialization=True,
            pre_layernorm=False, post_layernorm=True)
        self.config, self.roberta = config, roberta
        pad = config.pad_token_id
        # Hugging Face's embeddings skip the padding row's gradient (RoBERTa's positions too).
        self.word_embedding = DistributedEmbedding(config.vocab_size, hidden, padding_idx=pad)
        if roberta:
            self.position_embedding = DistributedEmbedding(config.max_position_embeddings,
                                                           hidden, padding_idx=pad)
        self.embedding_layernorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        if not getattr(config, "tie_word_embeddings", True):
            raise SMPUnsupportedError("BERT/RoBERTa with tie_word_embeddings=False is not "
                                      "replaced by smshim")
        decoder = TiedLMHead(self.word_embedding.weight,
                             bias=nn.Parameter(torch.zeros(config.vocab_size)))
        if roberta:
            self.lm_head = _RobertaHead(hidden, config.layer_norm_eps, decoder)
        else:
            self.cls = nn.Module()
            self.cls.predictions = _Predictions(
                _Transform(hidden, config.layer_norm_eps, _ACTIVATIONS[config.hidden_act],
                           "LayerNorm"), decoder)

    def _position_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        n, s = input_ids.shape
        if not self.roberta:
            return torch.arange(s, device=input_ids.device).unsqueeze(0).expand(n, s)
        pad = self.config.pad_token_id
        real = input_ids.ne(pad).int()
        return (torch.cumsum(real, dim=1).type_as(real) * real).long() + pad

    def forward(self, input_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                token_type_ids: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, head_mask: Any = None,
                inputs_embeds: Optional[torch.Tensor] = None,
                encoder_hidden_states: Any = None, encoder_attention_mask: Any = None,
                labels: Optional[torch.Tensor] = None,
                output_attentions: Optional[bool] = None,
                output_hidden_states: Optional[bool] = None,
                return_dict: Optional[bool] = None, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import MaskedLMOutput

        refuse_arguments(type(self).__name__, head_mask=head_mask, inputs_embeds=inputs_embeds,
                         encoder_hidden_states=encoder_hidden_states,
                         output_attentions=output_attentions or None,
                         output_hidden_states=output_hidden_states or None)
        if input_ids is None:
            raise ValueError(f"{type(self).__name__}.forward: pass input_ids")
        n, s = input_ids.shape
        if position_ids is None:
            position_ids = self._position_ids(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        h = (self.word_embedding(input_ids) + self.token_type_embedding(token_type_ids)
             + self.position_embedding(position_ids))
        h = self.dropout(self.embedding_layernorm(h))
        if attention_mask is None:
            mask = torch.zeros(n, 1, 1, s, dtype=h.dtype, device=h.device)
        else:
            keep = attention_mask.reshape(n, 1, 1, s).to(h.dtype)
            mask = (1.0 - keep) * torch.finfo(h.dtype).min
        h = self.transformer.seq_layers((h, mask))[0]
        head = self.lm_head if self.roberta else self.cls.predictions
        logits = head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                   labels.reshape(-1).to(logits.device), ignore_index=-100)
        if return_dict is False:
            return (loss, logits) if loss is not None else (logits,)
        return MaskedLMOutput(loss=loss, logits=logits)


def replace_model(hf_model: nn.Module) -> Optional[nn.Module]:
    """The DistributedBertForMaskedLM computing what `hf_model` (BertForMaskedLM or
    RobertaForMaskedLM) computes, with its weights, dtype and mode; None (logged) when the config
    cannot be mapped exactly. ValueError when sizes do not divide by tensor_parallel_degree."""
    from smshim.modelparallel.torch.tensor_parallel.nn.hf_layouts import hf_to_smp

    roberta = is_roberta_mlm(hf_model)
    problem = bert_config_problem(hf_model.config)
    if problem is None and not getattr(hf_model.config, "tie_word_embeddings", True):
        problem = "its decoder is not tied to the word embedding"
    if problem is not None:
        logger.info("%s kept as Hugging Face's implementation: %s", type(hf_model).__name__,
                    problem)
        return None
    new = DistributedBertForMaskedLM(hf_model.config, roberta=roberta)
    family = "roberta" if roberta else "bert"
    new.load_state_dict(hf_to_smp(family, hf_model.state_dict()), strict=True)
    dtypes = {p.dtype for p in hf_model.parameters()}
    if len(dtypes) == 1:
        new.to(dtype=dtypes.pop())
    return new.train(hf_model.training)
