"""The pipeline engine trains arbitrary models exactly like single-process training."""

import itertools

import pytest
import torch

from smshim.testing import run_ranks
from tests.pipeline_models import batches, loss_fn, make_model, make_train_step, reference

TOL = 1e-5


def _train(kind, cfg, steps=3, batch=8, manual=None, model_kwargs=None):
    import smdistributed.modelparallel.torch as smp

    smp.init(cfg)
    dp, dp_rank = smp.dp_size(), smp.dp_rank()
    module = make_model(kind)
    total = sum(p.numel() for p in module.parameters())
    model_kwargs = dict(model_kwargs or {})
    comm_hook = model_kwargs.pop("comm_hook", None)
    model = smp.DistributedModel(module, **model_kwargs)
    hook_calls = []
    if comm_hook == "torch_allreduce":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counting_hook(pg, bucket):
            hook_calls.append(bucket.index())
            return allreduce_hook(pg, bucket)

        model.register_comm_hook(smp.get_dp_process_group(), counting_hook)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    if manual:
        for name, pid in manual.items():
            smp.set_partition(module.get_submodule(name), pid)

    train_step = make_train_step(kind)

    losses = []
    for x, y in batches(kind, steps, batch):
        # Each data-parallel replica trains on its shard of the global batch.
        k = batch // dp
        x, y = x[dp_rank * k:(dp_rank + 1) * k], y[dp_rank * k:(dp_rank + 1) * k]
        opt.zero_grad()
        out = train_step(model, x, y)
        opt.step()
        losses.append(out.reduce_mean().item())
    local = {n: p.detach().clone() for n, p in model.local_named_parameters()}
    return {"params": local, "total": total, "losses": losses, "pp_rank": smp.pp_rank(),
            "dp_rank": dp_rank, "assignment": dict(model._assignment),
            "early_reductions": model._pipeline.early_reductions if model._pipeline else 0,
            "hook_calls": len(hook_calls)}


def _check(results, kind, batch=8):
    ref = reference(kind, batch=batch)
    merged = {}
    for r in results:
        if r.get("dp_rank", 0) != 0:
            continue
        for n, p in r["params"].items():
            assert n not in merged or torch.equal(merged[n], p), f"{n} held by two ranks differently"
            merged[n] = p
    # Tied parameters appear once, under their first name.
    assert set(merged) == set(ref), (set(ref) ^ set(merged))
    for n, p in ref.items():
        diff = (merged[n] - p).abs().max().item()
        assert diff < TOL, f"{n}: max abs diff {diff}"
    # Each rank keeps only its partition; the partitions add up to the model.
    replica0 = [r for r in results if r.get("dp_rank", 0) == 0]
    assert sum(sum(p.numel() for p in r["params"].values()) for r in replica0) == results[0]["total"]
    for d in {r.get("dp_rank", 0) for r in results}:
        replica = [r for r in results if r.get("dp_rank", 0) == d]
        assert len({tuple(r["losses"]) for r in replica}) == 1  # every stage got the same outputs
        for r in replica:  # replicas hold identical partitions
            twin = next(q for q in replica0 if q["pp_rank"] == r["pp_rank"])
            for n, p in r["params"].items():
                assert torch.equal(p, twin["params"][n]), (n, d)


# One microbatch is one schedule (its forward, then its backward): `simple` stands for both.
CASES = [(pp, m, sched, part) for pp, m, sched, part in itertools.product(
    [2, 4], [1, 2, 4, 8], ["simple", "interleaved"], ["auto", "manual"])
    if not (m == 1 and sched == "interleaved")]


@pytest.mark.parametrize("pp, m, sched, part", CASES)
def test_net_matches_single_process(pp, m, sched, part):
    cfg = {"pipeline_parallel_degree": pp, "microbatches": m, "pipeline": sched,
           "active_microbatches": m if sched == "simple" else max(1, min(m, pp)),
           "auto_partition": part == "auto"}
    if part == "manual":
        cfg["default_partition"] = 0
    manual = None
    if part == "manual":
        manual = {f"blocks.{i}": (i + 1) % pp for i in range(4)}
        manual["head"] = pp - 1
    results = run_ranks(_train, pp, "net", cfg, 3, 8, manual, timeout=150)
    _check(results, "net")
    owners = set(results[0]["assignment"].values())
    assert owners == set(range(pp)) or part == "auto", owners


