"""smdistributed.dataparallel.torch.distributed: every collective gives the right values."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from smshim.testing import run_command, run_ranks


def _collectives():
    import smdistributed.dataparallel.torch.distributed as dist

    try:
        dist.get_rank()
        early = "no error"
    except RuntimeError as e:
        early = str(e)
    dist.init_process_group()
    dist.init_process_group()  # a second call is harmless
    r, n = dist.get_rank(), dist.get_world_size()
    out = {"early": early, "available": dist.is_available(), "init": dist.is_initialized(),
           "rank": r, "size": n, "rank_world": dist.get_rank(dist.group.WORLD),
           "size_world": dist.get_world_size(group=dist.group.WORLD),
           "local": (dist.get_local_rank(), dist.get_local_size())}

    def reduced(value, op, **kw):
        t = torch.tensor([value, -value], dtype=torch.float64)
        work = dist.all_reduce(t, op=op, **kw)
        return t, work

    out["sum"] = reduced(r + 1.0, dist.ReduceOp.SUM)[0].tolist()
    out["avg"] = reduced(r + 1.0, dist.ReduceOp.AVERAGE)[0].tolist()
    out["min"] = reduced(r + 1.0, dist.ReduceOp.MIN)[0].tolist()
    out["max"] = reduced(r + 1.0, dist.ReduceOp.MAX)[0].tolist()
    out["default_op"] = reduced(r + 1.0, dist.ReduceOp.SUM)[0].tolist()
    out["torch_avg"] = reduced(r + 1.0, torch.distributed.ReduceOp.AVG)[0].tolist()
    ints = torch.tensor([2 * r], dtype=torch.int64)
    dist.all_reduce(ints, op=dist.ReduceOp.AVERAGE)
    out["int_avg"] = ints.item()
    # Asynchronous: the value is right once wait() returns (AVERAGE divides on completion).
    t, work = reduced(r + 1.0, dist.ReduceOp.AVERAGE, async_op=True)
    out["async_wait_ret"] = work.wait()
    out["async_avg"] = t.tolist()
    out["async_avg_twice"] = (work.wait(), t.tolist())[1]  # no second division
    t, work = reduced(r + 1.0, dist.ReduceOp.AVERAGE, async_op=True)
    while not work.is_completed():
        pass
    out["async_avg_polled"] = t.tolist()
    t, work = reduced(r + 1.0, dist.ReduceOp.AVERAGE, async_op=True)
    out["async_avg_future"] = work.get_future().wait()[0].tolist()
    t, work = reduced(r + 1.0, dist.ReduceOp.MAX, async_op=True)
    work.wait()
    out["async_max"] = t.tolist()
    # broadcast from the last rank, sync and async
    b = torch.full((3,), float(r))
    dist.broadcast(b, src=n - 1)
    out["bcast"] = b.tolist()
    b = torch.full((2,), float(r))
    dist.broadcast(b, src=0, async_op=True).wait()
    out["bcast_async"] = b.tolist()
    # all_gather into pre-sized outputs
    outs = [torch.zeros(2) for _ in range(n)]
    dist.all_gather(outs, torch.tensor([r, 10.0 * r]))
    out["gather"] = [o.tolist() for o in outs]
    outs = [torch.zeros(1) for _ in range(n)]
    dist.all_gather(outs, torch.tensor([r + 0.5]), async_op=True).wait()
    out["gather_async"] = [o.item() for o in outs]
    # all_to_all_single, equal splits: rank r sends 10*r + j to rank j
    inp = torch.arange(n, dtype=torch.float32) + 10 * r
    res = torch.empty(n)
    dist.all_to_all_single(res, inp)
    out["a2a"] = res.tolist()
    # with split sizes: rank r sends j+1 copies of 100*r + j to rank j
    inp = torch.cat([torch.full((j + 1,), 100.0 * r + j) for j in range(n)])
    res = torch.empty(n * (r + 1))
    dist.all_to_all_single(res, inp, output_split_sizes=[r + 1] * n,
                           input_split_sizes=list(range(1, n + 1)))
    out["a2a_split"] = res.tolist()
    res = torch.empty(n)
    dist.all_to_all_single(res, torch.arange(n, dtype=torch.float32) + 10 * r,
                           async_op=True).wait()
    out["a2a_async"] = res.tolist()
    # reduce onto one rank
    t = torch.tensor([r + 1.0])
    dist.reduce(t, n - 1, op=dist.ReduceOp.SUM)
    out["reduce_sum"] = t.item() if r == n - 1 else None
    t = torch.tensor([r + 1.0])
    dist.reduce(t, 0, op=dist.ReduceOp.AVERAGE)
    out["reduce_avg"] = t.item() if r == 0 else None
    t = torch.tensor([r + 1.0])
    dist.reduce(t, 0, op=dist.ReduceOp.AVERAGE, async_op=True).wait()
    out["reduce_avg_async"] = t.item() if r == 0 else None
    dist.barrier()
    dist.barrier(async_op=True).wait()
    # misuse: clear errors, no collective started
    for name, call in [("bad_group", lambda: dist.all_reduce(torch.ones(1), group="everyone")),
                       ("bad_op", lambda: dist.all_reduce(torch.ones(1), op="mean"))]:
        try:
            call()
            out[name] = "no error"
        except (TypeError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    # a group other than WORLD: ranks 0 and 1
    sub = dist.new_group([0, 1])
    if r < 2:
        t = torch.tensor([float(r)])
        dist.all_reduce(t, op=dist.ReduceOp.AVERAGE, group=sub)
        out["sub_avg"] = t.item()
        t = torch.tensor([float(r)])
        dist.all_reduce(t, op=dist.ReduceOp.AVERAGE, group=sub, async_op=True).wait()
        out["sub_avg_async"] = t.item()
        out["sub_rank"] = (dist.get_rank(sub), dist.get_world_size(sub))
        dist.barrier(group=sub)
    else:
        try:
            dist.all_reduce(torch.ones(1), group=sub)
            out["sub_outsider"] = "no error"
        except ValueError as e:
            out["sub_outsider"] = str(e)
    dist.barrier()
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_collectives(n):
    _check_collectives(run_ranks(_collectives, n, timeout=90), n)


def test_collectives_under_mpirun(tmp_path):
    """The same checks with rank, size and rendezvous coming from MPI (port shared by rank 0)."""
    script = os.path.join(os.path.dirname(__file__), "dp_scripts", "collectives.py")
    run_command(["mpirun", "-n", "2", sys.executable, script, str(tmp_path)], timeout=120)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for o in results:  # JSON turns tuples into lists
        for key in ("local", "sub_rank"):
            if key in o:
                o[key] = tuple(o[key])
    _check_collectives(results, 2)


def _check_collectives(results, n):
    total = n * (n + 1) / 2
    mean = (n + 1) / 2
    for r, o in enumerate(results):
        assert "before init_process_group" in o["early"]
        assert o["available"] and o["init"]
        assert (o["rank"], o["size"], o["rank_world"], o["size_world"]) == (r, n, r, n)
        assert o["local"] == (r, n)
        assert o["sum"] == o["default_op"] == [total, -total]
        assert o["avg"] == o["torch_avg"] == [mean, -mean]
        assert o["min"] == [1.0, -n]
        assert o["max"] == [n, -1.0]
        assert o["int_avg"] == n - 1
        assert o["async_wait_ret"] is True
        assert o["async_avg"] == o["async_avg_twice"] == o["async_avg_polled"] == [mean, -mean]
        assert o["async_avg_future"] == [mean, -mean]
        assert o["async_max"] == [n, -1.0]
        assert o["bcast"] == [n - 1.0] * 3
        assert o["bcast_async"] == [0.0, 0.0]
        assert o["gather"] == [[j, 10.0 * j] for j in range(n)]
        assert o["gather_async"] == [j + 0.5 for j in range(n)]
        assert o["a2a"] == o["a2a_async"] == [10.0 * j + r for j in range(n)]
        assert o["a2a_split"] == [100.0 * j + r for j in range(n) for _ in range(r + 1)]
        assert o["reduce_sum"] == (total if r == n - 1 else None)
        assert o["reduce_avg"] == o["reduce_avg_async"] == (mean if r == 0 else None)
        assert o["bad_group"].startswith("TypeError") and "'everyone'" in o["bad_group"]
        assert o["bad_op"].startswith("ValueError") and "'mean'" in o["bad_op"]
        if r < 2:
            assert o["sub_avg"] == o["sub_avg_async"] == 0.5
            assert o["sub_rank"] == (r, 2)
        else:
            assert "not a member" in o["sub_outsider"]


def _reduce_op_members():
    import smdistributed.dataparallel.torch.distributed as dist

    return sorted(m.name for m in dist.ReduceOp), dist.group.WORLD is not None


def test_reduce_op_members():
    members, has_world = _reduce_op_members()
    assert members == ["AVERAGE", "MAX", "MIN", "SUM"]
    assert has_world


def _single():
    import os

    import smdistributed.dataparallel.torch.distributed as dist

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k)
    avail = dist.is_available()
    dist.init_process_group()
    t = torch.tensor([3.0])
    dist.all_reduce(t, op=dist.ReduceOp.AVERAGE)
    w = dist.all_reduce(torch.tensor([1.0]), op=dist.ReduceOp.AVERAGE, async_op=True)
    w.wait()
    return avail, dist.get_rank(), dist.get_world_size(), dist.get_local_rank(), t.item()


def test_single_process_without_launcher():
    assert run_ranks(_single, 1, timeout=60)[0] == (False, 0, 1, 0, 3.0)
