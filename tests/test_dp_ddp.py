"""smdistributed.dataparallel DistributedDataParallel and the gradient reducer behind it."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

from smshim.testing import run_command, run_ranks

SCRIPTS = os.path.join(os.path.dirname(__file__), "dp_scripts")

IN, HID, OUT, LOCAL_BATCH = 6, 10, 3, 4


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, HID),
                            torch.nn.Tanh(), torch.nn.Linear(HID, OUT))
    m.register_buffer("shift", torch.full((OUT,), float(seed)))
    return m


def _batch(step: int, micro: int, world: int):
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(world * LOCAL_BATCH, IN, generator=g)
    y = torch.randn(world * LOCAL_BATCH, OUT, generator=g)
    return x, y


def _reference(world: int):
    """Single process on the union of every rank's data: 3 Adam steps, then a 2-microbatch step.

    Returns the model and the gradients seen by each step (Adam is nearly invariant to gradient
    scale, so the parameters alone would not tell an average from a sum).
    """
    model = _model(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    grads = []
    for step in range(4):
        opt.zero_grad()
        for micro in range(2 if step == 3 else 1):
            x, y = _batch(step, micro, world)
            torch.nn.functional.mse_loss(model(x) + model.shift, y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return model, grads


def train_and_compare(model, net, rank: int, world: int) -> float:
    """4 Adam steps (the last with a no_sync accumulation microbatch) on this rank's shard;
    returns the max abs difference of parameters and of every step's gradients from
    single-process training on all ranks' data."""
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    grads = []
    for step in range(4):
        opt.zero_grad()
        if step == 3:  # gradient accumulation: first microbatch without communication
            x, y = _batch(step, 0, world)
            with model.no_sync():
                torch.nn.functional.mse_loss(model(x[sl]) + net.shift, y[sl]).backward()
            x, y = _batch(step, 1, world)
        else:
            x, y = _batch(step, 0, world)
        torch.nn.functional.mse_loss(model(x[sl]) + net.shift, y[sl]).backward()
        grads.append([p.grad.clone() for p in net.parameters()])
        opt.step()
    ref, ref_grads = _reference(world)
    diff = max((a - b).abs().max().item() for a, b in zip(net.parameters(), ref.parameters()))
    for mine, theirs in zip(grads, ref_grads):
        diff = max([diff] + [(a - b).abs().max().item() for a, b in zip(mine, theirs)])
    return diff


def _train_ddp(bucket_cap_mb):
    """Each rank starts from a different init (rank 0's must win) and trains on its shard."""
    from smshim.dataparallel.torch import distributed as dist
    from smshim.dataparallel.torch.parallel import DistributedDataParallel as DDP

    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    net = _model(seed=rank)  # differing parameters and buffer: rank 0's are broadcast
    model = DDP(net, bucket_cap_mb=bucket_cap_mb)
    assert model.module is net
    diff = train_and_compare(model, net, rank, world)
    keys = list(model.state_dict().keys())
    torch_keys = list(torch.nn.parallel.DistributedDataParallel(_model(0)).state_dict().keys())
    return diff, float(net.shift[0]), keys == torch_keys, len(model.reducer.buckets), keys


@pytest.mark.parametrize("nprocs,bucket_cap_mb", [(2, None), (4, 0.00001)])
def test_ddp_matches_single_process(nprocs, bucket_cap_mb):
    results = run_ranks(_train_ddp, nprocs, bucket_cap_mb, timeout=120)
    for diff, shift, same_keys, nbuckets, keys in results:
        assert diff < 1e-5
        assert shift == 0.0  # rank 0's buffer
        assert same_keys, keys
        assert keys[0].startswith("module.")
        assert nbuckets == (1 if bucket_cap_mb is None else 6)


def test_ddp_under_mpirun():
    script = os.path.join(SCRIPTS, "ddp_train.py")
    out = run_command(["mpirun", "-n", "2", sys.executable, script], timeout=120).stdout
    # mpirun may interleave the ranks' lines, so match the records rather than lines.
    found = dict(re.findall(r"RESULT (\d+) (\d\.\d{3}e[+-]\d+)", out))
    assert sorted(found) == ["0", "1"], out
    assert all(float(d) < 1e-5 for d in found.values()), found


