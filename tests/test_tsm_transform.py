"""tsm.transform's engine (smshim.torch_sagemaker.parallelize.apply): tensor, context and expert
parallelism of tiny Hugging Face models train exactly like one process training the plain model
on the same global batch (fp32, parameters within 1e-5 after 3 AdamW steps)."""

from __future__ import annotations

import pytest
import torch

from smshim.testing import run_ranks
from tests import tsm_models

TOL = 1e-5


def _init(mesh_shape, names):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    return init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)


def _tp_train(kind, attn="sdpa", overrides=None):
    from smshim.torch_sagemaker.parallelize import apply, full_hf_state_dict

    mesh = _init((2,), ("tp",))
    model = apply(tsm_models.make(kind, attn=attn, **(overrides or {})), tp_mesh=mesh["tp"])
    opt = tsm_models.optimizer(model)
    losses = []
    for x in tsm_models.batches():
        opt.zero_grad()
        out = model(input_ids=x, labels=x)
        assert out.logits.shape == (*x.shape, tsm_models.VOCAB)
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                for p in model.parameters())
    return {"sd": full_hf_state_dict(model), "losses": losses, "local_numel": local}


@pytest.mark.parametrize("kind,attn", [("llama", "sdpa"), ("llama", "eager"), ("gpt_neox", "sdpa"),
                                       ("mistral", "sdpa")])
def test_tp2_matches_one_process(kind, attn):
    results = run_ranks(_tp_train, 2, kind, attn, timeout=180)
    ref_sd, ref_losses = tsm_models.train_reference(kind, attn=attn)
    for r in results:
        assert tsm_models.max_diff(r["sd"], ref_sd) < TOL
        assert r["losses"] == pytest.approx(ref_losses, abs=TOL)
    full = sum(v.numel() for v in tsm_models.make(kind).parameters())
    assert results[0]["local_numel"] < 0.7 * full


def _tp_padded_grads(kind):
    """One forward/backward with left padding (attention_mask) and -100 labels, with and without
    num_items_in_batch: loss, full logits and full gradients."""
    from smshim.torch_sagemaker.parallelize import apply

    mesh = _init((2,), ("tp",))
    model = apply(tsm_models.make(kind), tp_mesh=mesh["tp"])
    x, mask, labels = _padded_batch()
    out = []
    for extra in ({}, {"num_items_in_batch": torch.tensor(17)}):
        model.zero_grad()
        res = model(input_ids=x, attention_mask=mask, labels=labels, **extra)
        res.loss.backward()
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                 for n, p in model.named_parameters()}
        out.append((res.loss.item(), res.logits.detach(), grads))
    return out


def _padded_batch():
    x = tsm_models.batches(1)[0]
    mask = torch.ones_like(x)
    mask[0, :5] = 0
    mask[2, :3] = 0
    labels = x.masked_fill(mask == 0, -100)
    return x, mask, labels


@pytest.mark.parametrize("kind", ["llama", "gpt_neox"])
def test_tp2_padding_mask_and_num_items(kind):
    got = run_ranks(_tp_padded_grads, 2, kind, timeout=120)[0]
    model = tsm_models.make(kind)
    x, mask, labels = _padded_batch()
    for (loss, logits, grads), extra in zip(got, ({}, {"num_items_in_batch": torch.tensor(17)})):
        model.zero_grad()
        ref = model(input_ids=x, attention_mask=mask, labels=labels, **extra)
        ref.loss.backward()
        assert loss == pytest.approx(ref.loss.item(), rel=1e-6)
        torch.testing.assert_close(logits, ref.logits.detach(), atol=1e-5, rtol=0)
        for n, p in model.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, atol=1e-6, rtol=0, msg=n)


