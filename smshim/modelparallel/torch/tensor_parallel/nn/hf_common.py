"""What the Hugging Face block mappings (hf_gpt2.py, hf_gpt_neox.py, hf_bert.py) share: sharded
projections that stand in for a block's Conv1D / nn.Linear, the batch-gathering forward wrapper
installed on a distributed block, and the class test.

A block is distributed in place: it keeps its class, its forward code and its state-dict keys
(the sharded projections keep the names `weight` / `bias`); its projections become column-parallel
(output features split, entered through `copy_to_tp`) or row-parallel (input features split,
partial results summed with `reduce_from_tp`, then the replicated bias added once), so a
column-parallel projection followed by a row-parallel one is exact for anything computed per
output feature in between (per head for attention, elementwise for an MLP activation).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from smshim.modelparallel.torch.tensor_parallel import collectives as tp_comm
from smshim.modelparallel.torch.tensor_parallel import shard as tp_shard
from smshim.modelparallel.torch.errors import SMPRuntimeError
from smshim.modelparallel.torch.tensor_parallel.nn.base import DistributedModule

__all__ = ["is_hf_class", "ShardedConv1D", "ShardedLinear", "mark_replicated",
           "gather_batch_forward", "only_parameters", "elementwise_activation",
           "all_attend_mask", "sdpa_causal_mask", "gather_recorded_attention"]


def is_hf_class(module: nn.Module, name: str) -> bool:
    """Whether `module` is exactly transformers' class `name` (a subclass may change forward)."""
    cls = type(module)
    return cls.__name__ == name and cls.__module__.startswith("transformers.")


def only_parameters(block: nn.Module, prefixes: "tuple[str, ...]") -> str:
    """The names of `block`'s parameters outside the submodules `prefixes` ("" if none): a block
    carrying anything else (relative position embeddings, a parametrised activation) is not the
    block a mapping was written for."""
    return ", ".join(n for n, _ in block.named_parameters()
                     if not any(n.startswith(p + ".") for p in prefixes))


def not_linear(block: nn.Module, names: "tuple[str, ...]") -> Optional[str]:
    """Why the projections `names` of `block` cannot be split as nn.Linear (None if they can)."""
    for name in names:
        kind = type(block.get_submodule(name))
        if kind is not nn.Linear:
            return f"{name} is a {kind.__name__}, not an nn.Linear"
    return None


def not_splittable(block: nn.Module, size: int, heads: int, inner: int,
                   params: "tuple[str, ...]", act: Any) -> Optional[str]:
    """Why a block whose projections are nn.Linear still cannot be split exactly over `size` TP
    ranks (None if it can): heads and inner size must divide, it may hold no parameters outside
    `params`, and its activation must be elementwise."""
    if heads % size or inner % size:
        return (f"{heads} heads / intermediate size {inner} do not divide by "
                f"tensor_parallel_degree {size}")
    extra = only_parameters(block, params)
    if extra:
        return f"it has other parameters ({extra})"
    if not elementwise_activation(act):
        return f"its activation {act!r} is not a known elementwise activation"
    return None


def elementwise_activation(act: Any) -> bool:
    """Whether `act` is one of transformers' ACT2FN activations without parameters: those act on
    each feature alone, so they commute with splitting the features over the TP ranks."""
    try:
        from transformers.activations import ACT2CLS
    except ImportError:  # pragma: no cover - the block itself comes from transformers
        return False
    classes = tuple(c[0] if isinstance(c, tuple) else c for c in ACT2CLS.values())
    return (isinstance(act, classes) and isinstance(act, nn.Module)
            and not any(True for _ in act.parameters()))


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


class ShardedLinear(DistributedModule):
    """This rank's shard of an nn.Linear (y = x W^T + b, W [out, in]). `dim` 0: column parallel
    (output features split; the bias too); `dim` 1: row parallel (input features split; partial
    results summed over the TP ranks, then the replicated bias added). A missing bias stays
    missing (GPT-NeoX's `attention_bias=False`)."""

    def __init__(self, linear: nn.Linear, dim: int, chunks: int = 1) -> None:
        super().__init__()
        self.dim = dim
        self.weight = self._sharded(linear.weight.data, dim, chunks)
        if linear.bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = self._sharded(linear.bias.data, 0 if dim == 0 else None, chunks)
        self.out_features, self.in_features = self.weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dim == 0:
            return F.linear(tp_comm.copy_to_tp(x), self.weight, self.bias)
        y = tp_comm.reduce_from_tp(F.linear(x, self.weight))
        # The bias is added after the sum: added on every rank before it, it would count t times.
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        split = "out_features" if self.dim == 0 else "in_features"
        return (f"in_features={self.in_features}, out_features={self.out_features} (local), "
                f"bias={self.bias is not None}, tp_split={split}")


