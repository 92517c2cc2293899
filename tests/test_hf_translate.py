"""The SPEC §7.6 state-dict translators (`smdistributed.modelparallel.torch.nn.huggingface.*`):
each family's Hugging Face state dict goes to smp's layout and back bit for bit, the smp layout
holds the tensors where smp's distributed transformer keeps them, and bad input is named."""

import pytest
import torch

transformers = pytest.importorskip("transformers")


def _models():
    from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel,
                              GPTJConfig, GPTJForCausalLM, GPTNeoConfig, GPTNeoForCausalLM,
                              RobertaConfig, RobertaForMaskedLM)

    torch.manual_seed(0)
    small = dict(vocab_size=40)
    return {
        "gpt2": GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=32, n_head=4, n_positions=16,
                                           bos_token_id=0, eos_token_id=0, **small)),
        "gptneo": GPTNeoForCausalLM(GPTNeoConfig(
            num_layers=2, hidden_size=32, num_heads=4, max_position_embeddings=16,
            attention_types=[[["global", "local"], 1]], bos_token_id=0, eos_token_id=0, **small)),
        "gptj": GPTJForCausalLM(GPTJConfig(n_layer=2, n_embd=32, n_head=4, n_positions=16,
                                           rotary_dim=4, bos_token_id=0, eos_token_id=0,
                                           **small)),
        "bert": BertForMaskedLM(BertConfig(num_hidden_layers=2, hidden_size=32,
                                           num_attention_heads=4, intermediate_size=64,
                                           max_position_embeddings=16, **small)),
        "roberta": RobertaForMaskedLM(RobertaConfig(num_hidden_layers=2, hidden_size=32,
                                                    num_attention_heads=4, intermediate_size=64,
                                                    max_position_embeddings=20, pad_token_id=1,
                                                    bos_token_id=0, eos_token_id=2, **small)),
    }


FROM_HF = {"gpt2": "translate_hf_state_dict_to_smdistributed_gpt2",
           "bert": "translate_hf_state_dict_to_smdistributed_bert",
           "roberta": "translate_hf_state_dict_to_smdistributed_roberta",
           "gptj": "translate_hf_gptj_state_dict_to_smdistributed_gptj",
           "gptneo": "translate_hf_state_dict_to_smdistributed_gptneo"}


def _funcs(family):
    import importlib

    mod = importlib.import_module(f"smdistributed.modelparallel.torch.nn.huggingface.{family}")
    return getattr(mod, f"translate_state_dict_to_hf_{family}"), getattr(mod, FROM_HF[family])


def _same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        # bit for bit: compare the raw bytes
        assert torch.equal(a[k].contiguous().view(torch.uint8) if a[k].dtype != torch.bool
                           else a[k], b[k].contiguous().view(torch.uint8)
                           if b[k].dtype != torch.bool else b[k]), k


@pytest.mark.parametrize("family", ["gpt2", "bert", "roberta", "gptj", "gptneo"])
def test_round_trip_is_bit_exact(family):
    model = _models()[family]
    to_hf, from_hf = _funcs(family)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    for dtype in (torch.float32, torch.bfloat16):
        hf = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
        smp = from_hf(hf)
        # Nothing of the transformer is left in Hugging Face's names.
        base = {"bert": "bert.", "roberta": "roberta."}.get(family, "transformer.")
        assert not [k for k in smp if k.startswith(base)
                    and not k.startswith("transformer.seq_layers.")], family
        assert any(k.startswith("transformer.seq_layers.1.attention.query.") for k in smp)
        _same(to_hf(smp), hf)
        # ... and the other way round
        _same(from_hf(to_hf(smp)), smp)
    # The plain HF class loads the translated dict strictly.
    fresh = type(model)(model.config)
    fresh.load_state_dict(to_hf(from_hf(model.state_dict())), strict=True)


def test_gpt2_layout_is_smp_transformer_layout():
    """GPT-2's fused Conv1D c_attn [H, 3H] becomes three Linear weights [H, H] (q, k, v, each
    transposed), and the Conv1D projections are transposed."""
    model = _models()["gpt2"]
    to_hf, from_hf = _funcs("gpt2")
    smp = from_hf(model.state_dict())
    attn = model.transformer.h[1].attn
    H = 32
    w = attn.c_attn.weight.detach()
    for j, name in enumerate(("query", "key", "value")):
        got = smp[f"transformer.seq_layers.1.attention.{name}.weight"]
        assert torch.equal(got, w[:, j * H:(j + 1) * H].t())
        assert torch.equal(smp[f"transformer.seq_layers.1.attention.{name}.bias"],
                           attn.c_attn.bias.detach()[j * H:(j + 1) * H])
    assert torch.equal(smp["transformer.seq_layers.1.output.dense_h_to_4h.weight"],
                       model.transformer.h[1].mlp.c_fc.weight.detach().t())
    assert torch.equal(smp["word_embedding.weight"], model.transformer.wte.weight.detach())
    assert torch.equal(smp["final_layernorm.weight"], model.transformer.ln_f.weight.detach())
    # The bare GPT2Model's state dict reads as the LM model's transformer.
    bare = from_hf(model.transformer.state_dict())
    assert set(bare) == set(smp) - {"lm_head.weight"}
    # max_seq_len brings back transformers 4.x's causal-mask buffers, which the way in drops.
    old = to_hf(smp, max_seq_len=16)
    assert old["transformer.h.2.attn.bias"].shape == (1, 1, 16, 16)
    assert set(from_hf(old)) == set(smp)


def test_errors_name_the_keys():
    to_hf, from_hf = _funcs("gpt2")
    smp = from_hf(_models()["gpt2"].state_dict())
    del smp["transformer.seq_layers.0.attention.key.weight"]
    with pytest.raises(KeyError, match="seq_layers.0.attention.key.weight"):
        to_hf(smp)
    with pytest.raises(ValueError, match="max_seq_len"):
        to_hf({}, max_seq_len=0)
    with pytest.raises(TypeError, match="dict"):
        from_hf([1, 2])
    from smdistributed.modelparallel.torch.nn.huggingface import roberta
    assert roberta.translate_state_dict_to_smdistributed is \
        roberta.translate_hf_state_dict_to_smdistributed_roberta