def test_tp2_tied_embeddings():
    results = run_ranks(_tp_train, 2, "llama", "sdpa", dict(tie_word_embeddings=True),
                        timeout=180)
    ref_sd, ref_losses = tsm_models.train_reference("llama", tie_word_embeddings=True)
    assert torch.equal(ref_sd["lm_head.weight"], ref_sd["model.embed_tokens.weight"])
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, abs=TOL)
        assert tsm_models.max_diff(r["sd"], ref_sd) < TOL


@pytest.mark.parametrize("pad", [3, 70])  # a row in rank 0's and in rank 1's vocabulary half
def test_tp2_embedding_padding_idx(pad):
    """The padding row gets no gradient from padding tokens, as in HF, on whichever rank owns it
    (and no other row loses its gradient)."""
    results = run_ranks(_tp_train, 2, "llama", "sdpa", dict(pad_token_id=pad), timeout=180)
    ref_sd, ref_losses = tsm_models.train_reference("llama", pad_token_id=pad)
    assert tsm_models.max_diff(results[0]["sd"], ref_sd) < TOL


CLIP = 0.5  # below the tiny models' first gradient norms: clipping acts


def _tp_fsdp_train(kind, flavour, checkpointing=False):
    """TP over the fastest-varying mesh dim, FSDP1 (or fully_shard) over the data dim."""
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    from smshim.torch_sagemaker.parallelize import apply, clip_grad_norm_, full_hf_state_dict
    from smshim.torch_sagemaker.parallelize.api import find_plan

    mesh = _init((2, 2), ("dp", "tp"))
    model = tsm_models.make(kind)
    layer_cls = {type(m) for m in model.modules()
                 if type(m).__name__ == find_plan(model).layer_class}
    model = apply(model, tp_mesh=mesh["tp"])
    if flavour == "fsdp1":
        model = FSDP(model, device_mesh=mesh["dp"], use_orig_params=True,
                     device_id=torch.device("cpu"),
                     auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                        transformer_layer_cls=layer_cls))
    else:
        from torch.distributed.fsdp import fully_shard
        for m in model.modules():
            if type(m) in layer_cls:
                fully_shard(m, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    if checkpointing:  # as AWS's v2 scripts do after the FSDP wrap
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
        apply_activation_checkpointing(
            model, check_fn=lambda m: type(m) in layer_cls,
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                    checkpoint_impl=CheckpointImpl.NO_REENTRANT))
    dp = mesh["dp"].get_local_rank()
    losses, norms = tsm_models.train_ranks(model, lambda x: x.chunk(2)[dp], clip_grad_norm_, CLIP)
    return {"sd": full_hf_state_dict(model), "losses": losses, "norms": norms}


@pytest.mark.parametrize("kind,flavour,checkpointing", [
    ("llama", "fsdp1", False), ("gpt_neox", "fsdp1", False), ("llama", "fully_shard", False),
    ("gpt_neox", "fully_shard", False), ("llama", "fsdp1", True)])
def test_tp2_fsdp2_matches_one_process(kind, flavour, checkpointing):
    results = run_ranks(_tp_fsdp_train, 4, kind, flavour, checkpointing, timeout=300)
    ref_sd, ref_losses, ref_norms = tsm_models.train_reference(kind, clip=CLIP)
    assert ref_norms[0] > CLIP
    for r in results:
        assert r["norms"] == pytest.approx(ref_norms, abs=TOL)
        assert r["losses"] == pytest.approx(ref_losses, abs=TOL)
        assert tsm_models.max_diff(r["sd"], ref_sd) < TOL


def _rank0_load(kind):
    """Rank 0 holds the weights; ranks 1-3 build the model on meta. After the transform every
    rank's shards equal those of a transform where every rank loaded the weights."""
    import torch.distributed as dist
    from accelerate import init_empty_weights

    from smshim.torch_sagemaker.parallelize import apply, full_hf_state_dict

    mesh = _init((2, 2), ("dp", "tp"))
    if dist.get_rank() == 0:
        model = tsm_models.make(kind, seed=7)
    else:
        with init_empty_weights():
            model = tsm_models.make(kind, seed=123)
        assert all(p.is_meta for p in model.parameters())
    model = apply(model, tp_mesh=mesh["tp"], load_state_dict_from_rank0=True)
    x = tsm_models.batches(1)[0]
    logits = model(input_ids=x).logits
    return {"sd": full_hf_state_dict(model), "logits": logits.detach(),
            "buffers": {k: v.clone() for k, v in model.named_buffers()}}


