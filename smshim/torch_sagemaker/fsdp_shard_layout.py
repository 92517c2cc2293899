"""Where FSDP1's sharded state dicts put the shards of a transformed model's tensors.

With a `device_mesh` whose root is a larger mesh (tsm.transform's TP path, see fsdp_patch.py),
FSDP1 describes every tensor of a SHARDED_STATE_DICT (model and optimizer) through torch's
`DTensorExtensions.chunk_dtensor`. For a tensor TP left whole (norms, a replicated bias) that
function assumes a 2-D (FSDP, TP) root mesh and splits the tensor over the root's first dim. On
tsm.state's mesh (rep, dp_shard, cp, mp) the first dim is the replica one: each replica then holds
half of a norm, and the ranks of one replica do not hold the whole tensor between them. AWS's v2
scripts save per TP rank from replica 0 only (`process_group=model.process_group`), which needs
exactly that. Here such a tensor is split over the dims that make FSDP's sharding group
(dp_shard, cp) and replicated over the others, so every replica holds all of it. With CP > 1, a
TP tensor split on dim 0 is described TP-first (`_tp_first`), so that the ranks of one TP rank
hold its TP slice between them. The layout only describes the state dict: loading gathers the
tensor whole either way (`DTensorExtensions.all_gather_dtensor`), and a checkpoint saved over
the world is read the same.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from smshim.torch_sagemaker.topology import MESH_DIMS

_SHARD_DIMS = ("dp_shard", "cp")  # tsm.state's mesh["shard"] is these two, flattened
_MARK = "_smshim_shard_layout"


def _chunk_over_shard_dims(original, tensor: torch.Tensor, rank: int, device_mesh) -> Any:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    root = device_mesh._get_root_mesh() if device_mesh is not None else None
    if root is None or root.mesh_dim_names != MESH_DIMS:
        return original(tensor, rank, device_mesh)
    if isinstance(tensor, DTensor):
        return _tp_first(original, tensor, rank, device_mesh, root)
    # `tensor` is the whole (unsharded) tensor on every rank: splitting it is local, no comms.
    placements = [Shard(0) if name in _SHARD_DIMS else Replicate() for name in MESH_DIMS]
    whole = DTensor.from_local(tensor.detach().clone(), root, [Replicate()] * root.ndim,
                               run_check=False)
    return whole.redistribute(root, placements)


def _tp_first(original, tensor, rank: int, device_mesh, root) -> Any:
    """A TP tensor split on dim 0 (column-parallel weights, the vocabulary-split embedding), with
    CP > 1: torch splits it over `cp` too, on the same dim, CP-first (the rank at (cp c, mp m)
    holds chunk c·tp + m of the whole tensor; torch moves the data to match), so the ranks of one
    TP rank do not hold its TP slice between them and a per-TP-rank checkpoint cannot describe
    it. Here each rank's TP slice is cut over `cp` (local, no communication) and described
    TP-first, as FSDP2 does (`_StridedShard` on `cp`). Other placements keep torch's layout."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    cp, mp = root.size(MESH_DIMS.index("cp")), root.size(MESH_DIMS.index("mp"))
    tp = tensor.placements[0] if len(tensor.placements) == 1 else None
    local = tensor.to_local()
    if cp == 1 or tp != Shard(0) or local.shape[0] % cp:
        return original(tensor, rank, device_mesh)
    piece = local.detach().chunk(cp, dim=0)[root.get_local_rank("cp")].clone()
    placements = {"cp": _StridedShard(0, split_factor=mp), "mp": Shard(0)}
    return DTensor.from_local(piece, root, [placements.get(n, Replicate()) for n in MESH_DIMS],
                              shape=tensor.shape, stride=tensor.stride(), run_check=False)


def keep_shards_inside_each_replica(fsdp_root: torch.nn.Module) -> None:
    """Make every FSDP1 unit under `fsdp_root` (the root included) describe its non-TP tensors
    as split over its sharding group. Patches each unit's extension object in place (FSDP's
    flat-parameter handle shares it), once."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    for unit in FSDP.fsdp_modules(fsdp_root):
        ext = getattr(unit, "_fsdp_extension", None)
        if ext is None or getattr(ext, _MARK, False):
            continue
        ext.chunk_dtensor = functools.partial(_chunk_over_shard_dims, ext.chunk_dtensor)
        setattr(ext, _MARK, True)
