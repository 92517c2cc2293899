"""The "smddp" torch.distributed backend: native torch DDP on it, under torchrun-style env and
mpirun."""

from __future__ import annotations

import os
import re
import sys

import torch

from smshim.testing import run_command, run_ranks
from tests.test_dp_ddp import _model, train_and_compare

SCRIPTS = os.path.join(os.path.dirname(__file__), "dp_scripts")


def _torch_ddp_on_smddp():
    import torch.distributed as tdist

    import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401  registers the backend
    from smshim.dataparallel.torch import distributed as smddp

    tdist.init_process_group(backend="smddp")
    rank, world = tdist.get_rank(), tdist.get_world_size()
    net = _model(seed=0)
    model = torch.nn.parallel.DistributedDataParallel(net)
    diff = train_and_compare(model, net, rank, world)
    # The smddp function API runs on the same default group.
    t = torch.tensor([float(rank)])
    smddp.all_reduce(t, op=smddp.ReduceOp.AVERAGE)
    # A subgroup also gets the smddp backend.
    sub = tdist.new_group([0, 1])
    u = torch.tensor([rank + 1.0])
    if rank in (0, 1):
        tdist.all_reduce(u, group=sub)
    sub_backend = tdist.get_backend(sub) if rank < 2 else None
    local = int(os.environ["SMDATAPARALLEL_LOCAL_RANK"])
    return diff, tdist.get_backend(), sub_backend, t.item(), u.item(), local


def test_torch_ddp_on_smddp_backend_matches_single_process():
    for rank, (diff, backend, sub_backend, avg, sub_sum, local) in enumerate(
            run_ranks(_torch_ddp_on_smddp, 3, timeout=90)):
        assert diff < 1e-5
        assert local == rank  # one host: local rank = rank
        assert backend == "smddp"
        assert avg == 1.0  # mean of 0, 1, 2
        if rank < 2:
            assert sub_backend == "smddp" and sub_sum == 3.0


def test_smddp_backend_under_mpirun():
    """No RANK/MASTER_*: importing torch_smddp exports them from MPI (port shared by rank 0)."""
    script = os.path.join(SCRIPTS, "smddp_torch_ddp.py")
    out = run_command(["mpirun", "-n", "2", sys.executable, script], timeout=120).stdout
    pattern = r"RESULT (\d+) (\d\.\d{3}e[+-]\d+) (mpich|openmpi|torchrun|single)"
    found = {r: (d, launcher) for r, d, launcher in re.findall(pattern, out)}
    assert sorted(found) == ["0", "1"], out
    for rank, (diff, launcher) in found.items():
        assert float(diff) < 1e-5 and launcher == "mpich", (rank, diff, launcher)
