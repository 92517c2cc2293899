"""`tsm.transform` through the real SMP v2 API: `tsm.init(degrees)`, `model = tsm.transform(model)`,
then the script's unchanged `FullyShardedDataParallel(...)` (the patched FSDP picks the groups or
mesh, and keeps expert-parallel experts out) trains exactly like one process training the plain
HF model on the same global batch (fp32, < 1e-5 after 3 AdamW steps, clipping active), and its
checkpoints are HF checkpoints / reshardable."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from smshim.testing import run_ranks
from tests import tsm_helpers, tsm_models

TOL = 1e-5
CLIP = 0.5  # below the tiny models' first gradient norms: clipping acts


def _init(smp_config):
    import torch.distributed as dist
    import torch.sagemaker as tsm

    dist.init_process_group("gloo")
    tsm.init(smp_config)
    return tsm


def _wrap(model, layer_cls, strategy):
    """AWS's v2 FSDP call, unchanged: no process group, no device mesh."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    return FSDP(model, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                          transformer_layer_cls=layer_cls),
                use_orig_params=True, sharding_strategy=getattr(ShardingStrategy, strategy),
                device_id=torch.device("cuda", 0) if torch.cuda.is_available() else None)


def _layer_cls(model):
    from smshim.torch_sagemaker.parallelize.api import find_plan

    name = find_plan(model).layer_class
    return {type(m) for m in model.modules() if type(m).__name__ == name}


def _build(tsm, kind, strategy, seed=0):
    config = None
    if kind == "mixtral":
        from torch.sagemaker.moe.moe_config import MoEConfig
        config = MoEConfig(moe_load_balancing="none")
    model = tsm_models.make(kind, seed=seed)
    layer_cls = _layer_cls(model)
    model = tsm.transform(model, config=config)
    return model if strategy is None else _wrap(model, layer_cls, strategy)


def _full_sd(model, **cfg):
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    config = FullStateDictConfig(**{"offload_to_cpu": True, "rank0_only": True, **cfg})
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _local_batch(tsm, x):
    from smshim.torch_sagemaker.parallelize import split_for_cp

    s = tsm.state
    per = x.shape[0] // s.dp_size
    x = x[s.dp_rank * per:(s.dp_rank + 1) * per]
    return split_for_cp(x, s.cp_rank, s.context_parallel_degree) if s.context_parallel_degree > 1 else x


def _train_loop(tsm, model, batch=4):
    from torch.sagemaker.grad_norm import clip_grad_norm_

    losses, norms = tsm_models.train_ranks(model, lambda x: _local_batch(tsm, x), clip_grad_norm_,
                                           CLIP, batch=batch)
    x = tsm_models.batches(1, seed=5)[0]
    return {"losses": losses, "norms": norms, "logits": model(input_ids=x).logits.detach(),
            "local_numel": sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                               for p in model.parameters())}


def _train(kind, smp_config, strategy, save_dir=None, batch=4):
    """strategy None: no FSDP (TP over every rank leaves no data-parallel group to shard over)."""
    import torch.distributed as dist

    tsm = _init(smp_config)
    model = _build(tsm, kind, strategy)
    out = _train_loop(tsm, model, batch)
    if strategy is None:
        from smshim.torch_sagemaker.parallelize import full_hf_state_dict
        return {**out, "sd": full_hf_state_dict(model), "groups": None}
    out.update(sd=_full_sd(model), groups=sorted(dist.get_process_group_ranks(model.process_group)))
    if save_dir:
        from torch.sagemaker.distributed.checkpoint.full import save_full
        save_full(model, save_dir, model.module.config)
        head = _full_sd(model, translate_on_save=False).get("lm_head.weight")
        out["untranslated_head"] = None if head is None else (type(head).__name__,
                                                                head.to_local().shape[0])
    return out


def _check_equal(results, kind, ranks_with_sd=(0,), batch=4):
    ref_sd, ref_losses, ref_norms = tsm_models.train_reference(kind, clip=CLIP, batch=batch)
    assert ref_norms[0] > CLIP
    for rank, r in enumerate(results):
        assert r["norms"] == pytest.approx(ref_norms, abs=TOL), rank
        assert r["losses"] == pytest.approx(ref_losses, abs=TOL), rank
    for rank in ranks_with_sd:
        assert tsm_models.max_diff(results[rank]["sd"], ref_sd) < TOL, rank
    return ref_sd


def _plain_logits(kind, sd):
    plain = tsm_models.make(kind, seed=99)
    plain.load_state_dict(sd, strict=True)
    return plain(input_ids=tsm_models.batches(1, seed=5)[0]).logits.detach()