def _mismatched():
    from smshim.dataparallel.torch import distributed as dist
    from smshim.dataparallel.torch.parallel import DistributedDataParallel as DDP

    dist.init_process_group()
    rank = dist.get_rank()
    width = 5 if rank == 1 else 4  # rank 1 builds a different second layer
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, width))
    try:
        DDP(net)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_mismatched_parameters_raise_on_every_rank():
    msgs = run_ranks(_mismatched, 3, timeout=60)
    for m in msgs:
        assert "differs across ranks" in m, m
        assert "'1.weight'" in m and "rank 1" in m, m


def _unused(find_unused: bool, world_size_one: bool):
    from smshim.reducer.grad_reducer import GradReducer
    from smshim.dataparallel.torch import distributed as dist
    from smshim.dataparallel.torch.parallel import DistributedDataParallel as DDP

    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.used = torch.nn.Linear(3, 3)
            self.sometimes = torch.nn.Linear(3, 3)  # used on rank 0 only
            self.never = torch.nn.Linear(3, 3)

        def forward(self, x):
            out = self.used(x)
            return self.sometimes(out) if rank == 0 else out

    net = Net()
    x = torch.full((2, 3), float(rank + 1))
    if not find_unused:
        model = DDP(net)
        try:
            model(x).sum().backward()
        except RuntimeError as e:
            return str(e)
        return "no error"
    named = list(net.named_parameters())
    reducer = GradReducer([p for _, p in named], None, names=[n for n, _ in named],
                          find_unused_parameters=True, bucket_cap_mb=0.00005)
    reducer.prepare_for_backward()
    net(x).sum().backward()
    # Single process on the union: rank 0's input goes through `sometimes`, the others' do not.
    ref = Net()
    total = 0
    for r in range(world):
        xr = torch.full((2, 3), float(r + 1))
        h = ref.used(xr)
        total = total + (ref.sometimes(h) if r == 0 else h).sum()
    (total / world).backward()
    out = {}
    for (n, p), (_, q) in zip(named, ref.named_parameters()):
        out[n] = None if p.grad is None else (p.grad - q.grad).abs().max().item()
        assert (p.grad is None) == (q.grad is None), n
    return out


def test_unused_parameter_error_names_it():
    msgs = run_ranks(_unused, 2, False, False, timeout=60)
    for m in msgs:
        assert "never.weight" in m and "never.bias" in m, m
        assert "sometimes.weight" in m and "1 of 2 ranks" in m, m
        assert "'used.weight'" not in m, m


def _backward_reaches_no_parameter():
    import time

    from smshim.dataparallel.torch import distributed as dist
    from smshim.dataparallel.torch.parallel import DistributedDataParallel as DDP

    dist.init_process_group()
    rank = dist.get_rank()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x, skip):
            return x * 2 if skip else self.lin(x)  # data-dependent: no parameter on this path

    model = DDP(Net())
    for step in (1, 2, 3):
        x = torch.ones(2, 3, requires_grad=True)
        t0 = time.monotonic()
        try:
            out = model(x, skip=(rank == 1 and step == 2))
            out.mul_(1.0)  # the outputs stay the user's: in-place works as without DDP
            out.sum().backward()
        except RuntimeError as e:
            return step, time.monotonic() - t0, str(e)
    return None, None, "no error"


def test_backward_reaching_no_parameter_fails_every_rank_quickly():
    """Rank 1's step-2 backward reaches no parameter: every rank raises within seconds, naming
    rank 1 and the step, instead of rank 0 waiting until SMSHIM_TIMEOUT (set to 600 s here)."""
    out = run_ranks(_backward_reaches_no_parameter, 2, timeout=90, env={"SMSHIM_TIMEOUT": "600"})
    for step, seconds, msg in out:
        assert step == 2, msg
        assert seconds < 30, seconds
        assert "rank 1: its backward reached no parameter" in msg, msg
        assert "synced backward #2" in msg and "'lin.weight'" in msg, msg


def test_find_unused_parameters_treats_missing_as_zero():
    for out in run_ranks(_unused, 2, True, False, timeout=60):
        assert out["never.weight"] is None and out["never.bias"] is None
        for name in ("used.weight", "used.bias", "sometimes.weight", "sometimes.bias"):
            assert out[name] < 1e-6, (name, out)