@pytest.mark.parametrize("kind", ["llama", "gpt_neox"])
def test_load_state_dict_from_rank0(kind):
    results = run_ranks(_rank0_load, 4, kind, timeout=180)
    plain = tsm_models.make(kind, seed=7)
    ref = plain.state_dict()
    x = tsm_models.batches(1)[0]
    ref_logits = plain(input_ids=x).logits.detach()
    ref_buffers = dict(plain.named_buffers())
    for r in results:
        assert tsm_models.max_diff(r["sd"], ref) == 0.0
        torch.testing.assert_close(r["logits"], ref_logits, atol=1e-5, rtol=0)
        for k, v in r["buffers"].items():
            assert torch.equal(v, ref_buffers[k]), k


def _full_sd_loads_into_hf(kind):
    from smshim.torch_sagemaker.parallelize import apply, full_hf_state_dict

    mesh = _init((2,), ("tp",))
    model = apply(tsm_models.make(kind), tp_mesh=mesh["tp"])
    opt = tsm_models.optimizer(model)
    x = tsm_models.batches(1)[0]
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    return {"sd": full_hf_state_dict(model), "logits": model(input_ids=x).logits.detach()}


@pytest.mark.parametrize("kind", ["llama", "gpt_neox"])
def test_full_state_dict_loads_into_plain_hf(kind):
    r = run_ranks(_full_sd_loads_into_hf, 2, kind, timeout=120)[0]
    plain = tsm_models.make(kind, seed=99)
    plain.load_state_dict(r["sd"], strict=True)
    x = tsm_models.batches(1)[0]
    torch.testing.assert_close(plain(input_ids=x).logits, r["logits"], atol=1e-5, rtol=0)


def test_unsupported_model_names_supported_ones():
    import transformers as tf

    from smshim.torch_sagemaker.parallelize import UnsupportedModelError, apply

    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        apply(model, tp_mesh=None)


def test_indivisible_heads_refused_before_any_collective():
    from smshim.torch_sagemaker.parallelize import apply

    class FakeMesh:  # never used for communication: the check comes first
        def size(self):
            return 3

    with pytest.raises(ValueError, match="tensor_parallel_degree 3 must divide"):
        apply(tsm_models.make("llama"), tp_mesh=FakeMesh())


