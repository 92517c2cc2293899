"""`clip_grad_norm_(model, max_norm)`: gradient clipping over an FSDP model, whatever wraps it.

Scripts call it on what they train (the FSDP root, possibly inside offload/checkpoint wrappers).
The FSDP root's own `clip_grad_norm_` computes the norm over the sharding group (the replicas hold
identical gradients after the reduce); without FSDP, torch's plain clipping is used. A model that
went through `tsm.transform` (TP/EP DTensor shards, possibly under FSDP) is clipped by
`parallelize.clip_grad_norm_`, which counts every gradient element once over TP and FSDP shards.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def _fsdp_root(model: torch.nn.Module):
    if isinstance(model, FSDP):
        return model
    roots = FSDP.fsdp_modules(model, root_only=True)
    return roots[0] if roots else None


def clip_grad_norm_(model: torch.nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients in place to `max_norm` (<= 0: no clipping) and return the total norm."""
    limit = float(max_norm) if max_norm and max_norm > 0 else math.inf
    if any(getattr(m, "_smshim_transform", None) is not None for m in model.modules()):
        from smshim.torch_sagemaker import parallelize

        return parallelize.clip_grad_norm_(model, limit, norm_type)
    root = _fsdp_root(model)
    if root is not None:
        return root.clip_grad_norm_(limit, norm_type)
    params = [p for p in model.parameters() if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(params, limit, norm_type)
