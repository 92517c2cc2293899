"""clip_grad_norm_ over TP (DTensor) shards and FSDP shards: the exact global gradient norm.

Each gradient contributes its local squared sum once: a TP-sharded (DTensor Shard) gradient is
summed over its TP mesh; a replicated one (DTensor Replicate or a plain tensor equal on every TP
rank) counts only once; FSDP's flat shards (use_orig_params views or FSDP2 DTensors) are summed
over the sharding group. torch.sagemaker.grad_norm.clip_grad_norm_ can call this directly.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate


def _fsdp1_groups(model: nn.Module) -> Dict[int, object]:
    """id(original parameter) -> FSDP1 sharding group, for parameters FSDP1 shards."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover
        return {}
    out = {}
    for m in model.modules():
        if isinstance(m, FSDP) and m._handle is not None and m._handle.uses_sharded_strategy:
            for p in m._handle.flat_param._params or []:
                out[id(p)] = m.process_group
    return out


def _local_sq(g: torch.Tensor, norm_type: float) -> torch.Tensor:
    g = g.detach().float()
    if math.isinf(norm_type):
        return g.abs().max() if g.numel() else torch.zeros(())
    return (g.abs() ** norm_type).sum()


def _contributions(model: nn.Module, params, norm_type: float):
    """Yield (value, groups to reduce over, deduplicate factor) per gradient."""
    fsdp = _fsdp1_groups(model)
    for p in params:
        g = p.grad
        if g is None:
            continue
        groups = []
        if isinstance(g, DTensor):
            local = g.to_local()
            mesh = g.device_mesh
            for dim, pl in enumerate(g.placements):
                if not isinstance(pl, Replicate):  # Shard (FSDP2 or TP): sum over that mesh dim
                    groups.append(mesh.get_group(dim))
        else:
            local = g
        if id(p) in fsdp:
            groups.append(fsdp[id(p)])
        yield _local_sq(local, norm_type), tuple(groups)


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    params: Optional[Iterable[torch.Tensor]] = None) -> torch.Tensor:
    """Scale every gradient of `model` so that their global norm is at most max_norm; return the
    global norm (before clipping) as a tensor, equal on every rank."""
    norm_type = float(norm_type)
    params = list(model.parameters() if params is None else params)
    by_groups: Dict[Tuple, torch.Tensor] = {}
    for value, groups in _contributions(model, params, norm_type):
        acc = by_groups.get(groups)
        if acc is None:
            by_groups[groups] = value.clone()
        elif math.isinf(norm_type):
            by_groups[groups] = torch.maximum(acc, value)
        else:
            by_groups[groups] = acc + value
    # Reduce each kind over its groups; the key order is the same on every rank only if every
    # rank saw the same kinds, so reduce over a fixed, sorted list of group signatures.
    total = torch.zeros(())
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    for groups in sorted(by_groups, key=lambda gs: [dist.get_process_group_ranks(g) for g in gs]):
        v = by_groups[groups]
        for g in groups:
            dist.all_reduce(v, op=op, group=g)
        total = torch.maximum(total, v) if math.isinf(norm_type) else total + v
    norm = total if math.isinf(norm_type) else total ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                g.mul_(coef.to(g.device, g.dtype))
    return norm