def _cp_train(kind, comm_type, tp):
    """CP over the slow mesh dim (inside the FSDP1 sharding group, which averages gradients
    over it), TP over the fast one; every CP rank holds its 2 of the 4 sequence chunks."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from smshim.torch_sagemaker.parallelize import apply, clip_grad_norm_, full_hf_state_dict, split_for_cp

    mesh = _init((2, tp), ("cp", "tp"))
    model = apply(tsm_models.make(kind), tp_mesh=mesh["tp"] if tp > 1 else None,
                  cp_mesh=mesh["cp"], cp_comm_type=comm_type)
    model = FSDP(model, device_mesh=mesh["cp"], use_orig_params=True, device_id=torch.device("cpu"))
    r = mesh["cp"].get_local_rank()
    losses, norms = tsm_models.train_ranks(model, lambda x: split_for_cp(x, r, 2), clip_grad_norm_,
                                           CLIP, average_over=None)
    return {"sd": full_hf_state_dict(model), "losses": losses, "norms": norms}


@pytest.mark.parametrize("kind,comm_type,tp", [("llama", "p2p", 1), ("llama", "all_gather", 1),
                                               ("gpt_neox", "p2p", 1), ("llama", "p2p", 2)])
def test_cp2_matches_one_process(kind, comm_type, tp):
    results = run_ranks(_cp_train, 2 * tp, kind, comm_type, tp, timeout=300)
    ref_sd, ref_losses, ref_norms = tsm_models.train_reference(kind, clip=CLIP)
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, abs=TOL)
        assert r["norms"] == pytest.approx(ref_norms, abs=TOL)
        assert tsm_models.max_diff(r["sd"], ref_sd) < TOL


def test_split_for_cp_layout():
    from smshim.torch_sagemaker.parallelize.context_parallel import merge_cp_parts, split_for_cp

    x = torch.arange(16).view(1, 16)
    parts = [split_for_cp(x, r, 2) for r in range(2)]
    assert parts[0].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert parts[1].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert torch.equal(merge_cp_parts(parts), x)
    with pytest.raises(ValueError, match="does not divide by 4"):
        split_for_cp(torch.zeros(1, 10), 0, 2)


def _ep_train(balancing, steps=3):
    """EP over 2 ranks that are also the data-parallel ranks: FSDP1 shards the rest of the model
    over them, the experts (split by EP) are kept out of FSDP."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from smshim.torch_sagemaker.parallelize import apply, clip_grad_norm_, full_hf_state_dict
    from smshim.torch_sagemaker.parallelize.moe.expert_parallel import ExpertParallelExperts
    from smshim.torch_sagemaker.parallelize.moe.moe_config import MoEConfig

    mesh = _init((2,), ("ep",))
    model = apply(tsm_models.make("mixtral"), tp_mesh=None, ep_mesh=mesh["ep"],
                  config=MoEConfig(moe_load_balancing=balancing))
    experts = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    local = sum(p.to_local().numel() for m in experts for p in m.parameters())
    model = FSDP(model, device_mesh=mesh["ep"], use_orig_params=True, ignored_modules=experts,
                 device_id=torch.device("cpu"))
    r = mesh["ep"].get_local_rank()
    losses, norms = tsm_models.train_ranks(model, lambda x: x.chunk(2)[r], clip_grad_norm_, CLIP,
                                           steps=steps, average_over=2)
    return {"sd": full_hf_state_dict(model), "losses": losses, "norms": norms,
            "local_expert_numel": local}


def test_ep2_mixtral_matches_one_process():
    results = run_ranks(_ep_train, 2, "none", timeout=240)
    ref_sd, ref_losses, ref_norms = tsm_models.train_reference("mixtral", clip=CLIP)
    full_experts = sum(v.numel() for k, v in ref_sd.items() if ".experts." in k)
    for r in results:
        assert r["local_expert_numel"] * 2 == full_experts
        assert r["losses"] == pytest.approx(ref_losses, abs=TOL)
        assert r["norms"] == pytest.approx(ref_norms, abs=TOL)
        assert tsm_models.max_diff(r["sd"], ref_sd) < TOL


@pytest.mark.parametrize("balancing", ["aux_loss", "sinkhorn", "balanced"])
def test_ep2_load_balancing_modes_train(balancing):
    """The balancing modes change routing (and add router losses): no exact reference, but the
    EP ranks agree on the model and the loss falls over a few steps on repeated data."""
    results = run_ranks(_ep_train_repeat, 2, balancing, timeout=240)
    a, b = results
    assert tsm_models.max_diff(a["sd"], b["sd"]) == 0.0
    assert a["losses"][-1] < a["losses"][0]


def _ep_train_repeat(balancing):
    tsm_models_batches = tsm_models.batches
    tsm_models.batches = lambda steps=3, **kw: tsm_models_batches(1, **kw) * 6
    return _ep_train(balancing)