@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "FULL_SHARD"])
def test_llama_tp2_shard2_script_flow(strategy, tmp_path):
    """TP2 x hybrid_shard_degree 2 on 4 ranks: sharded over the 2 data-parallel ranks of each TP
    rank; the full state dict (translate_on_save) and save_full are HF checkpoints."""
    cfg = {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}
    results = run_ranks(_train, 4, "llama", cfg, strategy, str(tmp_path / "full"), timeout=420)
    _check_equal(results, "llama")
    assert [r["groups"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    full = sum(v.numel() for v in results[0]["sd"].values())
    assert results[0]["local_numel"] < 0.3 * full + 200  # TP/2 and FSDP/2 (norms replicated)
    torch.testing.assert_close(_plain_logits("llama", results[0]["sd"]), results[0]["logits"],
                               atol=1e-5, rtol=0)
    from transformers import LlamaForCausalLM
    plain = LlamaForCausalLM.from_pretrained(str(tmp_path / "full"))
    assert tsm_models.max_diff(plain.state_dict(), results[0]["sd"]) == 0.0
    # translate_on_save=False: TP shards as they are (half the vocabulary on each TP rank)
    assert results[0]["untranslated_head"] == ("DTensor", tsm_models.VOCAB // 2)


def test_gpt_neox_tp2_shard2_script_flow():
    cfg = {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}
    results = run_ranks(_train, 4, "gpt_neox", cfg, "HYBRID_SHARD", timeout=420)
    _check_equal(results, "gpt_neox")
    torch.testing.assert_close(_plain_logits("gpt_neox", results[0]["sd"]), results[0]["logits"],
                               atol=1e-5, rtol=0)


def test_llama_tp2_alone_script_flow():
    """TP2 on 2 ranks: no data-parallel group, so no FSDP; tsm.grad_norm clips over TP shards."""
    results = run_ranks(_train, 2, "llama", {"tensor_parallel_degree": 2}, None, timeout=300)
    _check_equal(results, "llama", ranks_with_sd=(0, 1))


def test_llama_cp2_script_flow():
    results = run_ranks(_train, 2, "llama", {"context_parallel_degree": 2}, "FULL_SHARD",
                        timeout=300)
    _check_equal(results, "llama")


@pytest.mark.parametrize("world,hsd,groups", [
    pytest.param(2, 0, [0], id="ep_over_every_rank"),
    # (EP2 x shard 2 on 4 ranks: test_save_per_tp_ep_rank_and_resume[ep2_shard2])
    pytest.param(4, 1, [0], id="unsharded"),
    pytest.param(8, 2, [0, 2], id="shard2_2replicas"),
])
def test_mixtral_ep2_script_flow(world, hsd, groups):
    """EP2: the EP ranks are data-parallel ranks; the patched FSDP shards the rest over the ranks
    with the same EP rank (`groups`, rank 0's `model.process_group`), replicates it over the EP
    ranks and replicas, and keeps the experts out (each rank holds half of them). More ranks than
    the EP group hold the same experts (the other shard positions, the other replicas): their
    gradients are averaged over those ranks (fsdp_expert_grads.py). A global batch of 8 gives
    each of 8 ranks a sample."""
    batch = max(4, world)
    results = run_ranks(_train, world, "mixtral", {"expert_parallel_degree": 2,
                                                   "hybrid_shard_degree": hsd},
                        "HYBRID_SHARD", None, batch, timeout=300)
    ref_sd = _check_equal(results, "mixtral", batch=batch)
    assert results[0]["groups"] == groups
    experts = sum(v.numel() for k, v in ref_sd.items() if ".experts." in k)
    assert results[0]["local_numel"] < sum(v.numel() for v in ref_sd.values()) - experts // 2 + 1


def _step_and_save_over_world(path, smp_config, strategy):
    """One step, then the SHARDED_STATE_DICT AWS's scripts take, saved with tsm's DCP saver over
    the world (every TP rank's shards in one checkpoint). Returns the model and the placements of
    a row-split TP weight in that state dict."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
    from torch.sagemaker.distributed.checkpoint.state_dict_saver import save

    tsm = _init(smp_config)
    model = _build(tsm, "llama", strategy)
    opt = tsm_models.optimizer(model)
    x = _local_batch(tsm, tsm_models.batches(1)[0])
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sd = model.state_dict()
        save({"model": sd}, checkpoint_id=path)
    return model, [str(p) for p in sd["model.layers.0.self_attn.q_proj.weight"].placements]


def _sharded_save(path):
    """TP2 x shard 2: saved over the world, and loaded back at the same layout."""
    model, _ = _step_and_save_over_world(path, {"tensor_parallel_degree": 2,
                                                "hybrid_shard_degree": 2}, "HYBRID_SHARD")
    before = _full_sd(model, rank0_only=False)
    _sharded_load_into(model, path)
    return before, _full_sd(model, rank0_only=False)


def _sharded_load_into(model, path):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
    from torch.sagemaker.distributed.checkpoint.state_dict_loader import load

    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sd = {"model": model.state_dict()}
        load(sd, checkpoint_id=path)
        model.load_state_dict(sd["model"])


def _sharded_load_shard4(path):
    tsm = _init({"hybrid_shard_degree": 4})
    model = _build(tsm, "llama", "HYBRID_SHARD", seed=42)
    _sharded_load_into(model, path)
    return _full_sd(model, rank0_only=False)


def test_sharded_checkpoint_tp2_shard2_loads_at_tp1_shard4(tmp_path):
    # 8 processes: both layouts have 2 replicas, so each piece of the state dict is on both, the
    # world-group save writes it once, and the load at shard 4 reads it into another layout (the
    # one-replica case at 4 processes runs the same code with less to check).
    world = 8
    path = str(tmp_path / "sharded")
    saved = run_ranks(_sharded_save, world, path, timeout=300)
    for before, again in saved:
        assert tsm_models.max_diff(before, again) == 0.0
    loaded = run_ranks(_sharded_load_shard4, world, path, timeout=300)
    for r in loaded:
        assert tsm_models.max_diff(r, saved[0][0]) == 0.0


def _sharded_save_tp2_cp2(path):
    """TP2 x CP2 (FSDP over the CP ranks). FSDP1 puts its shard of a TP tensor on the `cp` mesh
    dim, for a row-split weight on the same tensor dim as the TP split; the patched FSDP splits
    the TP slice (TP-first, fsdp_shard_layout.py)."""
    model, placements = _step_and_save_over_world(
        path, {"tensor_parallel_degree": 2, "context_parallel_degree": 2}, "FULL_SHARD")
    return _full_sd(model, rank0_only=False), placements


def test_tp2_cp2_sharded_checkpoint_loads_at_tp1_shard4(tmp_path):
    path = str(tmp_path / "sharded")
    saved = run_ranks(_sharded_save_tp2_cp2, 4, path, timeout=300)
    assert saved[0][1] == ["R", "R", "_S(0, 2)", "S(0)"]  # (rep, dp_shard, cp, mp)
    loaded = run_ranks(_sharded_load_shard4, 4, path, timeout=300)
    for r in loaded:
        assert tsm_models.max_diff(r, saved[0][0]) == 0.0


def _rank0_load(from_rank0):
    import torch.distributed as dist
    from accelerate import init_empty_weights

    tsm = _init({"tensor_parallel_degree": 2, "hybrid_shard_degree": 2})
    if not from_rank0 or dist.get_rank() == 0:
        model = tsm_models.make("llama", seed=7)
    else:
        with init_empty_weights():
            model = tsm_models.make("llama", seed=123)
    layer_cls = _layer_cls(model)
    model = _wrap(tsm.transform(model, load_state_dict_from_rank0=from_rank0), layer_cls,
                  "HYBRID_SHARD")
    x = tsm_models.batches(1)[0]
    return {"sd": _full_sd(model, rank0_only=False), "logits": model(input_ids=x).logits.detach()}


def test_load_state_dict_from_rank0_equals_every_rank_loading():
    from_rank0 = run_ranks(_rank0_load, 4, True, timeout=300)
    everyone = run_ranks(_rank0_load, 4, False, timeout=300)
    plain = tsm_models.make("llama", seed=7)
    for a, b in zip(from_rank0, everyone):
        assert tsm_models.max_diff(a["sd"], b["sd"]) == 0.0
        assert tsm_models.max_diff(a["sd"], plain.state_dict()) == 0.0
        torch.testing.assert_close(a["logits"], b["logits"], atol=0, rtol=0)


def _one_more_step(tsm, model, opt, x):
    from torch.sagemaker.grad_norm import clip_grad_norm_

    opt.zero_grad()
    xl = _local_batch(tsm, x)
    model(input_ids=xl, labels=xl).loss.backward()
    clip_grad_norm_(model, CLIP)
    opt.step()
    return _full_sd(model, rank0_only=False)


def _train_replicas_save_per_tp_and_resume(path, smp_config, strategy="HYBRID_SHARD",
                                           kind="llama"):
    """Train; then AWS's v2 checkpoint flow: the ranks of replica 0 save model and optimizer per
    TP and EP rank (`tp{tp_rank}_ep{ep_rank}`) over `model.process_group`; one more step. A new
    model (other weights) on every rank then loads its directory over its own sharding group,
    model and optimizer, and takes the same step."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
    from torch.sagemaker.distributed.checkpoint.filesystem import DistributedFileSystemReader
    from torch.sagemaker.distributed.checkpoint.state_dict_loader import load
    from torch.sagemaker.distributed.checkpoint.state_dict_saver import save

    tsm = _init(smp_config)
    # After tsm.init, as scripts do: it gives this function SMP's `process_group` argument.
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict

    model = _build(tsm, kind, strategy)
    out = _train_loop(tsm, model)  # its own optimizer, not returned: a second one carries on
    out.update(sd=_full_sd(model), groups=sorted(dist.get_process_group_ranks(model.process_group)))
    opt = tsm_models.optimizer(model)
    x1, x2 = tsm_models.batches(2, seed=9)
    _one_more_step(tsm, model, opt, x1)  # the optimizer has state to save
    own = f"{path}/tp{tsm.state.tp_rank}_ep{tsm.state.ep_rank}"
    coordinator = min(dist.get_process_group_ranks(model.process_group))
    sd = tsm_helpers.sharded_state_dict(model, opt)
    if tsm.state.ranker.get_rep_rank(dist.get_rank()) == 0:
        save(sd, checkpoint_id=own, process_group=model.process_group, coordinator_rank=coordinator)
    dist.barrier()
    out["continued"] = _one_more_step(tsm, model, opt, x2)

    again = _build(tsm, kind, strategy, seed=42)
    opt2 = tsm_models.optimizer(again)
    with FSDP.state_dict_type(again, StateDictType.SHARDED_STATE_DICT):
        sd = {"model": again.state_dict()}
        load(sd, checkpoint_id=own, process_group=again.process_group,
             coordinator_rank=coordinator)
        again.load_state_dict(sd["model"])
        optim = load_sharded_optimizer_state_dict(
            model_state_dict=sd["model"], optimizer_key="optimizer",
            storage_reader=DistributedFileSystemReader(own), process_group=again.process_group)
        opt2.load_state_dict(FSDP.optim_state_dict_to_load(again, opt2, optim["optimizer"]))
    out["resumed"] = _one_more_step(tsm, again, opt2, x2)
    return out


@pytest.mark.parametrize("world,cfg,strategy,groups,kind", [
    pytest.param(8, {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}, "HYBRID_SHARD",
                 {0: [0, 2], 5: [5, 7]}, "llama", id="tp2_shard2_2replicas"),
    # Unsharded (NO_SHARD: FSDP1 re-registers a DTensor parameter at every forward there, and
    # the patched FSDP keeps the one the optimizer holds, fsdp_unsharded_tp.py):
    # hybrid_shard_degree 1, 2 replicas whose gradients are averaged; the sharding group
    # (`model.process_group`) is each rank alone, so replica 0 saves without the others
    pytest.param(4, {"tensor_parallel_degree": 2, "hybrid_shard_degree": 1}, "FULL_SHARD",
                 {0: [0], 3: [3]}, "llama", id="tp2_unsharded_2replicas"),
    # TP over every rank: one replica, nothing to shard
    pytest.param(2, {"tensor_parallel_degree": 2}, "FULL_SHARD", {0: [0], 1: [1]}, "llama",
                 id="tp_over_every_rank"),
    # FSDP splits each TP slice over the CP ranks (TP-first, fsdp_shard_layout.py), so the CP
    # ranks of one TP rank hold its slice between them
    pytest.param(4, {"tensor_parallel_degree": 2, "context_parallel_degree": 2}, "FULL_SHARD",
                 {0: [0, 2], 1: [1, 3]}, "llama", id="tp2_cp2"),
    # EP2 x shard 2: the rest of the model is sharded over the ranks with the same EP rank
    pytest.param(4, {"expert_parallel_degree": 2}, "HYBRID_SHARD", {0: [0, 2], 1: [1, 3]},
                 "mixtral", id="ep2_shard2"),
])
def test_save_per_tp_ep_rank_and_resume(tmp_path, world, cfg, strategy, groups, kind):
    """Training equals one process; the per-TP/EP-rank checkpoint resumes exactly."""
    results = run_ranks(_train_replicas_save_per_tp_and_resume, world, str(tmp_path), cfg,
                        strategy, kind, timeout=420)
    _check_equal(results, kind)
    assert {rank: results[rank]["groups"] for rank in groups} == groups
    tp, ep = cfg.get("tensor_parallel_degree", 1), cfg.get("expert_parallel_degree", 1)
    assert sorted(os.listdir(tmp_path)) == [f"tp{t}_ep{e}" for t in range(tp) for e in range(ep)]
    for rank, r in enumerate(results):
        assert tsm_models.max_diff(r["resumed"], r["continued"]) == 0.0, rank
        assert tsm_models.max_diff(r["continued"], results[0]["continued"]) == 0.0, rank
