"""The rank layout of an SMP v2 job, and torch DeviceMesh groups built on it.

Layout (fastest-varying first): the model-parallel rank (TP, or EP: they do not combine), then the
CP rank, then the data-parallel rank inside the sharding group, then the replica:

    rank = ((replica * (shard / cp) + dp_in_shard) * cp + cp_rank) * mp + mp_rank

so TP ranks are contiguous, then CP, and the loader's data-parallel rank is rank // (tp·cp), as in
AWS's v2 scripts. The FSDP sharding group is the `shard` ranks (CP included) with equal mp rank in
one replica; the replicate group joins the ranks that hold the same shard in every replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from smshim.torch_sagemaker.config import Degrees

MESH_DIMS = ("rep", "dp_shard", "cp", "mp")


@dataclass(frozen=True)
class Coords:
    rep: int
    dp_shard: int
    cp: int
    mp: int


def mesh_shape(d: Degrees) -> tuple:
    return (d.replicas, d.shard // d.cp, d.cp, d.mp)


def coords(d: Degrees, rank: int) -> Coords:
    rep, rest = divmod(rank, d.shard * d.mp)
    in_shard, m = divmod(rest, d.mp)
    dp_s, c = divmod(in_shard, d.cp)
    return Coords(rep, dp_s, c, m)


def rank_of(d: Degrees, c: Coords) -> int:
    return ((c.rep * (d.shard // d.cp) + c.dp_shard) * d.cp + c.cp) * d.mp + c.mp


def replicate_groups(d: Degrees) -> List[List[int]]:
    """Ranks holding the same shard in every replica (one list per shard position), ascending."""
    groups = []
    for base in range(d.shard * d.mp):
        groups.append([base + r * d.shard * d.mp for r in range(d.replicas)])
    return groups


def build_mesh(d: Degrees, device_type: str):
    """The 4-D DeviceMesh plus flattened views: `shard` (FSDP), `dp` (all data-parallel ranks with
    this mp rank) and `replica` (one whole model copy); with EP also `rep_mp` (the ranks that
    hold the same shard of what EP does not split: every replica's EP ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, mesh_shape(d), mesh_dim_names=MESH_DIMS)
    mesh["dp_shard", "cp"]._flatten("shard")
    mesh["rep", "dp_shard", "cp"]._flatten("dp")
    mesh["dp_shard", "cp", "mp"]._flatten("replica")
    if d.ep > 1:
        mesh["rep", "mp"]._flatten("rep_mp")
    return mesh


def groups_by_ranks(mesh) -> dict:
    """{sorted global ranks: this rank's group} for every dimension and flattened view of `mesh`."""
    import torch.distributed as dist

    out = {}
    for name in MESH_DIMS + ("shard", "dp", "replica"):
        group = mesh[name].get_group()
        out[tuple(sorted(dist.get_process_group_ranks(group)))] = group
    return out


def background_groups(d: Degrees) -> dict:
    """gloo twins of the layout's groups (and of the world), for checkpoint writes that run in a
    background thread: collectives from two threads must never share a group. Built by every
    rank together (init), since torch names groups by a counter every rank must advance alike."""
    import torch.distributed as dist

    twins = groups_by_ranks(build_mesh(d, "cpu"))
    twins[tuple(range(d.world_size))] = dist.new_group(backend="gloo")
    return twins
