"""A Hugging Face GPT-2 created under `smp.model_creation(tensor_parallelism=True)` runs as smp's
distributed transformer (SPEC §7.6): `get_module().transformer.seq_layers` is an nn.Sequential of
DistributedTransformerLayers, it takes Hugging Face's keyword arguments and returns its output
type, and after loading the same weights through `translate_hf_state_dict_to_smdistributed_gpt2`
it trains exactly like `GPT2LMHeadModel` in one process on the global batch (tp 2, pp 2 x tp 2,
tp 1). Its full checkpoint is Hugging Face's layout and gives the same logits in the plain class;
activation checkpointing of seq_layers (each / group_2 / contiguous) and of each layer's
`.attention` / `.output` gives the same gradients as none."""

import os

import pytest
import torch

from smshim.testing import run_ranks

pytest.importorskip("transformers")

TOL = 1e-5
VOCAB, SEQ, BATCH, STEPS = 64, 12, 8, 3


def _config(n_layer=3, family="gpt2"):
    from transformers import GPT2Config, GPTJConfig, GPTNeoConfig

    if family == "gptj":  # rotary on half of each head's 8 features, untied head with a bias
        return GPTJConfig(vocab_size=VOCAB, n_embd=32, n_layer=n_layer, n_head=4, n_positions=16,
                          rotary_dim=4, embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0,
                          bos_token_id=0, eos_token_id=0, initializer_range=0.2, use_cache=False)

    if family == "gptneo":  # global and local (window 4) layers in turn
        return GPTNeoConfig(vocab_size=VOCAB, hidden_size=32, num_layers=n_layer, num_heads=4,
                            max_position_embeddings=16, window_size=4,
                            attention_types=[[["global", "local"], 1], [["global"], 1]],
                            embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0,
                            bos_token_id=0, eos_token_id=0, initializer_range=0.2,
                            use_cache=False)
    return GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=n_layer, n_head=4,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                      bos_token_id=0, eos_token_id=0, initializer_range=0.2)


