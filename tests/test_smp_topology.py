"""Rank placement (SPEC §4) and the groups derived from it: formula checks in-process, the SPEC
table and every D/P/T permutation through `smp.init` in real 8-process runs."""

from __future__ import annotations

import itertools

import pytest

from smshim.modelparallel.torch.comm import CommGroup
from smshim.modelparallel.torch.topology import Topology
from smshim.testing import run_ranks

PERMUTATIONS = ["".join(p) for p in itertools.permutations("DPT")]

# SPEC §4, 8 processes, pp=4, dp=2: rank -> (pp_rank, dp_rank).
SPEC_TABLE = {
    "cluster": [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1), (2, 1), (3, 1)],
    "spread": [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)],
}


def _literal(rank: int, order: str, sizes: dict) -> dict:
    """SPEC §4 word for word: stride(X) = product of sizes right of X; x = (rank // stride) % size."""
    coords = {}
    for i, letter in enumerate(order):
        stride = 1
        for right in order[i + 1:]:
            stride *= sizes[right]
        coords[letter] = (rank // stride) % sizes[letter]
    return coords


GROUP_LETTERS = {CommGroup.WORLD: "DPT", CommGroup.PP_GROUP: "P", CommGroup.TP_GROUP: "T",
                 CommGroup.RDP_GROUP: "D", CommGroup.DP_GROUP: "DT", CommGroup.MP_GROUP: "PT"}


def _expected_group(rank: int, kind: CommGroup, order: str, sizes: dict, size: int) -> list:
    """Ranks sharing every coordinate outside the group's letters, ascending."""
    mine = _literal(rank, order, sizes)
    fixed = [a for a in "DPT" if a not in GROUP_LETTERS[kind]]
    return [r for r in range(size)
            if all(_literal(r, order, sizes)[a] == mine[a] for a in fixed)]


CASES = [(pp, tp, rdp, placement)
         for pp, tp, rdp in [(1, 1, 1), (4, 1, 2), (2, 1, 4), (2, 2, 2), (3, 2, 2), (1, 2, 3), (2, 4, 1)]
         for placement in ["cluster", "spread"] + PERMUTATIONS]


@pytest.mark.parametrize("pp,tp,rdp,placement", CASES)
def test_formula_and_groups(pp, tp, rdp, placement):
    size = pp * tp * rdp
    order = {"cluster": "DPT", "spread": "TPD"}.get(placement, placement)
    sizes = {"P": pp, "T": tp, "D": rdp}
    reference_groups = None
    for rank in range(size):
        t = Topology(rank, size, pp, tp, placement)
        c = _literal(rank, order, sizes)
        assert (t.pp_rank, t.tp_rank, t.rdp_rank) == (c["P"], c["T"], c["D"])
        assert (t.pp_size, t.tp_size, t.rdp_size) == (pp, tp, rdp)
        assert t.dp_size == size // pp and t.mp_size == pp * tp and t.rdp_size == t.dp_size // tp
        for kind in CommGroup:
            group = t.group(kind)
            assert group == _expected_group(rank, kind, order, sizes, size), kind
            assert t.group_size(kind) == len(group)
            assert group.index(rank) == t.group_rank(kind)
        # Single-axis groups: the group rank is the coordinate itself.
        assert t.group_rank(CommGroup.PP_GROUP) == t.pp_rank
        assert t.group_rank(CommGroup.TP_GROUP) == t.tp_rank
        assert t.group_rank(CommGroup.RDP_GROUP) == t.rdp_rank
        assert t.dp_rank == t.group(CommGroup.DP_GROUP).index(rank)
        assert t.mp_rank == t.group(CommGroup.MP_GROUP).index(rank)
        if tp == 1:
            assert t.dp_rank == t.rdp_rank and t.mp_rank == t.pp_rank
            assert t.group(CommGroup.DP_GROUP) == t.group(CommGroup.RDP_GROUP)
            assert t.group(CommGroup.MP_GROUP) == t.group(CommGroup.PP_GROUP)
        # all_groups is the same on every rank and partitions the world.
        groups = {kind: t.all_groups(kind) for kind in CommGroup}
        if reference_groups is None:
            reference_groups = groups
        assert groups == reference_groups
        for kind, gs in groups.items():
            assert sorted(r for g in gs for r in g) == list(range(size)), kind
            assert t.group(kind) in gs
            assert [g[0] for g in gs] == sorted(g[0] for g in gs)


def test_spec_table_in_process():
    for placement, table in SPEC_TABLE.items():
        got = [(Topology(r, 8, 4, 1, placement).pp_rank, Topology(r, 8, 4, 1, placement).dp_rank)
               for r in range(8)]
        assert got == table, placement


def test_tp_example_from_docstring():
    # "DPT", tp=2, pp=2, rdp=2: rank 5 = (d, p, t) = (1, 0, 1).
    t = Topology(5, 8, 2, 2, "cluster")
    assert (t.rdp_rank, t.pp_rank, t.tp_rank) == (1, 0, 1)
    assert t.mp_rank == 1 and t.dp_rank == 3
    assert t.group(CommGroup.TP_GROUP) == [4, 5]
    assert t.group(CommGroup.MP_GROUP) == [4, 5, 6, 7]
    assert t.group(CommGroup.DP_GROUP) == [0, 1, 4, 5]
    assert t.group(CommGroup.RDP_GROUP) == [1, 5]


@pytest.mark.parametrize("args", [(0, 6, 4, 1, "cluster"), (8, 8, 4, 1, "cluster"),
                                  (0, 8, 4, 1, "DPX"), (0, 8, 4, 1, "DDP")])
def test_bad_topology(args):
    with pytest.raises(ValueError):
        Topology(*args)


# Real processes ---------------------------------------------------------------------------------
def _placement_rank(config):
    import torch
    import torch.distributed as dist

    import smshim.modelparallel.torch as smp

    smp.init(config)
    pgs = {
        "pp": smp.get_pp_process_group(), "dp": smp.get_dp_process_group(),
        "mp": smp.get_mp_process_group(), "tp": smp.get_tp_process_group(),
        "rdp": smp.get_rdp_process_group(), "world": smp.get_world_process_group(),
    }
    pg_ranks = {k: dist.get_process_group_ranks(pg) for k, pg in pgs.items()}
    pg_rank = {k: dist.get_rank(pg) for k, pg in pgs.items()}
    # The groups work: the sum of global ranks over the PP and DP groups.
    sums = {}
    for k in ("pp", "dp"):
        t = torch.tensor([float(smp.rank())])
        dist.all_reduce(t, group=pgs[k])
        sums[k] = t.item()
    return {
        "rank": smp.rank(), "size": smp.size(), "local_rank": smp.local_rank(),
        "local_size": smp.local_size(),
        "pp": (smp.pp_rank(), smp.pp_size()), "dp": (smp.dp_rank(), smp.dp_size()),
        "tp": (smp.tp_rank(), smp.tp_size()), "rdp": (smp.rdp_rank(), smp.rdp_size()),
        "mp": (smp.mp_rank(), smp.mp_size()),
        "groups": {"pp": smp.get_pp_group(), "dp": smp.get_dp_group(), "mp": smp.get_mp_group(),
                   "tp": smp.get_tp_group(), "rdp": smp.get_rdp_group()},
        "pg_ranks": pg_ranks, "pg_rank": pg_rank, "sums": sums,
    }


def _check_common(results, size, pp):
    for r, res in enumerate(results):
        assert res["rank"] == r and res["size"] == size
        assert res["local_rank"] == r and res["local_size"] == size
        assert res["tp"] == (0, 1) and res["groups"]["tp"] == [r]
        assert res["pp"][1] == pp and res["dp"][1] == size // pp
        assert res["rdp"] == res["dp"] and res["mp"] == res["pp"]
        for k in ("pp", "dp", "mp", "tp", "rdp"):
            assert res["pg_ranks"][k] == res["groups"][k], k
        assert res["pg_rank"]["pp"] == res["pp"][0]
        assert res["pg_rank"]["dp"] == res["dp"][0]
        assert res["pg_ranks"]["world"] == list(range(size))
        assert res["sums"]["pp"] == sum(res["groups"]["pp"])
        assert res["sums"]["dp"] == sum(res["groups"]["dp"])


@pytest.mark.parametrize("placement", ["cluster", "spread"])
def test_spec_table_8_processes(placement):
    results = run_ranks(_placement_rank, 8,
                        {"partitions": 4, "ddp": True, "placement_strategy": placement},
                        timeout=120)
    _check_common(results, 8, 4)
    table = SPEC_TABLE[placement]
    for r, res in enumerate(results):
        assert (res["pp"][0], res["dp"][0]) == table[r]
        # Groups straight from the table: same dp_rank -> PP group; same pp_rank -> DP group.
        assert res["groups"]["pp"] == [q for q in range(8) if table[q][1] == table[r][1]]
        assert res["groups"]["dp"] == [q for q in range(8) if table[q][0] == table[r][0]]


@pytest.mark.parametrize("order", PERMUTATIONS)
def test_permutations_8_processes(order):
    results = run_ranks(_placement_rank, 8,
                        {"pipeline_parallel_degree": 2, "ddp": True, "placement_strategy": order},
                        timeout=120)
    _check_common(results, 8, 2)
    sizes = {"P": 2, "T": 1, "D": 4}
    for r, res in enumerate(results):
        c = _literal(r, order, sizes)
        assert res["pp"][0] == c["P"] and res["dp"][0] == c["D"]
        assert res["groups"]["pp"] == _expected_group(r, CommGroup.PP_GROUP, order, sizes, 8)
        assert res["groups"]["dp"] == _expected_group(r, CommGroup.DP_GROUP, order, sizes, 8)