def test_routing_helpers():
    from smshim.torch_sagemaker.parallelize.moe.routing import balanced_topk, sinkhorn

    torch.manual_seed(0)
    logits = torch.randn(32, 4) + torch.tensor([3.0, 0, 0, 0])  # expert 0 is everyone's favourite
    idx = balanced_topk(torch.softmax(logits, -1), 2)
    top2 = torch.topk(logits, 2).indices
    assert torch.bincount(top2.flatten(), minlength=4).max() == 32
    assert torch.bincount(idx.flatten(), minlength=4).max() <= 18  # ceil(32*2/4) + overflow
    assert all(len(set(row)) == 2 for row in idx.tolist())
    plain = torch.topk(logits, 1).indices.flatten()
    balanced = torch.topk(sinkhorn(logits), 1).indices.flatten()
    assert torch.bincount(balanced, minlength=4).max() < torch.bincount(plain, minlength=4).max()


def test_moe_config_and_refusals():
    from smshim.torch_sagemaker.parallelize import apply
    from smshim.torch_sagemaker.parallelize.moe.moe_config import MoEConfig

    cfg = MoEConfig()
    assert (cfg.smp_moe, cfg.random_seed, cfg.moe_load_balancing, cfg.global_token_shuffle,
            cfg.moe_all_to_all_dispatcher, cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff) == (
        True, 12345, "sinkhorn", False, True, 0.001, 0.001)
    with pytest.raises(ValueError, match="moe_load_balancing must be one of"):
        MoEConfig(moe_load_balancing="greedy")

    class FakeMesh:
        def size(self):
            return 2

    with pytest.raises(ValueError, match="cannot be combined with tensor_parallel_degree"):
        apply(tsm_models.make("mixtral"), tp_mesh=FakeMesh(), ep_mesh=FakeMesh(), config=cfg)
    with pytest.raises(Exception, match="expert parallelism needs a Mixture-of-Experts"):
        apply(tsm_models.make("llama"), tp_mesh=None, ep_mesh=FakeMesh())
    with pytest.raises(ValueError, match="sliding_window"):
        apply(tsm_models.make("mistral", sliding_window=8), tp_mesh=None, cp_mesh=FakeMesh())


def _dropout_streams():
    import torch.distributed as dist

    from smshim.torch_sagemaker.parallelize import apply

    mesh = _init((2,), ("tp",))
    model = apply(tsm_models.make("gpt_neox", attention_dropout=0.3, hidden_dropout=0.3),
                  tp_mesh=mesh["tp"], random_seed=5)
    model.train()
    seen = {}
    attn = model.gpt_neox.layers[0].attention

    def keep(key, fn):  # a forward pre-hook that returns None (a value would replace the inputs)
        def hook(m, a):
            seen.setdefault(key, fn(a))
        return hook

    attn.register_forward_pre_hook(keep("attn_rng", lambda a: torch.get_rng_state()))
    model.gpt_neox.final_layer_norm.register_forward_pre_hook(
        keep("replicated", lambda a: a[0].detach().clone()))
    x = tsm_models.batches(1)[0]
    model(input_ids=x, labels=x).loss.backward()
    default_after = torch.get_rng_state()
    out = [None, None]
    dist.all_gather_object(out, (seen["attn_rng"], seen["replicated"], default_after))
    return out


def test_random_seed_seeds_dropout_per_tp_rank():
    """Dropout inside split attention draws from random_seed + tp_rank (different masks per
    rank); dropout on replicated activations keeps the default stream (equal on every rank)."""
    r0, r1 = run_ranks(_dropout_streams, 2, timeout=120)[0]
    assert not torch.equal(r0[0], r1[0])  # TP-local streams differ
    assert torch.equal(r0[0], torch.Generator().manual_seed(5).get_state())  # tp_rank 0: seed 5
    assert torch.equal(r1[0], torch.Generator().manual_seed(6).get_state())
    assert torch.equal(r0[1], r1[1])  # replicated activations stayed equal
    assert torch.equal(r0[2], r1[2])  # default streams advanced alike