def test_world_size_one_trains_and_checks_unused():
    """One process, no launcher: DDP is a passthrough that still reports unused parameters."""
    results = run_ranks(_train_ddp, 1, None, timeout=60)
    assert results[0][0] < 1e-6
    msg = run_ranks(_unused, 1, False, True, timeout=60)[0]
    assert "never.weight" in msg and "sometimes.weight" not in msg


def _world_one_no_comm():
    """world size 1 sends nothing: a process group whose collectives fail proves it."""
    from smshim.reducer.grad_reducer import GradReducer
    from smshim.dataparallel.torch.parallel import DistributedDataParallel as DDP

    os.environ.pop("RANK"), os.environ.pop("WORLD_SIZE")
    os.environ.pop("MASTER_ADDR"), os.environ.pop("MASTER_PORT")
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    model = DDP(net)  # initialises a lone process group itself
    calls = []
    real = torch.distributed.all_reduce
    torch.distributed.all_reduce = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        model(torch.ones(3, 4)).sum().backward()
    finally:
        torch.distributed.all_reduce = real
    assert isinstance(model.reducer, GradReducer)
    return len(calls), net.weight.grad.tolist()


def test_world_size_one_does_not_communicate():
    calls, grad = run_ranks(_world_one_no_comm, 1, timeout=60)[0]
    assert calls == 0
    assert grad == [[3.0] * 4] * 2


