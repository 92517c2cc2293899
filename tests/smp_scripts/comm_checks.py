"""smp object-communication checks, run on every rank: by tests/test_smp_comm.py through run_ranks
(torchrun-style environment) and by smp_comm_main.py under mpirun. Every check asserts on the
rank itself; the returned summary lets the test cross-check the ranks."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch


def check_all(config: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    import smdistributed.modelparallel.torch as smp
    from smshim.modelparallel.torch.errors import SMPValidationError

    at_import = smp.is_initialized()
    if not at_import:
        smp.init(config)
    me, size = smp.rank(), smp.size()
    kinds = [
        (smp.WORLD, smp.WORLD_RANK, list(range(size))),
        (smp.PP_GROUP, smp.PP_RANK, smp.get_pp_group()),
        (smp.TP_GROUP, smp.TP_RANK, smp.get_tp_group()),
        (smp.RDP_GROUP, smp.RDP_RANK, smp.get_rdp_group()),
        (smp.DP_GROUP, smp.DP_RANK, smp.get_dp_group()),
        (smp.MP_GROUP, smp.MP_RANK, smp.get_mp_group()),
    ]
    gathered = {}
    for group, rtype, members in kinds:
        n, gr = len(members), members.index(me)
        # allgather: Python objects, in group-rank order.
        objs = smp.allgather({"rank": me, "group": group.name, "payload": list(range(me))}, group)
        assert objs == [{"rank": m, "group": group.name, "payload": list(range(m))}
                        for m in members], (group.name, objs)
        gathered[group.name] = [o["rank"] for o in objs]
        # allgather: tensors come back as tensors (shape and dtype differ per rank).
        ts = smp.allgather(torch.full((gr + 1, 2), float(me), dtype=torch.float64), group)
        assert len(ts) == n
        for g, (m, t) in enumerate(zip(members, ts)):
            assert isinstance(t, torch.Tensor) and t.dtype == torch.float64, (group.name, t)
            assert t.shape == (g + 1, 2) and bool((t == m).all()), (group.name, g, t)
        ints = smp.allgather(torch.tensor([me], dtype=torch.int32), group)
        assert torch.equal(torch.cat(ints), torch.tensor(members, dtype=torch.int32))
        # broadcast from every group rank in turn, received with recv_from(root, rank_type).
        for root in range(n):
            if gr == root:
                smp.broadcast(("bcast", group.name, root, torch.arange(3) * me), group)
            else:
                got = smp.recv_from(root, rtype)
                assert got[:3] == ("bcast", group.name, root), got
                assert torch.equal(got[3], torch.arange(3) * members[root])
        # send/recv_from around a ring of the group: both sends go out before any receive.
        if n > 1:
            nxt, prv = (gr + 1) % n, (gr - 1) % n
            smp.send({"from": me, "seq": 0}, nxt, rtype)
            smp.send(torch.tensor([me, 1]), nxt, rtype)
            first, second = smp.recv_from(prv, rtype), smp.recv_from(prv, rtype)
            assert first == {"from": members[prv], "seq": 0}, first
            assert torch.equal(second, torch.tensor([members[prv], 1])), second
        smp.barrier(group)
    for b in (smp.barrier, smp.dp_barrier, smp.pp_barrier, smp.mp_barrier, smp.tp_barrier,
              smp.rdp_barrier):
        b()
    # Every rank sends to every other rank, then receives: buffered sends cannot deadlock.
    others = [r for r in range(size) if r != me]
    for dst in others:
        smp.send(("a2a", me, dst, torch.ones(1000) * me), dst, smp.WORLD_RANK)
    for src in others:
        got = smp.recv_from(src, smp.RankType.WORLD_RANK)
        assert got[:3] == ("a2a", src, me) and torch.equal(got[3], torch.ones(1000) * src)
    # Misuse is reported locally, naming the rank.
    errors = []
    for call in (lambda: smp.recv_from(size, smp.WORLD_RANK),
                 lambda: smp.send("x", smp.pp_rank(), smp.PP_RANK),
                 lambda: smp.allgather(1, "DP")):
        try:
            call()
        except SMPValidationError as e:
            errors.append(str(e))
    assert len(errors) == 3, errors
    smp.barrier()
    return {"rank": me, "size": size, "at_import": at_import, "pp_rank": smp.pp_rank(),
            "dp_rank": smp.dp_rank(), "gathered": gathered, "errors": errors,
            "pipeline_parallel_degree": smp.state.cfg.pipeline_parallel_degree,
            "local_rank": smp.local_rank(), "launcher": smp.state.launch.launcher,
            "master_port": os.environ.get("MASTER_PORT")}