def all_attend_mask(tail: Tuple[int, ...], dtype: torch.dtype, n: int) -> torch.Tensor:
    """A `fill_none` filler: the attention mask that masks nothing, boolean (True: attend) or
    additive (0), in the dtype and per-example shape the peers' masks have."""
    if dtype == torch.bool:
        return torch.ones((n,) + tuple(tail), dtype=torch.bool)
    return torch.zeros((n,) + tuple(tail), dtype=dtype)


def sdpa_causal_mask(config: Any) -> Filler:
    """A `fill_none` filler for a causal block: what a None mask means to transformers' sdpa
    attention (`is_causal` when more than one query, the keys cut to the queries' length; all
    keys for one query). Other implementations (eager always gets a mask) give None: an error."""
    def fill(tail: Tuple[int, ...], dtype: torch.dtype, n: int) -> Optional[torch.Tensor]:
        if getattr(config, "_attn_implementation", None) != "sdpa" or len(tail) != 3:
            return None
        q, k = tail[-2], tail[-1]
        allowed = torch.ones(q, k, dtype=torch.bool)
        if q > 1:
            allowed = allowed.tril()  # j <= i; keys from q on are cut by sdpa_attention_forward
        allowed = allowed.expand((n,) + tuple(tail))
        if dtype == torch.bool:
            return allowed.clone()
        return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed,
                                                                   torch.finfo(dtype).min)
    return fill


def mark_replicated(*modules: nn.Module) -> None:
    """Parameters of a distributed block that stay whole (LayerNorms): TP-managed all the same,
    because they are computed on the gathered batch (their gradients are averaged over RDP)."""
    for m in modules:
        for p in m.parameters():
            tp_shard.mark(p, None)


def gather_recorded_attention(attention: nn.Module) -> None:
    """Make the attention weights a split attention module returns (its output[1], what
    transformers records for `output_attentions`) those of all heads and this rank's rows, as the
    unsplit module's: gathered over the TP ranks only while transformers is recording them (an
    all-gather of [batch, heads, q, k] per layer is otherwise wasted: the blocks drop them)."""
    attention.forward = functools.partial(_attention_forward, attention.forward)


def _recording_attentions() -> bool:
    # transformers' capture_outputs keeps what it records in a context variable; the TP ranks
    # run the same code, so they agree on it.
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # pragma: no cover - another transformers layout: nothing recorded
        return False
    collected = _active_collector.get()
    return bool(collected) and "attentions" in collected


def _attention_forward(forward: Any, *args: Any, **kwargs: Any) -> Any:
    out = forward(*args, **kwargs)
    if (tp_comm.tp_world()[1] > 1 and isinstance(out, tuple) and len(out) > 1
            and isinstance(out[1], torch.Tensor) and _recording_attentions()):
        # Heads are dim 1; inside the block the batch is gathered unless prescaled_batch.
        weights = tp_comm.batch_out(tp_comm.gather_from_tp(out[1], 1))
        out = (out[0], weights) + tuple(out[2:])
    return out


# fill_none[name](tail_shape, dtype, n): a tensor of n examples that means to the block what the
# argument `name` being None means (see gather_batch_forward), or None where it cannot say.
Filler = Callable[[Tuple[int, ...], torch.dtype, int], Optional[torch.Tensor]]


