"""Where FSDP1's sharded state dicts put the shards of a transformed model's non-TP tensors.

With a `device_mesh` whose root is a larger mesh (tsm.transform's TP path, see fsdp_patch.py),
FSDP1 describes every tensor of a SHARDED_STATE_DICT (model and optimizer) through torch's
`DTensorExtensions.chunk_dtensor`. For a tensor TP left whole (norms, a replicated bias) that
function assumes a 2-D (FSDP, TP) root mesh and splits the tensor over the root's first dim. On
tsm.state's mesh (rep, dp_shard, cp, mp) the first dim is the replica one: each replica then holds
half of a norm, and the ranks of one replica do not hold the whole tensor between them. AWS's v2
scripts save per TP rank from replica 0 only (`process_group=model.process_group`), which needs
exactly that. Here such a tensor is split over the dims that make FSDP's sharding group
(dp_shard, cp) and replicated over the others, so every replica holds all of it. The layout only
describes the state dict: loading gathers the tensor whole either way
(`DTensorExtensions.all_gather_dtensor`), and a checkpoint saved over the world is read the same.
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
    if isinstance(tensor, DTensor) or root is None or root.mesh_dim_names != MESH_DIMS:
        return original(tensor, rank, device_mesh)
    # `tensor` is the whole (unsharded) tensor on every rank: splitting it is local, no comms.
    placements = [Shard(0) if name in _SHARD_DIMS else Replicate() for name in MESH_DIMS]
    whole = DTensor.from_local(tensor.detach().clone(), root, [Replicate()] * root.ndim,
                               run_check=False)
    return whole.redistribute(root, placements)


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
