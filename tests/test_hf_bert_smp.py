"""Hugging Face BERT and RoBERTa masked LMs created under `smp.model_creation(tensor_parallelism=
True)` run as smp's distributed transformer (SPEC §7.6) and, from the same weights (loaded through
the documented translators), train at tp 2 exactly like the Hugging Face model in one process on
the global batch; the full checkpoint is Hugging Face's layout."""

import os

import pytest
import torch

from smshim.testing import run_ranks

pytest.importorskip("transformers")

TOL = 1e-5
VOCAB, SEQ, BATCH, STEPS = 48, 10, 8, 3


def _make(family, seed=1):
    from transformers import BertConfig, BertForMaskedLM, RobertaConfig, RobertaForMaskedLM

    C, M = ((BertConfig, BertForMaskedLM) if family == "bert"
            else (RobertaConfig, RobertaForMaskedLM))
    cfg = C(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=SEQ + 4, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, pad_token_id=1, type_vocab_size=2,
            initializer_range=0.2)
    torch.manual_seed(seed)
    return M(cfg)


def _data():
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
        mask = torch.ones_like(ids)
        mask[1::3, -2:] = 0
        ids = ids.masked_fill(mask == 0, 1)  # padding token
        types = (torch.arange(SEQ) >= SEQ // 2).long().expand(BATCH, SEQ).contiguous()
        labels = ids.masked_fill(torch.rand(BATCH, SEQ, generator=g) < 0.5, -100)
        labels[:, 0] = ids[:, 0]  # at least one label per sequence
        out.append((ids, mask, types, labels))
    return out


def _train(family, cfg, ckpt_dir):
    import smdistributed.modelparallel.torch as smp
    from smdistributed.modelparallel.torch.nn.huggingface import bert, roberta

    from_hf = (bert.translate_hf_state_dict_to_smdistributed_bert if family == "bert"
               else roberta.translate_hf_state_dict_to_smdistributed_roberta)
    smp.init(cfg)
    torch.manual_seed(50 + smp.rank())
    with smp.model_creation(tensor_parallelism=True):
        hf = _make(family, seed=50 + smp.rank())
    model = smp.DistributedModel(hf)
    module = model.get_module()
    info = {"type": type(module).__name__,
            "layers": [type(c).__name__ for c in module.transformer.seq_layers.children()]}
    model.load_state_dict(from_hf(_make(family).state_dict()))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    @smp.step
    def train_step(model, ids, mask, types, labels):
        out = model(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels)
        model.backward(out["loss"])
        return out["loss"]

    n, r = smp.dp_size(), smp.dp_rank()
    k = BATCH // n
    for batch in _data():
        opt.zero_grad()
        train_step(model, *(t[r * k:(r + 1) * k] for t in batch))
        opt.step()
    smp.save_checkpoint(ckpt_dir, "full", partial=False, model=model)
    return info


def _reference(family, parts=4):
    model = _make(family)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    k = BATCH // parts
    for ids, mask, types, labels in _data():
        opt.zero_grad()
        loss = sum(model(input_ids=ids[i * k:(i + 1) * k], attention_mask=mask[i * k:(i + 1) * k],
                         token_type_ids=types[i * k:(i + 1) * k],
                         labels=labels[i * k:(i + 1) * k]).loss for i in range(parts)) / parts
        loss.backward()
        opt.step()
    return model


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_masked_lm_tp2_trains_as_hf(tmp_path, family):
    cfg = {"tensor_parallel_degree": 2, "microbatches": 2}
    results = run_ranks(_train, 2, family, cfg, str(tmp_path), timeout=240)
    for r in results:
        assert r["type"] == "DistributedBertForMaskedLM"
        assert r["layers"] == ["DistributedTransformerLayer"] * 2
    ref = _reference(family)
    full = torch.load(os.path.join(tmp_path, "full"), weights_only=True)  # Hugging Face layout
    plain = type(ref)(ref.config)
    plain.load_state_dict(full, strict=True)
    for k, v in ref.state_dict().items():
        diff = (full[k] - v).abs().max().item()
        assert diff < TOL, f"{k}: max abs diff {diff}"
