"""The pipeline engine trains arbitrary models exactly like single-process training."""

import itertools

import pytest
import torch

from smshim.testing import run_ranks
from tests.pipeline_models import batches, loss_fn, make_model, reference

TOL = 1e-5


def _train(kind, cfg, steps=3, batch=8, manual=None):
    import smdistributed.modelparallel.torch as smp

    smp.init(cfg)
    module = make_model(kind)
    total = sum(p.numel() for p in module.parameters())
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    if manual:
        for name, pid in manual.items():
            smp.set_partition(module.get_submodule(name), pid)

    @smp.step
    def train_step(model, x, y):
        out = model(x, scale=0.5) if kind == "net" else model(x)
        loss = loss_fn(kind, out, y)
        model.backward(loss)
        return loss

    losses = []
    for x, y in batches(kind, steps, batch):
        opt.zero_grad()
        out = train_step(model, x, y)
        opt.step()
        losses.append(out.reduce_mean().item())
    local = {n: p.detach().clone() for n, p in model.local_named_parameters()}
    return {"params": local, "total": total, "losses": losses, "pp_rank": smp.pp_rank(),
            "assignment": dict(model._assignment)}


def _check(results, kind):
    ref = reference(kind)
    merged = {}
    for r in results:
        for n, p in r["params"].items():
            assert n not in merged or torch.equal(merged[n], p), f"{n} held by two ranks differently"
            merged[n] = p
    # Tied parameters appear once, under their first name.
    assert set(merged) == set(ref), (set(ref) ^ set(merged))
    for n, p in ref.items():
        diff = (merged[n] - p).abs().max().item()
        assert diff < TOL, f"{n}: max abs diff {diff}"
    # Each rank keeps only its partition; the partitions add up to the model.
    assert sum(sum(p.numel() for p in r["params"].values()) for r in results) == results[0]["total"]
    assert len({tuple(r["losses"]) for r in results}) == 1  # every stage got the same outputs


CASES = [(pp, m, sched, part) for pp, m, sched, part in itertools.product(
    [2, 4], [1, 2, 4, 8], ["simple", "interleaved"], ["auto", "manual"])]


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
