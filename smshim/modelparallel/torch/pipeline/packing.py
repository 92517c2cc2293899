"""Many small tensors packed into few, for a message that carries one per microbatch.

A frame costs each of its tensors a header entry, a copy of its bytes and, on receipt, a tensor
of its own. pp_rank 0's STEP_END carries the step's results to every peer: usually a loss per
microbatch, so p - 1 frames of m tensors each at the step's end, on its critical path (at p = 8,
m = 32, posting them took 2-4 ms of pp_rank 0's CPU a step; packed, 1-2). `pack` stacks the small
tensors that share a dtype, device and shape into one, once for all peers; `unpack` gives them
back as views of the received stack. Values, dtypes, shapes and devices are kept.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

# Larger tensors travel as they are: stacking would copy them once more.
_PACK_NUMEL = 1024

# For each tensor: (index of the packed tensor holding it, its row there), or (index, -1): sent
# as it is. None: nothing was packed.
Spec = Optional[List[Tuple[int, int]]]


def pack(tensors: List[torch.Tensor]) -> Tuple[Spec, List[torch.Tensor]]:
    """The tensors to send instead of `tensors`, and how `unpack` finds each again."""
    groups: Dict[tuple, int] = {}
    members: List[List[torch.Tensor]] = []
    alone: List[bool] = []
    spec: List[Tuple[int, int]] = []
    for t in tensors:
        if t.is_nested or t.layout is not torch.strided or t.is_quantized \
                or t.numel() > _PACK_NUMEL:
            spec.append((len(members), -1))
            members.append([t])
            alone.append(True)
            continue
        key = (t.dtype, t.device, t.shape)
        g = groups.get(key)
        if g is None:
            g = groups[key] = len(members)
            members.append([])
            alone.append(False)
        spec.append((g, len(members[g])))
        members[g].append(t)
    if len(members) == len(tensors):  # (no two shared a stack)
        return None, tensors
    with torch.no_grad():  # (a result may be part of a graph; what travels is its value)
        packed = [m[0] if single else torch.stack(m) for m, single in zip(members, alone)]
    return spec, packed


def unpack(spec: Spec, packed: List[torch.Tensor]) -> List[torch.Tensor]:
    """The tensors `pack` was given, from what it returned (as received)."""
    if spec is None:
        return packed
    rows: List[Optional[Tuple[torch.Tensor, ...]]] = [None] * len(packed)
    out = []
    for g, i in spec:
        if i < 0:
            out.append(packed[g])
            continue
        group = rows[g]
        if group is None:
            group = rows[g] = packed[g].unbind()
        out.append(group[i])
    return out
