"""A tiny HF Llama under the script's own, unchanged FSDP call trains exactly like one process on
the same global batch (fp32, < 1e-5) at every hybrid_shard_degree case, sharding over the groups
the degree names; the end-of-training full state dict (offload_to_cpu, rank0_only) works on CPU."""

import pytest
import torch

from smshim.testing import run_ranks
from tests import tsm_helpers as h

REF = None


def _reference():
    global REF
    if REF is None:
        REF = h.reference()
    return REF


def _check(result, expect_ranks):
    ref, ref_losses = _reference()
    assert result["shard_ranks"] == expect_ranks, result["shard_ranks"]
    full = result["full"]
    assert sorted(full) == sorted(ref), sorted(set(full) ^ set(ref))
    worst = max((full[k] - ref[k]).abs().max().item() for k in ref)
    assert worst < 1e-5, worst


@pytest.mark.parametrize("hsd,groups", [
    (2, [[0, 1], [0, 1], [2, 3], [2, 3]]),
    (4, [[0, 1, 2, 3]] * 4),
])
def test_hybrid_shard_degree_k(hsd, groups):
    results = run_ranks(h.train_fsdp, 4, {"hybrid_shard_degree": hsd},
                        ("HYBRID_SHARD", "FULL_SHARD"), timeout=240)
    for rank, r in enumerate(results):
        # Any strategy becomes HYBRID_SHARD over groups of `hsd` ranks, replicated across groups.
        for strategy in ("HYBRID_SHARD", "FULL_SHARD"):
            assert r[strategy]["strategy"] == "HYBRID_SHARD"
            assert r[strategy]["shard_ranks"] == groups[rank]
    _check(results[0]["HYBRID_SHARD"], groups[0])
    _check(results[0]["FULL_SHARD"], groups[0])
    # Sharded: each rank holds 1/hsd of the parameters (plus padding).
    full = sum(v.numel() for v in _reference()[0].values())
    assert results[1]["HYBRID_SHARD"]["local_numel"] <= full // hsd + 64


def test_hybrid_shard_degree_1_is_no_shard():
    # The sharding group (`model.process_group`) is each rank alone; gradients are averaged over
    # all four data-parallel ranks all the same (equal to one process on the global batch).
    results = run_ranks(h.train_fsdp, 4, {"hybrid_shard_degree": 1}, ("HYBRID_SHARD",), timeout=240)
    for rank, r in enumerate(results):
        assert r["HYBRID_SHARD"]["strategy"] == "NO_SHARD"
        assert r["HYBRID_SHARD"]["shard_ranks"] == [rank]
    _check(results[0]["HYBRID_SHARD"], [0])


STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


def test_hybrid_shard_degree_0_is_stock_fsdp_for_each_strategy():
    # From the job's SM_HP_MP_PARAMETERS, as on SageMaker (no argument to tsm.init).
    results = run_ranks(_train_from_job, 4, STRATEGIES, timeout=300)
    for s in STRATEGIES:
        assert results[0][s]["strategy"] == s
        # Stock: the whole world (one host: HYBRID's node group is every rank).
        _check(results[0][s], [0, 1, 2, 3])


def _train_from_job(strategies):
    import os

    os.environ["SM_HP_MP_PARAMETERS"] = '{"hybrid_shard_degree": 0, "placement_strategy": "cluster"}'
    return h.train_fsdp(None, strategies)


@pytest.mark.parametrize("impl", ["REENTRANT", "NO_REENTRANT"])
def test_activation_checkpointing_and_offloading_keep_the_numbers(impl):
    """The scripts' activation checkpointing (and offload_wrapper, sm_activation_offloading on)
    under HYBRID_SHARD at degree 2 still trains like one process."""
    cfg = {"hybrid_shard_degree": 2, "sm_activation_offloading": True, "activation_loading_horizon": 1}
    results = run_ranks(h.train_fsdp, 4, cfg, ("HYBRID_SHARD",), h.STEPS, impl, timeout=240)
    _check(results[0]["HYBRID_SHARD"], [0, 1])


def _clipped(max_norm):
    import torch.distributed as dist
    import torch.sagemaker as tsm
    from torch.distributed.fsdp import FullStateDictConfig

    dist.init_process_group("gloo")
    try:  # SMP's field exists only once tsm.init has installed the patches
        FullStateDictConfig(translate_on_save=False)
        before = "accepted"
    except TypeError:
        before = "refused"
    tsm.init({"hybrid_shard_degree": 2})
    assert FullStateDictConfig(translate_on_save=False).translate_on_save is False
    assert FullStateDictConfig().translate_on_save is True
    from torch.sagemaker.grad_norm import clip_grad_norm_

    model = h.checkpoint_layers(h.wrap(h.make_llama()))  # inside a wrapper, as in the scripts
    opt = torch.optim.AdamW(model.parameters(), lr=h.LR)
    norms = []
    for x in h.batches():
        opt.zero_grad()
        xl = h.local_batch(x, tsm.state.dp_rank, tsm.state.dp_size)
        model(input_ids=xl, labels=xl).loss.backward()
        norms.append(clip_grad_norm_(model, max_norm).item())
        opt.step()
    return before, norms, h.full_state_dict(model._checkpoint_wrapped_module
                                            if hasattr(model, "_checkpoint_wrapped_module") else model)


def test_clip_grad_norm_matches_one_process_and_smp_fields_only_after_init():
    max_norm = 0.5
    model = h.make_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=h.LR)
    ref_norms = []
    for x in h.batches():
        opt.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
    results = run_ranks(_clipped, 4, max_norm, timeout=240)
    before, norms, full = results[0]
    assert before == "refused"
    assert all(abs(a - b) < 1e-5 * max(1, b) for a, b in zip(norms, ref_norms)), (norms, ref_norms)
    assert min(ref_norms) > max_norm  # clipping did act
    worst = max((full[k] - v).abs().max().item() for k, v in model.state_dict().items())
    assert worst < 1e-5, worst


def test_hybrid_shard_degree_0_hybrid_shards_within_each_node():
    """Stock HYBRID_SHARD shards inside a node: 2 "nodes" of 2 ranks (LOCAL_WORLD_SIZE=2)."""
    results = run_ranks(h.train_fsdp, 4, {"hybrid_shard_degree": 0}, ("HYBRID_SHARD",),
                        timeout=240, env={"LOCAL_WORLD_SIZE": "2"})
    assert [r["HYBRID_SHARD"]["shard_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    _check(results[0]["HYBRID_SHARD"], [0, 1])
