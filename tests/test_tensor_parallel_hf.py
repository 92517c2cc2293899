"""Hugging Face GPT-NeoX and BERT blocks under `smp.set_tensor_parallelism` train exactly like
single-process training of the same model (3 steps, parameters within 1e-5), and blocks whose
mapping would not be exact stay whole."""

import pytest
import torch

from smshim.testing import run_ranks
from tests import tp_models
from tests.test_tensor_parallel import _check, _train

# Per model: the sharded projections of its two blocks.
SHARDED = {"gpt_neox": 2 * 4, "gpt_neox_sdpa": 2 * 4, "bert": 2 * 6}


# gpt_neox: eager attention, parallel and sequential residual, partial rotary, per-example
# positions; gpt_neox_sdpa: the same with sdpa and padding in some microbatches (the TP ranks'
# masks then differ in kind); bert: sdpa, token types, padding.
@pytest.mark.parametrize("kind", ["gpt_neox", "gpt_neox_sdpa", "bert"])
@pytest.mark.parametrize("prescaled", [False, True])
def test_set_tensor_parallelism_hf_tp2(kind, prescaled):
    cfg = {"tensor_parallel_degree": 2, "microbatches": 2, "prescaled_batch": prescaled}
    results = run_ranks(_train, 2, kind, cfg, True, timeout=240)
    assert results[0]["distributed"].count("ShardedLinear") == SHARDED[kind]
    _check(results, kind)
    full = sum(v.numel() for v in tp_models.make(kind, dist=False).parameters())
    assert all(r["per_rank"] < full for r in results)


def test_set_tensor_parallelism_hf_gpt_neox_pp2_tp2():
    """The GPT-NeoX blocks split in place also run as remote modules of a 2-stage pipeline: block
    1 and the head on stage 1, called with the (cos, sin) pair and the mask from stage 0."""
    cfg = {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2,
           "auto_partition": False, "default_partition": 0}
    manual = {"lm.gpt_neox.layers.1": 1, "lm.lm_head": 1}
    results = run_ranks(_train, 4, "gpt_neox", cfg, True, None, manual, timeout=360)
    _check(results, "gpt_neox")
    # Stage 1 (pp_rank 1: global ranks 2, 3) holds block 1's shards, not only the head's.
    head = tp_models.VOCAB * tp_models.HIDDEN // 2
    assert all(r["local"] > head for r in results if r["rank"] >= 2), results


def _which_blocks(cfg):
    import smdistributed.modelparallel.torch as smp
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    smp.init(cfg)
    torch.manual_seed(0)
    cross = BertLayer(BertConfig(hidden_size=16, num_attention_heads=4, intermediate_size=32,
                                 is_decoder=True, add_cross_attention=True))
    root = torch.nn.ModuleDict({
        "neox_3_heads": tp_models.GPTNeoX(heads=3).lm.gpt_neox.layers[0],
        "bert_inter_31": tp_models.Bert(intermediate=31).lm.bert.encoder.layer[0],
        "bert_cross": cross,
        "neox": tp_models.GPTNeoX().lm.gpt_neox.layers[0],
        "bert": tp_models.make("bert", dist=False).lm.bert.encoder.layer[0],
    })
    smp.set_tensor_parallelism(root)
    model = smp.DistributedModel(root)
    return {n: type(m).__name__ for n, m in model.module.named_modules() if n}


def test_blocks_not_exactly_splittable_stay_whole():
    """3 heads or an intermediate size of 31 at tp=2, and a BERT block with cross attention,
    stay whole: no projection inside them is split either. The divisible blocks next to them are
    split."""
    types = run_ranks(_which_blocks, 2, {"tensor_parallel_degree": 2}, timeout=120)[0]
    for block in ("neox_3_heads", "bert_inter_31", "bert_cross"):
        inside = {n: t for n, t in types.items() if n.startswith(block + ".")}
        assert inside and not any(t.startswith(("Sharded", "Distributed"))
                                  for t in inside.values()), inside
    assert types["neox.attention.query_key_value"] == "ShardedLinear"
    assert types["bert.attention.self.query"] == "ShardedLinear"
    assert types["bert.output.dense"] == "ShardedLinear"


