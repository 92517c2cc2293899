"""`smp.nn`'s tensor-parallel transformer: DistributedAttentionLayer,
DistributedTransformerOutputLayer, DistributedTransformerLayer, DistributedTransformer and
DistributedTransformerLMHead (SPEC §7 signatures; sizes are global).

Split (Megatron's): the attention heads are split over the TP ranks (query/key/value weights by
rows, the output projection `dense` by columns, followed by one all-reduce), and the MLP's
intermediate features likewise (`dense_h_to_4h` by rows, `dense_4h_to_h` by columns). LayerNorms
and the biases added after an all-reduce are replicated. The attention mask is additive ([N,1,1,S],
0 to attend, a large negative number to mask), as Hugging Face's extended masks.

Dropout: with probabilities > 0 the attention-probability dropout draws each rank's heads from its
own RNG stream, so results are a valid dropout of the unsplit module, not the same draw; the
hidden dropout after the all-reduce needs the TP ranks' RNG states equal (seed them alike).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from smshim.modelparallel.torch.tensor_parallel import collectives as tp_comm
from smshim.modelparallel.torch.tensor_parallel import shard as tp_shard
from smshim.modelparallel.torch.errors import SMPUnsupportedError
from smshim.modelparallel.torch.tensor_parallel.nn.base import DistributedModule, linear_init, tp_rank_size
from smshim.modelparallel.torch.tensor_parallel.nn.layers import DistributedEmbedding

__all__ = ["DistributedAttentionLayer", "DistributedTransformerOutputLayer",
           "DistributedTransformerLayer", "DistributedTransformer", "DistributedTransformerLMHead"]

_ACTIVATIONS = {
    "gelu": F.gelu,
    "relu": F.relu,
    # Hugging Face GPT-2's "gelu_new": the tanh approximation (used by its exact mapping).
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


def _check_layernorms(cls: str, pre: bool, post: bool) -> None:
    if not (pre or post):
        raise ValueError(f"smp.nn.{cls}: at least one of pre_layernorm and post_layernorm must be "
                         "True")


def _layernorm(hidden: int, eps: float) -> nn.LayerNorm:
    ln = nn.LayerNorm(hidden, eps=eps)
    for p in ln.parameters():
        tp_shard.mark(p, None)
    return ln


class _LinearShard(DistributedModule):
    """A weight (and bias) holding this rank's shard of a full linear layer; `dim` 0 splits
    output features (column parallel), 1 input features (row parallel; the bias is replicated
    and added after the all-reduce by the caller)."""

    def __init__(self, in_f: int, out_f: int, dim: int, bias: bool, normal: bool,
                 std: float) -> None:
        super().__init__()
        w, b = linear_init(out_f, in_f, bias, normal, std)
        self.weight = self._sharded(w, dim)
        self.bias = self._sharded(b, 0 if dim == 0 else None) if b is not None else None
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dim == 0:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight)


class DistributedAttentionLayer(DistributedModule):
    def __init__(self, num_attention_heads: int = 32, attention_head_size: int = 32,
                 hidden_size: int = 1024, attention_dropout_prob: float = 0.1,
                 hidden_dropout_prob: float = 0.1, layernorm_epsilon: float = 1e-5,
                 initializer_range: float = 0.02, use_normal_initialization: bool = False,
                 cross_attention: bool = False, causal_mask_size: Optional[int] = None,
                 pre_layernorm: bool = False, post_layernorm: bool = True,
                 **perf_switches: Any) -> None:
        super().__init__()
        _check_layernorms("DistributedAttentionLayer", pre_layernorm, post_layernorm)
        _, size = tp_rank_size()
        if num_attention_heads % size:
            raise ValueError(
                f"smp.nn.DistributedAttentionLayer: num_attention_heads={num_attention_heads} is "
                f"not divisible by tensor_parallel_degree {size}")
        _perf_only("DistributedAttentionLayer", perf_switches)
        self.num_heads, self.head_size, self.hidden_size = (num_attention_heads,
                                                            attention_head_size, hidden_size)
        self.local_heads = num_attention_heads // size
        self.cross_attention, self.causal_mask_size = cross_attention, causal_mask_size
        self.pre_layernorm, self.post_layernorm = pre_layernorm, post_layernorm
        inner = num_attention_heads * attention_head_size
        args = (use_normal_initialization, initializer_range)
        self.query = _LinearShard(hidden_size, inner, 0, True, *args)
        self.key = _LinearShard(hidden_size, inner, 0, True, *args)
        self.value = _LinearShard(hidden_size, inner, 0, True, *args)
        self.dense = _LinearShard(inner, hidden_size, 1, True, *args)
        self.attention_dropout = nn.Dropout(attention_dropout_prob)
        self.hidden_dropout = nn.Dropout(hidden_dropout_prob)
        if pre_layernorm:
            self.pre_layernorm_module = _layernorm(hidden_size, layernorm_epsilon)
        if post_layernorm:
            self.layernorm = _layernorm(hidden_size, layernorm_epsilon)
        # Not constructor arguments (SPEC §7 has none): set by the Hugging Face mappings that
        # need them (GPT-Neo: unscaled scores, local attention within a window of positions).
        self.score_scale: Optional[float] = None  # None: 1 / sqrt(attention_head_size)
        self.local_window: Optional[int] = None

    def forward(self, hidden_states: torch.Tensor, *rest: Optional[torch.Tensor]) -> torch.Tensor:
        """forward(hidden_states, attention_mask) or, with cross_attention,
        forward(hidden_states, cross_states, attention_mask)."""
        return self._forward_region(self._local, hidden_states, *rest)

    def _local(self, hidden: torch.Tensor, *rest: Optional[torch.Tensor]) -> torch.Tensor:
        if self.cross_attention:
            if len(rest) < 1:
                raise ValueError("DistributedAttentionLayer(cross_attention=True).forward needs "
                                 "(hidden_states, cross_states, attention_mask)")
            cross, mask = rest[0], (rest[1] if len(rest) > 1 else None)
        else:
            cross, mask = None, (rest[0] if rest else None)
        x = self.pre_layernorm_module(hidden) if self.pre_layernorm else hidden
        xc = tp_comm.copy_to_tp(x)
        kv = tp_comm.copy_to_tp(cross) if cross is not None else xc
        n, s = x.shape[0], x.shape[1]

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(t.shape[0], t.shape[1], self.local_heads, self.head_size).transpose(1, 2)

        q, k, v = heads(self.query(xc)), heads(self.key(kv)), heads(self.value(kv))
        scores = torch.matmul(q, k.transpose(-1, -2))
        scores = (scores / math.sqrt(self.head_size) if self.score_scale is None
                  else scores * self.score_scale)
        if self.causal_mask_size is not None and cross is None:
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            if self.local_window is not None:  # only the last local_window positions
                causal = causal & ~causal.tril(-self.local_window)
            scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        if mask is not None:
            scores = scores + mask
        probs = self.attention_dropout(torch.softmax(scores, dim=-1))
        context = torch.matmul(probs, v).transpose(1, 2).reshape(n, s, -1)
        out = tp_comm.reduce_from_tp(self.dense(context)) + self.dense.bias
        out = self.hidden_dropout(out) + hidden
        return self.layernorm(out) if self.post_layernorm else out


class DistributedTransformerOutputLayer(DistributedModule):
    def __init__(self, hidden_size: int = 1024, intermediate_size: int = 4096,
                 hidden_dropout_prob: float = 0.1, activation: str = "gelu",
                 layernorm_epsilon: float = 1e-5, initializer_range: float = 0.02,
                 use_normal_initialization: bool = False, pre_layernorm: bool = False,
                 post_layernorm: bool = True, fp32_residual_addition: bool = False,
                 **perf_switches: Any) -> None:
        super().__init__()
        _check_layernorms("DistributedTransformerOutputLayer", pre_layernorm, post_layernorm)
        _, size = tp_rank_size()
        if intermediate_size % size:
            raise ValueError(
                f"smp.nn.DistributedTransformerOutputLayer: intermediate_size={intermediate_size}"
                f" is not divisible by tensor_parallel_degree {size}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"smp.nn.DistributedTransformerOutputLayer: activation={activation!r}"
                             " must be 'gelu' or 'relu'")
        _perf_only("DistributedTransformerOutputLayer", perf_switches)
        self.activation = activation
        self.pre_layernorm, self.post_layernorm = pre_layernorm, post_layernorm
        self.fp32_residual_addition = fp32_residual_addition
        args = (use_normal_initialization, initializer_range)
        self.dense_h_to_4h = _LinearShard(hidden_size, intermediate_size, 0, True, *args)
        self.dense_4h_to_h = _LinearShard(intermediate_size, hidden_size, 1, True, *args)
        self.dropout = nn.Dropout(hidden_dropout_prob)
        if pre_layernorm:
            self.pre_layernorm_module = _layernorm(hidden_size, layernorm_epsilon)
        if post_layernorm:
            self.layernorm = _layernorm(hidden_size, layernorm_epsilon)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._forward_region(self._local, hidden_states)

    def _local(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.pre_layernorm_module(hidden) if self.pre_layernorm else hidden
        h = _ACTIVATIONS[self.activation](self.dense_h_to_4h(tp_comm.copy_to_tp(x)))
        out = tp_comm.reduce_from_tp(self.dense_4h_to_h(h)) + self.dense_4h_to_h.bias
        out = self.dropout(out)
        if self.fp32_residual_addition:
            out = (out.float() + hidden.float()).to(hidden.dtype)
        else:
            out = out + hidden
        return self.layernorm(out) if self.post_layernorm else out


def _perf_only(cls: str, switches: dict) -> None:
    """fused_softmax / fused_bias_gelu only change speed on SageMaker's GPUs; anything else is
    an argument this class does not have."""
    unknown = set(switches) - {"fused_softmax", "fused_bias_gelu"}
    if unknown:
        raise TypeError(f"smp.nn.{cls}() got unexpected keyword argument(s) {sorted(unknown)}")


_LAYER_DEFAULTS = dict(
    num_attention_heads=32, attention_head_size=32, hidden_size=1024, intermediate_size=4096,
    attention_dropout_prob=0.1, hidden_dropout_prob=0.1, activation="gelu",
    layernorm_epsilon=1e-5, initializer_range=0.02, use_normal_initialization=False,
    causal_mask_size=None, add_cross_attention=False, pre_layernorm=False, post_layernorm=True)


class DistributedTransformerLayer(DistributedModule):
    def __init__(self, num_attention_heads: int = 32, attention_head_size: int = 32,
                 hidden_size: int = 1024, intermediate_size: int = 4096,
                 attention_dropout_prob: float = 0.1, hidden_dropout_prob: float = 0.1,
                 activation: str = "gelu", layernorm_epsilon: float = 1e-5,
                 initializer_range: float = 0.02, use_normal_initialization: bool = False,
                 causal_mask_size: Optional[int] = None, add_cross_attention: bool = False,
                 pre_layernorm: bool = False, post_layernorm: bool = True,
                 **perf_switches: Any) -> None:
        super().__init__()
        _check_layernorms("DistributedTransformerLayer", pre_layernorm, post_layernorm)
        common = dict(hidden_size=hidden_size, layernorm_epsilon=layernorm_epsilon,
                      initializer_range=initializer_range,
                      use_normal_initialization=use_normal_initialization,
                      pre_layernorm=pre_layernorm, post_layernorm=post_layernorm, **perf_switches)
        attn = dict(num_attention_heads=num_attention_heads,
                    attention_head_size=attention_head_size,
                    attention_dropout_prob=attention_dropout_prob,
                    hidden_dropout_prob=hidden_dropout_prob, **common)
        self.add_cross_attention = add_cross_attention
        self.attention = DistributedAttentionLayer(causal_mask_size=causal_mask_size, **attn)
        if add_cross_attention:
            self.cross_attention = DistributedAttentionLayer(cross_attention=True, **attn)
        self.output = DistributedTransformerOutputLayer(
            intermediate_size=intermediate_size, hidden_dropout_prob=hidden_dropout_prob,
            activation=activation, **common)

    def forward(self, inputs: Tuple[torch.Tensor, ...]) -> Tuple[torch.Tensor, ...]:
        """inputs: (hidden_states, attention_mask), or with cross attention (hidden_states,
        cross_states, attention_mask, cross_mask); returns the tuple with hidden_states replaced."""
        inputs = tuple(inputs)
        expected = 4 if self.add_cross_attention else 2
        if len(inputs) != expected:
            raise ValueError(f"DistributedTransformerLayer.forward takes a tuple of {expected} "
                             f"tensors, got {len(inputs)}")
        hidden = self._forward_region(self._local, *inputs)
        return (hidden,) + inputs[1:]

    def _local(self, hidden: torch.Tensor, *rest: Optional[torch.Tensor]) -> torch.Tensor:
        if self.add_cross_attention:
            cross, mask, cross_mask = rest
            hidden = self.attention(hidden, mask)
            hidden = self.cross_attention(hidden, cross, cross_mask)
        else:
            hidden = self.attention(hidden, rest[0])
        return self.output(hidden)


class DistributedTransformer(DistributedModule):
    def __init__(self, num_layers: int = 12, num_attention_heads: int = 32,
                 attention_head_size: int = 32, hidden_size: int = 1024,
                 intermediate_size: int = 4096, attention_dropout_prob: float = 0.1,
                 hidden_dropout_prob: float = 0.1, activation: str = "gelu",
                 layernorm_epsilon: float = 1e-5, initializer_range: float = 0.02,
                 use_normal_initialization: bool = False, causal_mask_size: Optional[int] = None,
                 add_cross_attention: bool = False, pre_layernorm: bool = False,
                 post_layernorm: bool = True, **perf_switches: Any) -> None:
        super().__init__()
        kwargs = dict(num_attention_heads=num_attention_heads,
                      attention_head_size=attention_head_size, hidden_size=hidden_size,
                      intermediate_size=intermediate_size,
                      attention_dropout_prob=attention_dropout_prob,
                      hidden_dropout_prob=hidden_dropout_prob, activation=activation,
                      layernorm_epsilon=layernorm_epsilon, initializer_range=initializer_range,
                      use_normal_initialization=use_normal_initialization,
                      causal_mask_size=causal_mask_size, add_cross_attention=add_cross_attention,
                      pre_layernorm=pre_layernorm, post_layernorm=post_layernorm, **perf_switches)
        self.num_layers = num_layers
        self.both_layernorms = pre_layernorm and post_layernorm
        if self.both_layernorms:
            self.input_layernorm = _layernorm(hidden_size, layernorm_epsilon)
        # An nn.Sequential (each layer maps the tuple to the tuple), so that scripts can hand it
        # to smp.set_activation_checkpointing(..., strategy=) as SMP's examples do.
        self.seq_layers = nn.Sequential(*(DistributedTransformerLayer(**kwargs)
                                          for _ in range(num_layers)))
        if self.both_layernorms:
            self.output_layernorm = _layernorm(hidden_size, layernorm_epsilon)

    def forward(self, inputs: Tuple[torch.Tensor, ...]) -> Tuple[torch.Tensor, ...]:
        inputs = tuple(inputs)
        hidden = self._forward_region(self._local, *inputs)
        return (hidden,) + inputs[1:]

    def _local(self, hidden: torch.Tensor, *rest: Optional[torch.Tensor]) -> torch.Tensor:
        if self.both_layernorms:
            hidden = self.input_layernorm(hidden)
        hidden = self.seq_layers((hidden,) + rest)[0]
        return self.output_layernorm(hidden) if self.both_layernorms else hidden


class DistributedTransformerLMHead(DistributedModule):
    """Word + position (+ token type) embeddings, a DistributedTransformer, and an LM head whose
    weight is the word embedding's. forward((input_ids, attention_mask, token_type_ids,
    position_ids, labels)) returns the logits [N, S, vocab_size] (the hidden states when
    add_lm_head is False). attention_mask [N, S] has 1 at masked positions."""

    def __init__(self, num_layers: int = 12, num_attention_heads: int = 32,
                 attention_head_size: int = 32, hidden_size: int = 1024,
                 intermediate_size: int = 4096, vocab_size: int = 30522,
                 num_positions: int = 1024, attention_dropout_prob: float = 0.1,
                 hidden_dropout_prob: float = 0.1, activation: str = "gelu",
                 layernorm_epsilon: float = 1e-5, num_token_types: int = 0,
                 causal_mask_size: Optional[int] = None, add_cross_attention: bool = False,
                 add_lm_head: bool = True, initializer_range: float = 0.02,
                 use_normal_initialization: bool = False, pre_layernorm: bool = False,
                 post_layernorm: bool = True, **perf_switches: Any) -> None:
        super().__init__()
        if add_cross_attention:
            raise SMPUnsupportedError(
                "smp.nn.DistributedTransformerLMHead(add_cross_attention=True) is not supported "
                "by smshim (its forward tuple has no cross states); build the model from "
                "DistributedTransformer(add_cross_attention=True) instead")
        self.add_lm_head = add_lm_head
        self.word_embedding = DistributedEmbedding(vocab_size, hidden_size)
        self.position_embedding = DistributedEmbedding(num_positions, hidden_size)
        self.token_type_embedding = (DistributedEmbedding(num_token_types, hidden_size)
                                     if num_token_types > 0 else None)
        self.dropout = nn.Dropout(hidden_dropout_prob)
        self.transformer = DistributedTransformer(
            num_layers=num_layers, num_attention_heads=num_attention_heads,
            attention_head_size=attention_head_size, hidden_size=hidden_size,
            intermediate_size=intermediate_size, attention_dropout_prob=attention_dropout_prob,
            hidden_dropout_prob=hidden_dropout_prob, activation=activation,
            layernorm_epsilon=layernorm_epsilon, initializer_range=initializer_range,
            use_normal_initialization=use_normal_initialization,
            causal_mask_size=causal_mask_size, pre_layernorm=pre_layernorm,
            post_layernorm=post_layernorm, **perf_switches)

    def forward(self, inputs: Tuple[Any, ...]) -> torch.Tensor:
        inputs = tuple(inputs) + (None,) * (5 - len(tuple(inputs)))
        input_ids, attention_mask, token_type_ids, position_ids, labels = inputs[:5]
        if labels is not None:
            raise SMPUnsupportedError(
                "smp.nn.DistributedTransformerLMHead: labels are not supported by smshim; compute "
                "the loss from the returned logits")
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
            position_ids = position_ids.unsqueeze(0).expand_as(input_ids)
        if attention_mask is None:
            attention_mask = torch.zeros_like(input_ids)
        if token_type_ids is None and self.token_type_embedding is not None:
            token_type_ids = torch.zeros_like(input_ids)
        tensors = [input_ids, attention_mask, position_ids] + (
            [token_type_ids] if self.token_type_embedding is not None else [])
        return self._forward_region(self._local, *tensors)

    def _local(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               position_ids: torch.Tensor, token_type_ids: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
        h = self.word_embedding(input_ids) + self.position_embedding(position_ids)
        if token_type_ids is not None:
            h = h + self.token_type_embedding(token_type_ids)
        h = self.dropout(h)
        mask = attention_mask[:, None, None, :].to(h.dtype) * torch.finfo(h.dtype).min
        h = self.transformer((h, mask))[0]
        if not self.add_lm_head:
            return h
        # Tied head: the embedding is split over hidden, so each rank multiplies its hidden
        # columns by its columns of the table and the partial logits are summed.
        local_h = tp_comm.scatter_to_tp(h, -1)
        return tp_comm.reduce_from_tp(torch.matmul(local_h, self.word_embedding.weight.t()))