def _dcp_save_tp2(kind, path):
    """TP2 x FSDP1 shard 2: one step, then a sharded (DCP) checkpoint of the model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from smshim.torch_sagemaker.parallelize import apply, full_hf_state_dict

    mesh = _init((2, 2), ("dp", "tp"))
    model = FSDP(apply(tsm_models.make(kind), tp_mesh=mesh["tp"]), device_mesh=mesh["dp"],
                 use_orig_params=True, device_id=torch.device("cpu"))
    opt = tsm_models.optimizer(model)
    x = tsm_models.batches(1)[0].chunk(2)[mesh["dp"].get_local_rank()]
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    return full_hf_state_dict(model)


def _dcp_load_shard4(kind, path):
    """The plain HF model, TP1 x FSDP1 shard 4, loads the TP2 checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from smshim.torch_sagemaker.parallelize import full_hf_state_dict

    mesh = _init((4,), ("dp",))
    model = FSDP(tsm_models.make(kind, seed=42), device_mesh=mesh["dp"], use_orig_params=True,
                 device_id=torch.device("cpu"))
    sd = get_model_state_dict(model)
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd)
    return full_hf_state_dict(model)


def test_sharded_checkpoint_at_tp2_loads_at_tp1_shard4(tmp_path):
    saved = run_ranks(_dcp_save_tp2, 4, "llama", str(tmp_path), timeout=180)[0]
    loaded = run_ranks(_dcp_load_shard4, 4, "llama", str(tmp_path), timeout=180)
    for r in loaded:
        assert tsm_models.max_diff(r, saved) == 0.0


def _tp_fsdp_bf16():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision

    from smshim.torch_sagemaker.parallelize import apply, clip_grad_norm_

    mesh = _init((2, 2), ("dp", "tp"))
    model = FSDP(apply(tsm_models.make("llama"), tp_mesh=mesh["tp"]), device_mesh=mesh["dp"],
                 use_orig_params=True, device_id=torch.device("cpu"),
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                reduce_dtype=torch.bfloat16,
                                                buffer_dtype=torch.float32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = tsm_models.batches(1)[0].chunk(2)[mesh["dp"].get_local_rank()]
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        clip_grad_norm_(model, 1.0)
        opt.step()
        losses.append(loss.item())
    return losses, all(p.dtype == torch.float32 for p in model.parameters())


def test_tp2_fsdp_bf16_mixed_precision_trains():
    for losses, fp32_params in run_ranks(_tp_fsdp_bf16, 4, timeout=180):
        assert fp32_params
        assert losses[-1] < losses[0] - 0.05, losses


def _tp_hsdp_train():
    """TP2 x HYBRID_SHARD (shard 2 x 2 replicas) on 8 ranks: SMP's hybrid_shard_degree layout."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy

    from smshim.torch_sagemaker.parallelize import apply, clip_grad_norm_, full_hf_state_dict

    mesh = _init((2, 2, 2), ("rep", "shard", "tp"))
    model = FSDP(apply(tsm_models.make("llama"), tp_mesh=mesh["tp"]),
                 device_mesh=mesh["rep", "shard"], sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                 use_orig_params=True, device_id=torch.device("cpu"))
    opt = tsm_models.optimizer(model)
    dp = mesh["rep"].get_local_rank() * 2 + mesh["shard"].get_local_rank()
    norms = []
    for x in tsm_models.batches():
        x = x.chunk(4)[dp]
        opt.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        norms.append(clip_grad_norm_(model, CLIP).item())
        opt.step()
    return {"sd": full_hf_state_dict(model), "norms": norms}


def test_tp2_hybrid_shard2_x2_matches_one_process():
    results = run_ranks(_tp_hsdp_train, 8, timeout=300)
    ref_sd, _, ref_norms = tsm_models.train_reference("llama", clip=CLIP)
    for r in results:
        assert r["norms"] == pytest.approx(ref_norms, abs=TOL)
        assert tsm_models.max_diff(r["sd"], ref_sd) < TOL