def _mismatched_call(cfg):
    import smdistributed.modelparallel.torch as smp

    smp.init(cfg)
    block = tp_models.make("bert", dist=False).lm.bert.encoder.layer[0]
    root = torch.nn.ModuleDict({"layer": block})
    smp.set_tensor_parallelism(root)
    model = smp.DistributedModel(root)
    layer = model.module["layer"]
    torch.manual_seed(smp.tp_rank())
    out = {"type": type(layer.attention.self.query).__name__}
    # Same shapes on both ranks, a per-example mask on rank 1 only (rank 0's batch "has no
    # padding"): rank 0 fills in the all-attend mask, and each rank gets its own rows of the
    # unsplit layer's result.
    h = torch.randn(2, tp_models.SEQ, tp_models.HIDDEN)
    mask = None
    if smp.tp_rank() == 1:
        mask = torch.ones(2, 1, tp_models.SEQ, tp_models.SEQ, dtype=torch.bool)
        mask[0, :, :, -1] = False
    out["got"] = layer(h, mask).detach()
    out["h"], out["mask"] = h, mask
    # Different sequence lengths: an error naming the argument, not a hang in the gather.
    try:
        layer(torch.randn(2, tp_models.SEQ - smp.tp_rank(), tp_models.HIDDEN))
        out["error"] = None
    except smp.SMPRuntimeError as e:
        out["error"] = str(e)
    return out


def test_tp_ranks_agree_on_what_they_gather():
    """prescaled_batch false: a mask None on one TP rank and per-example on its peer is filled in
    (BERT is bidirectional: None means attend everywhere); batches of different shapes raise an
    error naming the argument instead of hanging in the gather."""
    results = run_ranks(_mismatched_call, 2, {"tensor_parallel_degree": 2}, timeout=120)
    assert results[0]["type"] == "ShardedLinear"
    ref = tp_models.make("bert", dist=False).lm.bert.encoder.layer[0]
    for r in results:
        mask = r["mask"]
        if mask is None:
            mask = torch.ones(2, 1, tp_models.SEQ, tp_models.SEQ, dtype=torch.bool)
        want = ref(r["h"], mask)
        assert (r["got"] - want).abs().max().item() < 1e-5
        assert r["error"] and "`hidden_states`" in r["error"], r["error"]


def _recorded_outputs(cfg):
    import smdistributed.modelparallel.torch as smp

    smp.init(cfg)
    module = tp_models.make("gpt_neox", dist=False)
    smp.set_tensor_parallelism(module)
    model = smp.DistributedModel(module)
    g = torch.Generator().manual_seed(10 + smp.tp_rank())  # each TP rank its own batch
    ids = torch.randint(0, tp_models.VOCAB, (2, tp_models.SEQ), generator=g)
    with torch.no_grad():
        out = model.module.lm(input_ids=ids, output_attentions=True, output_hidden_states=True)
    return {"ids": ids, "attentions": [a.clone() for a in out.attentions],
            "hidden": [h.clone() for h in out.hidden_states], "logits": out.logits.clone()}


def test_recorded_attentions_and_hidden_states_tp2():
    """`output_attentions` / `output_hidden_states` (eager GPT-NeoX, batches differing by TP rank)
    return what the unsplit model returns for this rank's batch: all heads, this rank's rows."""
    results = run_ranks(_recorded_outputs, 2, {"tensor_parallel_degree": 2}, timeout=120)
    ref = tp_models.make("gpt_neox", dist=False).lm
    for r in results:
        with torch.no_grad():
            want = ref(input_ids=r["ids"], output_attentions=True, output_hidden_states=True)
        assert len(r["attentions"]) == len(want.attentions) == 2
        for got, w in zip(r["attentions"] + r["hidden"] + [r["logits"]],
                          list(want.attentions) + list(want.hidden_states) + [want.logits]):
            assert got.shape == w.shape and (got - w).abs().max().item() < 1e-5
