"""clip_grad_norm_ over TP (DTensor) shards and FSDP shards: the exact global gradient norm.

Each gradient element counts once. Every parameter is classified by the groups its gradient is
split over, from the parameter's layout (never from which gradients happen to exist, so every rank
runs the same collectives in the same order):
- a DTensor (TP, EP, or FSDP2's fully_shard): each mesh dim it is not replicated on;
- a plain tensor inside an FSDP1 sharded flat parameter: the FSDP group, plus the TP group when
  the transform split it (FSDP1 flattens DTensors into plain views; their names say which);
- anything else is replicated: counted once, from this rank's copy.
Missing gradients (a parameter with no elements in this rank's FSDP1 shard) contribute 0.
torch.sagemaker.grad_norm.clip_grad_norm_ can call this directly.
"""

from __future__ import annotations

import math
from typing import Dict, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from smshim.torch_sagemaker.parallelize.hf_state_dict import hf_name


def _transform_info(model: nn.Module):
    for m in model.modules():
        info = getattr(m, "_smshim_transform", None)
        if info is not None:
            return info
    return None


def _fsdp1_groups(model: nn.Module) -> Dict[int, object]:
    """id(original parameter) -> FSDP1 sharding group, for parameters FSDP1 shards."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    out = {}
    for m in model.modules():
        handle = getattr(m, "_handle", None) if isinstance(m, FSDP) else None
        if handle is not None and handle.uses_sharded_strategy:
            for p in handle.flat_param._params or []:
                out[id(p)] = m.process_group
    return out


def _classify(model: nn.Module):
    """Yield (kind key, groups, parameter) for every parameter."""
    info = _transform_info(model)
    tp_sharded = info.tp_sharded if info is not None else frozenset()
    tp_group = info.tp_mesh.get_group() if info is not None and info.tp_mesh is not None else None
    ep_group = info.ep_mesh.get_group() if info is not None and info.ep_mesh is not None else None
    fsdp1 = _fsdp1_groups(model)
    for name, p in model.named_parameters():
        key, groups = [], []
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            for dim, pl in enumerate(p.placements):
                if not pl.is_replicate():
                    key.append(("dtensor", mesh.mesh_dim_names, mesh.shape, dim))
                    groups.append(mesh.get_group(dim))
        else:
            if hf_name(name) in tp_sharded:
                key.append(("split",))
                groups.append(ep_group if ep_group is not None and tp_group is None else tp_group)
            if id(p) in fsdp1:
                key.append(("fsdp1",))
                groups.append(fsdp1[id(p)])
        yield tuple(key), groups, p


def _local(p: torch.Tensor, norm_type: float) -> torch.Tensor:
    g = p.grad
    if g is None:
        return torch.zeros(())
    if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
        # e.g. the vocab-split embedding's gradient comes back Replicate: count it as the
        # parameter is split (local for Replicate -> Shard; every rank has the same layout)
        g = g.redistribute(p.device_mesh, p.placements)
    g = (g.to_local() if isinstance(g, DTensor) else g).detach().float()
    if g.numel() == 0:
        return torch.zeros(())
    return g.abs().max().cpu() if math.isinf(norm_type) else (g.abs() ** norm_type).sum().cpu()


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every gradient of `model` (transformed, optionally FSDP-wrapped) so that their global
    norm is at most max_norm; return the global norm before clipping (equal on every rank)."""
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    buckets: Dict[Tuple, list] = {}
    for key, groups, p in _classify(model):
        v = _local(p, norm_type)
        if key in buckets:
            acc = buckets[key][0]
            buckets[key][0] = torch.maximum(acc, v) if inf else acc + v
        else:
            buckets[key] = [v, groups]
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    total = torch.zeros(())
    for key in sorted(buckets, key=repr):  # same kinds, same order on every rank
        v, groups = buckets[key]
        for g in groups:
            dist.all_reduce(v, op=op, group=g)
        total = torch.maximum(total, v) if inf else total + v
    norm = total if inf else total ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                g.mul_(coef.to(g.device, g.dtype))
    return norm