def _reducer_variants(view: bool, hook: str, big: bool = False):
    """The reducer on its own, as the pipeline engine uses it: view mode, hooks, finalize()."""
    import torch.distributed as tdist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from smshim.reducer.grad_reducer import GradReducer
    from smshim.dataparallel.torch import distributed as dist

    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if big:  # 90000-element weights: buckets filled tensor by tensor as gradients arrive
        net = torch.nn.Sequential(torch.nn.Linear(5, 300), torch.nn.Tanh(),
                                  torch.nn.Linear(300, 300), torch.nn.Tanh(),
                                  torch.nn.Linear(300, 2))
    else:
        net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 2))
    params = list(net.parameters())
    reducer = GradReducer(params, None, bucket_cap_mb=0.00001, gradient_as_bucket_view=view)
    seen = []
    if hook == "torch_allreduce":
        reducer.register_comm_hook(None, default_hooks.allreduce_hook)
    elif hook == "user":
        def doubled_sum(state, bucket):  # a user hook: sum, then scale by 2 (not an average)
            seen.append((bucket.index(), len(bucket.parameters()), bucket.is_last()))
            state.append(bucket.index())
            fut = tdist.all_reduce(bucket.buffer(), async_op=True).get_future()
            return fut.then(lambda f: f.value()[0] * 2)
        reducer.register_comm_hook([], doubled_sum)

    def local_grads(x):
        for p in params:
            p.grad = None
        net(x).pow(2).sum().backward()
        return [p.grad.clone() for p in params]

    xs = [torch.randn(3, 5, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    per_rank = [local_grads(x) for x in xs]
    factor = 2.0 if hook == "user" else 1.0 / world
    expected = [sum(g[k] for g in per_rank) * factor for k in range(len(params))]
    errors = []
    # 1) armed backward, finalised at backward end (DDP mode)
    for p in params:
        p.grad = None
    reducer.prepare_for_backward()
    net(xs[rank]).pow(2).sum().backward()
    errors.append(max((p.grad - e).abs().max().item() for p, e in zip(params, expected)))
    if view:
        assert all(p.grad.data_ptr() == reducer._view(i).data_ptr() for i, p in enumerate(params))
    # 2) engine mode: accumulate two unarmed backwards, arm the last, finalize() explicitly
    for p in params:
        if p.grad is not None:
            p.grad.zero_()
    reducer.prepare_for_backward(sync=False)
    net(xs[rank]).pow(2).sum().backward()
    reducer.prepare_for_backward(finalize_at_backward_end=False)
    net(xs[rank]).pow(2).sum().backward()
    reducer.finalize()
    errors.append(max((p.grad - 2 * e).abs().max().item() for p, e in zip(params, expected)))
    # 3) flush mode: no arming at all, finalize() reduces whatever is in .grad
    for p in params:
        p.grad = None
    net(xs[rank]).pow(2).sum().backward()
    reducer.finalize()
    errors.append(max((p.grad - e).abs().max().item() for p, e in zip(params, expected)))
    fused = [b.fused_scale for b in reducer.buckets]
    return errors, len(reducer.buckets), seen[:len(reducer.buckets)], fused


@pytest.mark.parametrize("view,hook", [(False, "none"), (True, "none"),
                                       (False, "torch_allreduce"), (True, "user")])
def test_reducer_modes(view, hook):
    for errors, nbuckets, seen, fused in run_ranks(_reducer_variants, 2, view, hook, timeout=60):
        assert nbuckets == 3  # [2.bias (8 bytes) + 2.weight], [1.bias], [1.weight]
        assert not any(fused)
        assert max(errors) < 1e-5, errors
        if hook == "user":
            assert seen == [(0, 2, False), (1, 1, False), (2, 1, True)]


@pytest.mark.parametrize("view,hook", [(False, "none"), (True, "none"), (True, "torch_allreduce")])
def test_reducer_modes_large_tensors(view, hook):
    for errors, nbuckets, seen, fused in run_ranks(_reducer_variants, 2, view, hook, True,
                                                    timeout=60):
        assert max(errors) < 1e-5, errors
        assert any(fused) and not all(fused), fused


def _edge_cases():
    from smshim.reducer.grad_reducer import GradReducer
    from smshim.dataparallel.torch import distributed as dist
    from smshim.dataparallel.torch.parallel import DistributedDataParallel as DDP

    dist.init_process_group()
    rank = dist.get_rank()
    # nothing trainable: nothing to reduce, no error
    frozen = GradReducer([torch.nn.Parameter(torch.ones(2), requires_grad=False)], None)
    frozen.prepare_for_backward()
    frozen.finalize()
    # two dtypes: two buffers, both averaged
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    mixed = GradReducer([a, b], None)
    mixed.prepare_for_backward()
    ((a.sum() + b.sum().float()) * (rank + 1)).backward()
    # DDP over an explicit group argument, WORLD spelled the smddp way
    torch.manual_seed(0)
    net = torch.nn.Linear(2, 1, bias=False)
    model = DDP(net, process_group=dist.group.WORLD, broadcast_buffers=False)
    model(torch.full((1, 2), float(rank))).sum().backward()
    return len(mixed.buckets), a.grad.tolist(), b.grad.tolist(), net.weight.grad.tolist()


def test_reducer_edge_cases():
    for nbuckets, ga, gb, gw in run_ranks(_edge_cases, 2, timeout=60):
        assert nbuckets == 2
        assert ga == [1.5] * 3 and gb == [1.5] * 2
        assert gw == [[0.5, 0.5]]


def _buffers_and_eval():
    from smshim.dataparallel.torch import distributed as dist
    from smshim.dataparallel.torch.parallel import DistributedDataParallel as DDP

    dist.init_process_group()
    rank = dist.get_rank()
    shifts = []
    for broadcast in (True, False):
        net = _model(seed=rank)
        model = DDP(net, broadcast_buffers=broadcast)
        net.shift.fill_(10.0 + rank)  # buffers drift apart after construction
        if rank == 0:  # evaluation on one rank only must not start a collective
            with torch.no_grad():
                model(torch.zeros(1, IN))
        model(torch.zeros(1, IN)).sum().backward()
        shifts.append(net.shift[0].item())
    return shifts


def test_buffers_rebroadcast_before_training_forwards_only():
    for rank, (with_bcast, without) in enumerate(run_ranks(_buffers_and_eval, 2, timeout=60)):
        assert with_bcast == 10.0  # rank 0's
        assert without == 10.0 + rank


def test_public_surface():
    import inspect

    import smdistributed.dataparallel.torch.parallel as parallel
    import smdistributed.dataparallel.torch.parallel.distributed as pd

    assert parallel.DistributedDataParallel is pd.DistributedDataParallel
    params = inspect.signature(pd.DistributedDataParallel.__init__).parameters.values()
    assert [(p.name, p.default) for p in params] == [
        ("self", inspect.Parameter.empty), ("module", inspect.Parameter.empty),
        ("device_ids", None), ("output_device", None), ("broadcast_buffers", True),
        ("process_group", None), ("bucket_cap_mb", None)]
