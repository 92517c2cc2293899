"""How a tensor-parallel parameter is split over the TP ranks, and the two conversions between a
full tensor and this rank's shard (used by the `smp.nn` modules to take their shard of an
initialisation, by full state dicts to gather shards and to load full tensors, and by the gradient
reducer to tell TP parameters from replicated ones).

A parameter of a distributed module carries `_smp_tp = TPSplit(dim, chunks)` when it is split, or
`TPSplit(None)` when it is a replicated parameter of a distributed module (a LayerNorm, a
row-parallel bias). The full tensor is `chunks` equal blocks along `dim` (3 for a fused q/k/v
projection, else 1); each block is cut into tp_size equal slices, and rank r holds slice r of every
block, concatenated. Both kinds are "TP-managed": their gradient already holds the contributions
of all TP ranks' data (see tp_comm.batch_in), so they are averaged over the RDP group, not the DP
group (model.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

__all__ = ["TPSplit", "mark", "split_of", "is_tp_managed", "shard", "unshard"]

_ATTR = "_smp_tp"


@dataclass(frozen=True)
class TPSplit:
    dim: Optional[int]  # None: replicated over the TP ranks
    chunks: int = 1


def mark(p: torch.Tensor, dim: Optional[int], chunks: int = 1) -> torch.Tensor:
    """Record how `p` is split (dim None: replicated in a distributed module); returns `p`."""
    setattr(p, _ATTR, TPSplit(dim, chunks))
    return p


def split_of(p: object) -> Optional[TPSplit]:
    return getattr(p, _ATTR, None)


def is_tp_managed(p: object) -> bool:
    return split_of(p) is not None


def is_sharded(p: object) -> bool:
    s = split_of(p)
    return s is not None and s.dim is not None


def shard(full: torch.Tensor, split: TPSplit, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s shard of the full tensor."""
    if split.dim is None or size == 1:
        return full
    n = full.shape[split.dim]
    if n % (split.chunks * size):
        raise ValueError(f"cannot split dimension {split.dim} of size {n} into {split.chunks} "
                         f"block(s) x tensor_parallel_degree {size}")
    blocks = full.chunk(split.chunks, dim=split.dim)
    return torch.cat([b.chunk(size, dim=split.dim)[rank] for b in blocks], dim=split.dim)


def unshard(shards: List[torch.Tensor], split: TPSplit) -> torch.Tensor:
    """The full tensor from every rank's shard (in tp_rank order)."""
    if split.dim is None or len(shards) == 1:
        return shards[0]
    per_rank = [s.chunk(split.chunks, dim=split.dim) for s in shards]
    blocks = [torch.cat([pr[c] for pr in per_rank], dim=split.dim) for c in range(split.chunks)]
    return torch.cat(blocks, dim=split.dim)
