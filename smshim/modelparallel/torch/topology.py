"""Where each rank sits: the exact rank placement of SPEC §4 and the groups that follow from it.

Axes. A job of `size` ranks is a 3-d grid with axes
    P  pipeline,                 size pp_size
    T  tensor parallel,          size tp_size
    D  reduced data parallel,    size rdp_size = size // (pp_size * tp_size)
`placement` orders the axes: "cluster" = "DPT", "spread" = "TPD", or any permutation of D, P, T.
The right-most letter varies fastest: stride(X) = product of the sizes of the letters right of X,
and the coordinate along X is `(rank // stride(X)) % size(X)`. So pp_rank, tp_rank and rdp_rank
are the P, T and D coordinates.

Groups. Each group kind is the set of axes along which its members differ; they share every other
coordinate:
    WORLD {D, P, T}   PP_GROUP {P}   TP_GROUP {T}   RDP_GROUP {D}
    DP_GROUP {D, T}   (all ranks of one pipeline stage: dp_size = rdp_size * tp_size = size // pp)
    MP_GROUP {P, T}   (one model replica: mp_size = pp_size * tp_size)
This is SPEC §2's "pp·dp = size, mp = pp·tp, rdp = dp/tp": tensor parallelism is carved out of
data parallelism, and the RDP group links the ranks holding the same tensor-parallel shard.

Group ranks. A rank's rank in a group is its position in the group's members sorted by global
rank; equivalently, the mixed-radix number formed by its coordinates along the group's axes, taken
in placement order (left-most most significant). This is the order torch.distributed.new_group
gives its ranks, so `smp.dp_rank() == dist.get_rank(smp.get_dp_process_group())`, and for the
single-axis groups it is exactly the coordinate (pp_rank, tp_rank, rdp_rank). With tp = 1:
dp_rank == rdp_rank and mp_rank == pp_rank. Example with tp = 2, pp = 2, rdp = 2 under "DPT":
rank 5 has (d, p, t) = (1, 0, 1), mp_rank = p*2 + t = 1, dp_rank = d*2 + t = 3.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property
from typing import Dict, FrozenSet, List


class CommGroup(enum.IntEnum):
    WORLD = 0
    PP_GROUP = 1
    TP_GROUP = 2
    RDP_GROUP = 3
    DP_GROUP = 4
    MP_GROUP = 5


class RankType(enum.IntEnum):
    """Which group a rank number refers to; same values as the matching CommGroup."""

    WORLD_RANK = 0
    PP_RANK = 1
    TP_RANK = 2
    RDP_RANK = 3
    DP_RANK = 4
    MP_RANK = 5


__all__ = ["Topology", "placement_order", "GROUP_AXES", "CommGroup", "RankType"]

_NAMED = {"cluster": "DPT", "spread": "TPD"}

GROUP_AXES: Dict[CommGroup, FrozenSet[str]] = {
    CommGroup.WORLD: frozenset("DPT"),
    CommGroup.PP_GROUP: frozenset("P"),
    CommGroup.TP_GROUP: frozenset("T"),
    CommGroup.RDP_GROUP: frozenset("D"),
    CommGroup.DP_GROUP: frozenset("DT"),
    CommGroup.MP_GROUP: frozenset("PT"),
}


def placement_order(placement: str) -> str:
    """'cluster' -> 'DPT', 'spread' -> 'TPD', a permutation of D, P, T -> itself (upper case)."""
    order = _NAMED.get(placement.lower(), placement.upper())
    if sorted(order) != ["D", "P", "T"]:
        raise ValueError(
            f"placement_strategy {placement!r} must be 'cluster', 'spread' or a permutation "
            "of D, P, T"
        )
    return order


@dataclass(frozen=True)
class Topology:
    """The placement of `rank` in a job of `size` ranks with the given pipeline/tensor degrees."""

    rank: int
    size: int
    pp_size: int
    tp_size: int
    placement: str = "cluster"

    def __post_init__(self) -> None:
        if self.pp_size < 1 or self.tp_size < 1 or self.size % (self.pp_size * self.tp_size):
            raise ValueError(f"world size {self.size} is not a multiple of pp_size {self.pp_size} "
                             f"x tp_size {self.tp_size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside world size {self.size}")
        placement_order(self.placement)

    # Axes --------------------------------------------------------------------------------------
    @cached_property
    def order(self) -> str:
        return placement_order(self.placement)

    @property
    def rdp_size(self) -> int:
        return self.size // (self.pp_size * self.tp_size)

    @property
    def dp_size(self) -> int:
        return self.rdp_size * self.tp_size

    @property
    def mp_size(self) -> int:
        return self.pp_size * self.tp_size

    def axis_size(self, axis: str) -> int:
        return {"D": self.rdp_size, "P": self.pp_size, "T": self.tp_size}[axis]

    def stride(self, axis: str) -> int:
        s = 1
        for letter in self.order[self.order.index(axis) + 1:]:
            s *= self.axis_size(letter)
        return s

    def coord(self, axis: str, rank: int | None = None) -> int:
        r = self.rank if rank is None else rank
        return (r // self.stride(axis)) % self.axis_size(axis)

    def rank_of(self, coords: Dict[str, int]) -> int:
        """The global rank with the given D/P/T coordinates."""
        return sum(coords[a] * self.stride(a) for a in "DPT")

    # Ranks -------------------------------------------------------------------------------------
    @property
    def pp_rank(self) -> int:
        return self.coord("P")

    @property
    def tp_rank(self) -> int:
        return self.coord("T")

    @property
    def rdp_rank(self) -> int:
        return self.coord("D")

    @property
    def dp_rank(self) -> int:
        return self.group_rank(CommGroup.DP_GROUP)

    @property
    def mp_rank(self) -> int:
        return self.group_rank(CommGroup.MP_GROUP)

    # Groups ------------------------------------------------------------------------------------
    def group_rank(self, kind: CommGroup, rank: int | None = None) -> int:
        """`rank`'s (default: this rank's) rank within its group of `kind`."""
        r = self.rank if rank is None else rank
        n = 0
        for axis in self.order:  # left-most is most significant
            if axis in GROUP_AXES[CommGroup(kind)]:
                n = n * self.axis_size(axis) + self.coord(axis, r)
        return n

    def group_size(self, kind: CommGroup) -> int:
        n = 1
        for axis in GROUP_AXES[CommGroup(kind)]:
            n *= self.axis_size(axis)
        return n

    def group_of(self, kind: CommGroup, rank: int | None = None) -> List[int]:
        """The global ranks of `rank`'s group of `kind`, in group-rank (= ascending) order."""
        r = self.rank if rank is None else rank
        axes = GROUP_AXES[CommGroup(kind)]
        members = [0]
        for axis in self.order:
            if axis in axes:
                members = [m + i * self.stride(axis) for m in members
                           for i in range(self.axis_size(axis))]
            else:
                members = [m + self.coord(axis, r) * self.stride(axis) for m in members]
        return sorted(members)

    def group(self, kind: CommGroup) -> List[int]:
        """This rank's group of `kind`: global ranks in group-rank order."""
        return self.group_of(kind)

    def all_groups(self, kind: CommGroup) -> List[List[int]]:
        """Every group of `kind`, ordered by lowest member: the same list on every rank."""
        seen: Dict[int, List[int]] = {}
        for r in range(self.size):
            g = self.group_of(kind, r)
            seen.setdefault(g[0], g)
        return [seen[k] for k in sorted(seen)]