def _hf(n_layer=3, seed=1, family="gpt2"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(_config(n_layer, family))


def _translators(family):
    from smdistributed.modelparallel.torch.nn.huggingface import gpt2, gptj, gptneo

    if family == "gptj":
        return (gptj.translate_state_dict_to_hf_gptj,
                gptj.translate_hf_gptj_state_dict_to_smdistributed_gptj)
    if family == "gptneo":
        return (gptneo.translate_state_dict_to_hf_gptneo,
                gptneo.translate_hf_state_dict_to_smdistributed_gptneo)
    return gpt2.translate_state_dict_to_hf_gpt2, gpt2.translate_hf_state_dict_to_smdistributed_gpt2


def _data():
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        mask = torch.ones_like(ids)
        mask[1::3, -3:] = 0  # right padding in some sequences
        labels = ids.masked_fill(mask == 0, -100)
        out.append((ids, mask, labels))
    return out


def _optimizer(params, kind):
    if kind == "adam":
        # eps well above rounding noise: GPT-2's key bias has a gradient of exactly zero in exact
        # arithmetic (softmax ignores a per-row constant), i.e. rounding noise of ~1e-9, which
        # Adam with its default eps would turn into +-lr steps in both implementations alike.
        return torch.optim.Adam(params, lr=1e-3, eps=1e-5)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _train_smp(cfg, opt_kind="sgd", manual=None, ckpt_dir=None, n_layer=3, strategy=None,
               family="gpt2"):
    import smdistributed.modelparallel.torch as smp
    from transformers import AutoModelForCausalLM

    smp.init(cfg)
    torch.manual_seed(100 + smp.rank())  # the model's own init differs per rank: weights loaded
    with smp.model_creation(tensor_parallelism=True, fused_softmax=True, fused_bias_gelu=True,
                            attention_in_fp32=False, query_key_layer_scaling=False):
        model = AutoModelForCausalLM.from_config(_config(n_layer, family))
    model = smp.DistributedModel(model, trace_device="gpu")
    module = model.get_module()
    info = {"type": type(module).__name__,
            "is_lmhead": isinstance(module, smp.nn.DistributedTransformerLMHead),
            "seq": type(module.transformer.seq_layers).__name__,
            "layers": [type(c).__name__ for c in module.transformer.seq_layers.children()
                       if isinstance(c, smp.nn.DistributedTransformerLayer)],
            "sub": [(type(c.attention).__name__, type(c.output).__name__)
                    for c in module.transformer.seq_layers.children()]}
    model.load_state_dict(_translators(family)[1](_hf(n_layer, family=family).state_dict()))
    for name, pid in (manual or {}).items():
        smp.set_partition(module.get_submodule(name), pid)
    if strategy is not None:
        smp.set_activation_checkpointing(module.transformer.seq_layers, strategy=strategy)
    # Forward calls of the layers' query projections on this rank (the owner runs them; a
    # checkpointed layer runs them again in backward).
    calls = []
    for c in module.transformer.seq_layers.children():
        c.attention.query.register_forward_hook(lambda *a: calls.append(1))
    opt = smp.DistributedOptimizer(_optimizer(model.parameters(), opt_kind))

    @smp.step
    def train_step(model, ids, mask, labels):
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        model.backward(out["loss"])
        return out["loss"]

    # prescaled_batch: the TP ranks of a group read the same rows (sharded by rdp_rank); else
    # every rank of the DP group reads its own.
    n, r = (smp.rdp_size(), smp.rdp_rank()) if cfg.get("prescaled_batch") else \
        (smp.dp_size(), smp.dp_rank())
    k = BATCH // n
    for ids, mask, labels in _data():
        opt.zero_grad()
        train_step(model, ids[r * k:(r + 1) * k], mask[r * k:(r + 1) * k],
                   labels[r * k:(r + 1) * k])
        opt.step()
    info["query_calls"] = len(calls)
    full = model.state_dict() if smp.rdp_rank() == 0 else None
    info.update(full=full, rank=smp.rank())
    if ckpt_dir is not None:
        smp.save_checkpoint(ckpt_dir, "full", partial=False, model=model)
        # ... and resumes (translated back to smp's layout on the way in)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        smp.resume_from_checkpoint(ckpt_dir, tag="full", partial=False, load_optimizer=False)
        again = model.state_dict()
        if full is not None:
            info["resumed_equal"] = all(torch.equal(again[k], v) for k, v in full.items())
        ids = _data()[0][0]
        model.eval()
        with torch.no_grad():
            out = model.get_module()(input_ids=ids)
        info["logits"], info["ids"] = out.logits, ids
        info["output_type"] = type(out).__name__
    return info


def _reference(opt_kind="sgd", n_layer=3, parts=4, family="gpt2"):
    model = _hf(n_layer, family=family)
    opt = _optimizer(model.parameters(), opt_kind)
    for ids, mask, labels in _data():
        opt.zero_grad()
        # The per-rank means are over equal numbers of sequences but not of tokens (padding):
        # smp averages the ranks' / microbatches' losses, so the reference does the same.
        k = BATCH // parts
        loss = sum(model(input_ids=ids[i * k:(i + 1) * k], attention_mask=mask[i * k:(i + 1) * k],
                         labels=labels[i * k:(i + 1) * k]).loss for i in range(parts)) / parts
        loss.backward()
        opt.step()
    return model


def _check(results, opt_kind="sgd", n_layer=3, parts=4, family="gpt2"):
    """parts: the microbatches of all data-parallel replicas of one step (their losses are
    averaged)."""
    translate_state_dict_to_hf_gpt2 = _translators(family)[0]  # (or GPT-Neo's)
    ref = _reference(opt_kind, n_layer, parts, family).state_dict()
    checked = 0
    kind = {"gpt2": "DistributedGPT2LMHead", "gptneo": "DistributedGPTNeoForCausalLM",
            "gptj": "DistributedGPTJForCausalLM"}[family]
    layer = "GPTJLayer" if family == "gptj" else "DistributedTransformerLayer"
    for r in results:
        assert r["type"] == kind and r["is_lmhead"], r["type"]
        assert r["seq"] == "Sequential"
        assert r["layers"] == [layer] * n_layer
        assert r["sub"] == [("DistributedAttentionLayer",
                             "DistributedTransformerOutputLayer")] * n_layer
        if r["full"] is None:
            continue
        assert "transformer.seq_layers.0.attention.query.weight" in r["full"]  # smp's layout
        got = translate_state_dict_to_hf_gpt2(r["full"])
        assert sorted(got) == sorted(ref)
        for k, v in ref.items():
            diff = (got[k] - v).abs().max().item()
            assert diff < TOL, f"rank {r['rank']}: {k}: max abs diff {diff}"
        checked += 1
    assert checked


def test_gpt2_tp2_trains_as_hf_gpt2_sgd(tmp_path):
    """tp 2, 2 microbatches, per-rank batches gathered by the TP modules (prescaled_batch
    false); then the full checkpoint in Hugging Face's layout loads into GPT2LMHeadModel."""
    from transformers import GPT2LMHeadModel

    cfg = {"tensor_parallel_degree": 2, "microbatches": 2}
    results = run_ranks(_train_smp, 2, cfg, "sgd", None, str(tmp_path), timeout=240)
    _check(results)
    full = torch.load(os.path.join(tmp_path, "full"), weights_only=True)
    assert "transformer.h.0.attn.c_attn.weight" in full
    plain = GPT2LMHeadModel(_config())
    plain.load_state_dict(full, strict=True)
    plain.eval()
    assert results[0]["resumed_equal"]
    for r in results:
        assert r["output_type"] == "CausalLMOutputWithCrossAttentions"
        with torch.no_grad():
            want = plain(input_ids=r["ids"]).logits
        assert (r["logits"] - want).abs().max().item() < TOL


def test_gpt2_tp2_prescaled_adam():
    cfg = {"tensor_parallel_degree": 2, "microbatches": 2, "prescaled_batch": True}
    # prescaled: both TP ranks read the same rows; one replica, two microbatches of 4 rows.
    results = run_ranks(_train_smp, 2, cfg, "adam", timeout=240)
    _check(results, "adam", parts=2)


def test_gpt2_pp2_tp2_manual_partition():
    """4 ranks: layers 1 and 2 on stage 1 (as the AWS script's set_partition on seq_layers'
    children), embeddings, layer 0, final layernorm and head on stage 0; seq_layers checkpointed
    with strategy "contiguous" (one unit per stage's run of layers)."""
    cfg = {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2,
           "auto_partition": False, "default_partition": 0}
    manual = {"transformer.seq_layers.1": 1, "transformer.seq_layers.2": 1}
    results = run_ranks(_train_smp, 4, cfg, "sgd", manual, None, 3, "contiguous", timeout=360)
    _check(results)
    # 3 steps x 2 microbatches x 3 layers x 2 TP ranks, each layer run twice (recomputed)
    assert sum(r["query_calls"] for r in results) == 2 * 36, [r["query_calls"] for r in results]


@pytest.mark.parametrize("family", ["gptneo", "gptj"])
def test_gptneo_gptj_tp2_train_as_hf(family):
    """GPT-Neo (unscaled attention, bias-free q/k/v, a local-attention layer) and GPT-J (rotary,
    parallel attention + MLP, untied head with a bias) the same way."""
    cfg = {"tensor_parallel_degree": 2, "microbatches": 2}
    results = run_ranks(_train_smp, 2, cfg, "sgd", None, None, 3, None, family, timeout=240)
    _check(results, family=family)


def test_gpt2_tp1_is_smp_transformer_whole():
    """tp 1 (the AWS script's use_distributed_transformer at tp 1): the same replacement, whole,
    with data parallelism over 2 ranks."""
    cfg = {"tensor_parallel_degree": 1, "microbatches": 2, "ddp": True}
    results = run_ranks(_train_smp, 2, cfg, "sgd", timeout=240)
    _check(results)


# ---- activation checkpointing --------------------------------------------------------------
def _grads_with_checkpointing(cfg, variants):
    import smdistributed.modelparallel.torch as smp
    from smdistributed.modelparallel.torch.nn.huggingface.gpt2 import (
        translate_hf_state_dict_to_smdistributed_gpt2)

    smp.init(cfg)
    ids, mask, labels = _data()[0]
    k = BATCH // smp.dp_size()
    r = smp.dp_rank()
    out = {}
    for variant in variants:
        smp.reset()
        with smp.model_creation(tensor_parallelism=True):
            hf = _hf(4)
        model = smp.DistributedModel(hf)
        seq = model.get_module().transformer.seq_layers
        if variant == "sublayers":
            for c in seq.children():
                smp.set_activation_checkpointing(c.attention)
                smp.set_activation_checkpointing(c.output)
        elif variant is not None:
            smp.set_activation_checkpointing(seq, strategy=variant)
        model.load_state_dict(translate_hf_state_dict_to_smdistributed_gpt2(_hf(4).state_dict()))
        calls = []
        # (on a projection inside the attention: a checkpointed module's recomputation calls its
        # forward function, not the module, so its own hooks would not see it)
        handles = [c.attention.query.register_forward_hook(lambda *a: calls.append(1))
                   for c in seq.children()]

        @smp.step
        def step(model, ids, mask, labels):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels)["loss"]
            model.backward(loss)
            return loss

        step(model, ids[r * k:(r + 1) * k], mask[r * k:(r + 1) * k], labels[r * k:(r + 1) * k])
        for h in handles:
            h.remove()
        out[variant] = {"grads": {n: p.grad.clone() for n, p in model.local_named_parameters()},
                        "attention_calls": len(calls)}
    return out


def test_activation_checkpointing_of_seq_layers_same_gradients():
    cfg = {"tensor_parallel_degree": 2, "microbatches": 2}
    variants = [None, "each", "group_2", "contiguous", "sublayers"]
    results = run_ranks(_grads_with_checkpointing, 2, cfg, variants, timeout=300)
    for r in results:
        base = r[None]
        # 4 layers x 2 microbatches: 8 attention forwards; recomputed once more when checkpointed
        assert base["attention_calls"] == 8
        for v in variants[1:]:
            assert r[v]["attention_calls"] == 16, (v, r[v]["attention_calls"])
            assert sorted(r[v]["grads"]) == sorted(base["grads"])
            for n, g in base["grads"].items():
                diff = (r[v]["grads"][n] - g).abs().max().item()
                assert diff < TOL, (v, n, diff)
