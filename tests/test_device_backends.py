"""Which backend the groups that carry tensor-parallel and data-parallel tensors use: gloo on the
CPU, NCCL when the job computes on GPUs (checked on CPU by recording the groups asked for)."""

import datetime

import pytest
import torch.distributed as dist

import smshim.modelparallel.torch as smp_torch
from smshim.modelparallel.torch.comm import CommGroup
from smshim.modelparallel.torch.tensor_parallel import collectives
from smshim.modelparallel.torch.topology import Topology

TMO = datetime.timedelta(seconds=10)


@pytest.fixture
def new_groups(monkeypatch):
    """dist.new_group, recording (members, backend or None) and returning a token."""
    asked = []

    def new_group(ranks=None, timeout=None, backend=None, **kwargs):
        asked.append((tuple(ranks) if ranks is not None else None, backend))
        return f"group{len(asked)}"

    monkeypatch.setattr(dist, "new_group", new_group)
    yield asked
    collectives._mb_groups.clear()


def test_tensor_parallel_microbatch_groups_are_gloo_on_cpu(new_groups):
    collectives.create_groups([[0, 1], [2, 3]], [2, 3], 3, TMO)
    assert collectives.group_backend() == "gloo"
    assert new_groups == [((0, 1), "gloo"), ((2, 3), "gloo")] * 3
    assert collectives._mb_groups == {0: "group2", 1: "group4", 2: "group6"}


def test_tensor_parallel_microbatch_groups_are_nccl_on_gpus(new_groups, monkeypatch):
    monkeypatch.setattr(collectives._devices, "device_backend", lambda: "nccl")
    collectives.create_groups([[0, 1], [2, 3]], [0, 1], 2, TMO)
    assert {backend for _, backend in new_groups} == {"nccl"} and len(new_groups) == 4


def test_tensor_parallel_groups_fall_back_to_gloo_when_ranks_share_a_gpu(new_groups, monkeypatch):
    monkeypatch.setattr(collectives._devices, "device_backend", lambda: None)
    collectives.create_groups([[0, 1]], [0, 1], 2, TMO)
    assert {backend for _, backend in new_groups} == {"gloo"}


def test_data_parallel_groups_take_the_default_backend(new_groups, monkeypatch):
    """The gradient reducer reduces over state.process_group(DP_GROUP / RDP_GROUP): groups made
    with the default group's backend (NCCL under an NCCL job), not gloo; only the object-message
    group is gloo whatever the default."""
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: object())
    monkeypatch.setattr(dist, "PrefixStore", lambda prefix, store: (prefix, store))
    topo = Topology(0, 8, 2, 2)
    groups, object_group, _ = smp_torch._create_groups(topo)
    assert new_groups[0] == (None, "gloo") and object_group == "group1"
    assert all(backend is None for _, backend in new_groups[1:])
    dp = tuple(topo.group(CommGroup.DP_GROUP))
    rdp = tuple(topo.group(CommGroup.RDP_GROUP))
    assert dp in [m for m, _ in new_groups] and rdp in [m for m, _ in new_groups]
    assert groups[CommGroup.DP_GROUP] != groups[CommGroup.TP_GROUP]
