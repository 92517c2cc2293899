"""A state dict's DTensors seen from one process group: SMP's per-TP-rank checkpoint directories.

AWS's v2 scripts save a TP model's sharded state dict from each TP rank into its own directory
(`tp{tp_rank}_ep{ep_rank}`) over `model.process_group` (that TP rank's sharding group). FSDP1's
sharded state dict of a `tsm.transform`'ed model holds DTensors spread over the whole job's mesh,
TP dimension included, so DCP over the sharding group would see only part of each tensor and refuse
the plan. Here each DTensor is re-described over the mesh dimensions that stay inside the group:
a dimension reaching ranks outside it (the TP one) is dropped, and the tensor's global shape
shrinks to this rank's slice along it. The local tensors are shared, not copied, so DCP loads in
place into the model's own state dict.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

MODEL_PARALLEL_DIM = "mp"  # tsm.state.mesh's TP/EP dim: each TP rank saves its own slices


def _outside(mesh, dim: int, ranks: set) -> bool:
    return not set(dist.get_process_group_ranks(mesh.get_group(dim))) <= ranks


def _strided(placement, dim: int, split_factor: int) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    return (isinstance(placement, _StridedShard) and placement.dim == dim
            and placement.split_factor == split_factor)


def _restrict(value, ranks: set):
    from torch.distributed.tensor import DTensor, Shard

    mesh = value.device_mesh
    drop = [i for i in range(mesh.ndim) if _outside(mesh, i, ranks)]
    if not drop:
        return value
    shape = list(value.shape)
    keep = [i for i in range(mesh.ndim) if i not in drop]
    placements = {k: value.placements[k] for k in keep}
    for i in drop:
        pl = value.placements[i]
        if pl.is_replicate():
            continue
        name = mesh.mesh_dim_names[i] if mesh.mesh_dim_names else str(i)
        if not pl.is_shard() or name != MODEL_PARALLEL_DIM:
            # the ranks of the group do not hold the whole tensor between them (torch's own
            # FSDP1 + TP layout with replicas; the patched FSDP avoids it, fsdp_shard_layout.py)
            raise ValueError(f"checkpoint over a sub-group: a tensor is split ({pl}) over mesh "
                             f"dim {name!r}, which reaches ranks outside the group; save and load "
                             "over the world group (process_group=None) instead")
        d, n = pl.dim, mesh.size(i)
        # split TP-first (fsdp_shard_layout.py): a plain split of the TP slice
        strided = {k for k in keep if _strided(value.placements[k], d, n)}
        placements.update((k, Shard(d)) for k in strided)
        if shape[d] % n or any(value.placements[k].is_shard(d) and mesh.size(k) > 1
                               for k in keep if k not in strided):
            raise ValueError(f"checkpoint over a sub-group: tensor of shape {tuple(value.shape)} "
                             f"split on dim {d} over {mesh.mesh_dim_names[i]!r} ({n}) and other "
                             "mesh dims: save over the world group instead")
        shape[d] //= n
    local = value.to_local()
    if not keep:
        return local
    names = mesh.mesh_dim_names
    sub = mesh[tuple(names[i] for i in keep)] if names else None
    if sub is None:
        raise ValueError("checkpoint over a sub-group: the DTensor's mesh has no dim names")
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, sub, [placements[i] for i in keep], run_check=False,
                              shape=torch.Size(shape), stride=stride)


def restrict_to_group(state_dict: Any, process_group: Optional[dist.ProcessGroup]) -> Any:
    """A structural copy of `state_dict` (dicts, lists) whose DTensors live inside
    `process_group`'s ranks; everything else is the same object. The world group or None:
    `state_dict` itself."""
    from torch.distributed.tensor import DTensor

    if process_group is None or dist.get_world_size(process_group) == dist.get_world_size():
        return state_dict
    ranks = set(dist.get_process_group_ranks(process_group))

    def walk(v):
        if isinstance(v, DTensor):
            return _restrict(v, ranks)
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    return walk(state_dict)


def write_back(original: Any, loaded: Any) -> None:
    """After DCP loaded into `restrict_to_group`'s copy: tensors were filled in place; put the
    values DCP replaced (non-tensor entries) back into the original structure."""
    if isinstance(original, dict) and isinstance(loaded, dict):
        for k, v in loaded.items():
            if isinstance(original.get(k), (dict, list)):
                write_back(original[k], v)
            elif not isinstance(original.get(k), torch.Tensor):
                original[k] = v
    elif isinstance(original, list) and isinstance(loaded, list):
        for i, v in enumerate(loaded):
            if isinstance(original[i], (dict, list)):
                write_back(original[i], v)
            elif not isinstance(original[i], torch.Tensor):
                original[i] = v
