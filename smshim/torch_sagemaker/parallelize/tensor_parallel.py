"""Split a Hugging Face causal LM's decoder layers, embedding and LM head over a TP DeviceMesh.

Every rank cuts its own shard out of the full weights it holds (no communication), wraps it as a
DTensor, and torch's ColwiseParallel / RowwiseParallel then only add the input/output layout
hooks (a parameter that is already a DTensor with the wanted placement is taken as it is).
Norms and everything else stay plain replicated tensors: the layout hooks all-reduce their
activations' gradients, so their gradients are complete and equal on every TP rank.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from smshim.torch_sagemaker.parallelize.plan import COLWISE, ROWWISE, FamilyPlan

logger = logging.getLogger(__name__)

# Attention attributes that count heads (or head features) per rank, across transformers versions.
_HEAD_COUNT_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "hidden_size",
                     "all_head_size", "embed_dim")


def check_divisible(model: nn.Module, plan: FamilyPlan, tp: int) -> None:
    """Raise (on every rank, before any collective) if a split dimension does not divide by tp."""
    cfg = model.config
    bad = {k: getattr(cfg, k) for k in plan.divisible
           if getattr(cfg, k, None) is not None and getattr(cfg, k) % tp}
    if bad:
        raise ValueError(f"tensor_parallel_degree {tp} must divide {bad} of "
                         f"{type(model).__name__}; pick a degree that divides all of them")


def _shard(t: torch.Tensor, dim: int, mesh: DeviceMesh) -> torch.Tensor:
    n, r = mesh.size(), mesh.get_local_rank()
    return t.detach().chunk(n, dim=dim)[r].contiguous()


def _to_dtensor(module: nn.Module, name: str, mesh: DeviceMesh, dim) -> None:
    """Replace parameter `name` of `module` by its DTensor shard (dim None: replicated)."""
    p = getattr(module, name, None)
    if p is None or isinstance(p, DTensor):
        return
    if dim is None:
        local, placements = p.detach(), [Replicate()]
    else:
        local, placements = _shard(p, dim, mesh), [Shard(dim)]
    dt = DTensor.from_local(local, mesh, placements, run_check=False)
    module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))


def _split_linear(linear: nn.Module, style: str, mesh: DeviceMesh) -> None:
    if style == COLWISE:
        _to_dtensor(linear, "weight", mesh, 0)
        _to_dtensor(linear, "bias", mesh, 0)
    elif style == ROWWISE:
        _to_dtensor(linear, "weight", mesh, 1)
        _to_dtensor(linear, "bias", mesh, None)
    else:
        raise ValueError(f"unknown split style {style!r}")


def _adjust_head_counts(attn: nn.Module, tp: int) -> None:
    """Attention code that reshapes with a stored head count must see the per-rank count."""
    for attr in _HEAD_COUNT_ATTRS:
        v = getattr(attn, attr, None)
        if isinstance(v, int) and not isinstance(v, bool):
            setattr(attn, attr, v // tp)


def parallelize_layers(model: nn.Module, plan: FamilyPlan, mesh: DeviceMesh) -> None:
    """Split every decoder layer's attention and MLP column/row-parallel."""
    tp = mesh.size()
    styles = {COLWISE: ColwiseParallel(), ROWWISE: RowwiseParallel()}
    for layer in model.get_submodule(plan.layers):
        for path, style in plan.layer_plan.items():
            _split_linear(layer.get_submodule(path), style, mesh)
        parallelize_module(layer, mesh, {path: styles[s] for path, s in plan.layer_plan.items()})
        _adjust_head_counts(layer.get_submodule(plan.attention), tp)


def parallelize_vocab(model: nn.Module, plan: FamilyPlan, mesh: DeviceMesh) -> None:
    """Embedding rows and LM-head rows split over the vocabulary. The embedding's output is the
    all-reduced (replicated) hidden state; the head's output stays the rank's vocabulary slice
    (a plain tensor), which vocab_parallel.py turns into an exact loss and full logits."""
    embed, head = model.get_submodule(plan.embed), model.get_submodule(plan.head)
    tied = head.weight is embed.weight
    _to_dtensor(embed, "weight", mesh, 0)
    parallelize_module(embed, mesh, RowwiseParallel(input_layouts=Replicate()))
    if not tied:
        _split_linear(head, COLWISE, mesh)
    parallelize_module(head, mesh, ColwiseParallel(output_layouts=Shard(-1)))
    if tied:  # both are Shard(0) over the vocabulary: the head keeps using the embedding's
        head.weight = embed.weight


def split_param_names(model: nn.Module) -> frozenset:
    """Names of the parameters that are split (not replicated) over some mesh dim."""
    return frozenset(n for n, p in model.named_parameters()
                     if isinstance(p, DTensor) and not all(pl.is_replicate() for pl in p.placements))