def gather_batch_forward(block: nn.Module, fill_none: Optional[Dict[str, Filler]] = None) -> None:
    """Replace `block.forward` (on the instance) by one that, as the outermost distributed module
    with prescaled_batch false, gathers the TP ranks' batches of every per-example argument,
    runs the original forward and returns this rank's rows.

    The TP ranks first agree on which arguments they gather (`tp_comm.agree`): their batches
    differ, and so may what the model code derived from them. Hugging Face's mask builders return
    None for a batch without padding under sdpa, while a peer whose batch has padding passes a
    per-example mask; gathering on one rank only would hang both. An argument listed in
    `fill_none` is then replaced, on the ranks where it is None, by the tensor meaning the same
    (an all-attend mask for a bidirectional block); any other disagreement is an error naming
    the argument and the ranks. Call it before changing the block: it raises ValueError (the
    block then stays whole) for a forward it cannot wrap."""
    forward = block.forward
    sig = inspect.signature(forward)
    if any(p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY) for p in sig.parameters.values()):
        raise ValueError(f"{type(block).__name__}.forward takes positional-only arguments: "
                        "its batch-gathering wrapper passes all but the first by name")
    block.forward = functools.partial(_gathered_forward, forward, sig,
                                      dict(fill_none or {}), type(block).__name__)


def _map(fn: Callable[[Any], Any], v: Any) -> Any:
    # Into tuples and lists too: GPT-NeoX's `position_embeddings` is a (cos, sin) pair whose first
    # dimension is the batch when the caller gave per-example position ids.
    if isinstance(v, (tuple, list)) and not hasattr(v, "_fields"):
        return type(v)(_map(fn, x) for x in v)
    return fn(v)


def _leaves(v: Any) -> List[Any]:
    out: List[Any] = []
    _map(out.append, v)
    return out


def _describe(v: Any, n: int) -> Any:
    if v is None:
        return None
    if isinstance(v, torch.Tensor):
        if v.dim() > 0 and v.shape[0] == n:
            return ("batch", tuple(v.shape[1:]), str(v.dtype))
        return ("tensor", tuple(v.shape))
    return type(v).__name__


def _named(bound: inspect.BoundArguments, sig: inspect.Signature) -> Dict[str, Any]:
    """The call's arguments by name, the entries of **kwargs as names of their own."""
    out: Dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out


def _gathered_forward(forward: Any, sig: inspect.Signature, fill_none: Dict[str, Filler],
                      block_name: str, *args: Any, **kwargs: Any):
    with tp_comm.region() as outer:
        if not (outer and tp_comm.gathers_batch()):
            return forward(*args, **kwargs)
        n = args[0].shape[0]
        bound = sig.bind(*args, **kwargs)
        named = _named(bound, sig)
        mine = {k: [_describe(x, n) for x in _leaves(v)] for k, v in named.items()}
        everyone = tp_comm.agree(mine)
        for key in named:
            seen = [d.get(key) for d in everyone]
            if all(s == seen[0] for s in seen):
                continue
            given = [s for s in seen if s != [None]]
            fillable = (key in fill_none and all(s == given[0] for s in given)
                        and len(given[0]) == 1 and isinstance(given[0][0], tuple)
                        and given[0][0][0] == "batch")
            filled = None
            if fillable and mine[key] == [None]:
                _, tail, dtype = given[0][0]
                filled = fill_none[key](tail, getattr(torch, dtype.split(".")[-1]), n)
            if not fillable or (mine[key] == [None] and filled is None):
                raise SMPRuntimeError(
                    f"tensor parallelism: the TP ranks call {block_name} with different "
                    f"`{key}` (by tp_rank: {seen}); their batches must have the same shapes "
                    "and the model code must derive the same kinds of arguments from them "
                    "(or use prescaled_batch: true)")
            if filled is not None:
                named[key] = filled

        def gather(v: Any) -> Any:
            # Per-example tensors (first dimension = the local batch) are gathered; anything
            # else (broadcast masks, caches, flags) is the same on every rank.
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n:
                return tp_comm.batch_in(v)
            return v

        # The first argument (the hidden states) positionally, the rest by name: an argument
        # left at its default would shift later ones if they were passed by position.
        first = next(iter(sig.parameters))
        out = forward(gather(named.pop(first)), **{k: _map(gather, v) for k, v in named.items()})
        big = n * tp_comm.tp_world()[1]

        def scatter(v: Any) -> Any:
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == big:
                return tp_comm.batch_out(v)
            return v

        if isinstance(out, tuple):
            return tuple(scatter(v) for v in out)
        return scatter(out)
