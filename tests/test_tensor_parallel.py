"""Tensor parallelism (smp.nn, set_tensor_parallelism) trains exactly like single-process
training of the unsplit model: 3 steps, parameters within 1e-5."""

import pytest
import torch

from smshim.testing import run_ranks
from tests import tp_models

TOL = 1e-5


def _train(kind, cfg, auto=False, ckpt_dir=None, steps=3, batch=8):
    import smdistributed.modelparallel.torch as smp

    smp.init(cfg)
    module = tp_models.make(kind, dist=True)
    if auto:
        smp.set_tensor_parallelism(module)
    else:
        # The plain model's weights (same seed) load into the split one: each rank keeps its
        # shard.
        module.load_state_dict(tp_models.make(kind, dist=False).state_dict())
    model = smp.DistributedModel(module)
    per_rank = sum(p.numel() for p in model.module.parameters())
    distributed = sorted(type(m).__name__ for m in model.module.modules()
                         if isinstance(m, smp.nn.DistributedModule))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    @smp.step
    def train_step(model, ids, y):
        loss = tp_models.loss_fn(kind, model(ids), y)
        model.backward(loss)
        return loss

    # prescaled_batch: the TP ranks of a group share one batch (sharded by rdp_rank); else each
    # rank of the DP group (rdp x tp ranks) has its own.
    n, r = (smp.rdp_size(), smp.rdp_rank()) if cfg.get("prescaled_batch") else \
        (smp.dp_size(), smp.dp_rank())
    k = batch // n
    for ids, y in tp_models.data(kind, steps, batch):
        opt.zero_grad()
        train_step(model, ids[r * k:(r + 1) * k], y[r * k:(r + 1) * k])
        opt.step()
    full = model.state_dict() if smp.rdp_rank() == 0 else None
    if ckpt_dir is not None:
        smp.save_checkpoint(ckpt_dir, "tp", partial=False, model=model)
    local = sum(p.numel() for p in model.local_parameters())
    return {"full": full, "per_rank": per_rank, "local": local, "rank": smp.rank(),
            "tp_rank": smp.tp_rank(), "distributed": distributed}


def _check(results, kind):
    ref = tp_models.reference(kind)
    checked = 0
    for r in results:
        if r["full"] is None:
            continue
        assert set(r["full"]) == set(ref)
        for k, v in ref.items():
            assert r["full"][k].shape == v.shape, (k, r["full"][k].shape, v.shape)
            diff = (r["full"][k] - v).abs().max().item()
            assert diff < TOL, f"rank {r['rank']}: {k}: max abs diff {diff}"
        checked += 1
    assert checked


@pytest.mark.parametrize("prescaled", [False, True])
def test_linear_embedding_tp2(prescaled):
    cfg = {"tensor_parallel_degree": 2, "microbatches": 2, "prescaled_batch": prescaled}
    results = run_ranks(_train, 2, "linear", cfg, timeout=120)
    _check(results, "linear")
    full = sum(v.numel() for v in tp_models.make("linear", dist=False).parameters())
    assert all(r["per_rank"] < full for r in results)


def test_transformer_layer_tp2_vs_plain_layer():
    """DistributedTransformerLayer (pre-layernorm, causal; and post-layernorm) trains as an
    independent plain implementation of the same layer."""
    for kind in ("layer", "layer_post"):
        results = run_ranks(_train, 2, kind, {"tensor_parallel_degree": 2}, timeout=120)
        _check(results, kind)


def test_set_tensor_parallelism_linear_embedding():
    results = run_ranks(_train, 2, "linear_auto", {"tensor_parallel_degree": 2}, True,
                        timeout=120)
    assert results[0]["distributed"] == ["DistributedEmbedding", "DistributedLinear",
                                         "DistributedLinear", "DistributedLinear"]
    _check(results, "linear_auto")


def test_set_tensor_parallelism_hf_gpt2_tp2():
    results = run_ranks(_train, 2, "gpt2", {"tensor_parallel_degree": 2, "microbatches": 2},
                        True, timeout=180)
    # The blocks' projections and the position embedding are split; the word embedding is tied
    # to the LM head, so both stay whole.
    assert results[0]["distributed"].count("ShardedConv1D") == 8
    assert results[0]["distributed"].count("DistributedEmbedding") == 1
    assert "DistributedLinear" not in results[0]["distributed"]
    _check(results, "gpt2")


@pytest.mark.parametrize("prescaled", [False, True])
def test_tp2_dp2(prescaled):
    cfg = {"tensor_parallel_degree": 2, "ddp": True, "microbatches": 2,
           "prescaled_batch": prescaled}
    results = run_ranks(_train, 4, "layer", cfg, timeout=180)
    _check(results, "layer")