@pytest.mark.parametrize("pp", [2, 4])
def test_tied_weights(pp):
    cfg = {"pipeline_parallel_degree": pp, "microbatches": 2}
    results = run_ranks(_train, pp, "tied", cfg, timeout=150)
    _check(results, "tied")
    a = results[0]["assignment"]
    assert a["embed"] == a["out"]


@pytest.mark.parametrize("placement", ["cluster", "spread"])
@pytest.mark.parametrize("sched", ["simple", "interleaved"])
def test_pipeline_times_data_parallel(placement, sched):
    cfg = {"pipeline_parallel_degree": 2, "microbatches": 2, "pipeline": sched, "ddp": True,
           "placement_strategy": placement}
    results = run_ranks(_train, 4, "net", cfg, 3, 16, timeout=150)
    _check(results, "net", batch=16)
    expected = {"cluster": [(0, 0), (1, 0), (0, 1), (1, 1)],
                "spread": [(0, 0), (0, 1), (1, 0), (1, 1)]}[placement]
    assert [(r["pp_rank"], r["dp_rank"]) for r in results] == expected
    # Overlapping reduction: the last stage reduced before the step's end, every step.
    assert [r["early_reductions"] for r in results if r["pp_rank"] == 1] == [3, 3]


def test_data_parallel_only_and_end_of_step_reduction():
    # pp=1 x dp=2, and pp=2 x dp=2 with overlapping_allreduce=False (reduce at the end of the step).
    results = run_ranks(_train, 2, "net", {"pipeline_parallel_degree": 1, "ddp": True,
                                           "microbatches": 2}, 3, 16, timeout=150)
    _check(results, "net", batch=16)
    results = run_ranks(_train, 4, "net", {"pipeline_parallel_degree": 2, "ddp": True,
                                           "microbatches": 4}, 3, 16, None,
                        {"overlapping_allreduce": False}, timeout=150)
    _check(results, "net", batch=16)


def test_deterministic_server_gives_bit_identical_runs():
    cfg = {"pipeline_parallel_degree": 2, "microbatches": 4, "deterministic_server": True}
    runs = [run_ranks(_train, 2, "tied", cfg, 3, 8, timeout=150) for _ in range(2)]
    _check(runs[0], "tied")
    for a, b in zip(*runs):
        for n, p in a["params"].items():
            assert torch.equal(p, b["params"][n]), n


def test_comm_hook_under_ddp():
    results = run_ranks(_train, 4, "net", {"pipeline_parallel_degree": 2, "ddp": True,
                                           "microbatches": 2}, 3, 16, None,
                        {"comm_hook": "torch_allreduce", "bucket_cap_mb": 0.001,
                         "gradient_as_bucket_view": True}, timeout=150)
    _check(results, "net", batch=16)
    assert all(r["hook_calls"] >= 3 * 2 for r in results)  # several buckets, every step


def _uneven(steps_per_replica, batch=16):
    import smdistributed.modelparallel.torch as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True})
    dp_rank = smp.dp_rank()
    model = smp.DistributedModel(make_model("net"))
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))

    train_step = make_train_step("net")

    k = batch // 2
    with model.join():
        for x, y in batches("net", steps_per_replica[dp_rank], batch):
            opt.zero_grad()
            train_step(model, x[dp_rank * k:(dp_rank + 1) * k], y[dp_rank * k:(dp_rank + 1) * k])
            opt.step()
    return {"params": {n: p.detach().clone() for n, p in model.local_named_parameters()},
            "dp_rank": dp_rank, "pp_rank": smp.pp_rank()}


def test_join_with_uneven_inputs():
    results = run_ranks(_uneven, 4, [3, 2], timeout=150)
    # Reference: steps 1-2 on both replicas' data, step 3 on replica 0's half only.
    ref_model = make_model("net")
    opt = torch.optim.Adam(ref_model.parameters(), lr=0.01)
    for i, (x, y) in enumerate(batches("net", 3, 16)):
        if i == 2:
            x, y = x[:8], y[:8]
        opt.zero_grad()
        loss_fn("net", ref_model(x, scale=0.5), y).backward()
        opt.step()
    ref = dict(ref_model.named_parameters())
    for r in results:  # every replica ends with the longest-training replica's parameters
        for n, p in r["params"].items():
            assert (p - ref[n].detach()).abs().max() < 1e-5, (n, r["dp_rank"])
