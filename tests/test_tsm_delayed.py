"""Delayed parameter initialisation: a Llama built on meta gets, under the script's FSDP call with
DelayedParamIniter's functions, exactly the weights eager construction gives with the same seed."""


import pytest
import torch

from smshim.testing import run_ranks
from tests import tsm_helpers as h


def _delayed(hsd, validate_enabled=True):
    import torch.distributed as dist
    import torch.sagemaker as tsm
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    dist.init_process_group("gloo")
    tsm.init({"hybrid_shard_degree": hsd})
    from torch.sagemaker.delayed_param import DelayedParamIniter

    torch.manual_seed(0)
    with init_empty_weights():
        model = LlamaForCausalLM(h.llama_config())
    assert all(p.is_meta for p in model.parameters())
    initer = DelayedParamIniter(model)
    with initer.validate_params_and_buffers_inited(validate_enabled):
        fsdp = h.wrap(model, param_init_fn=initer.get_param_init_fn(),
                      post_param_init_fn=initer.get_post_param_init_fn(), sync_module_states=False)
    local = sum(p.numel() for p in fsdp.parameters())
    return h.full_state_dict(fsdp), local


def test_delayed_init_equals_eager_init_at_shard_2():
    results = run_ranks(_delayed, 4, 2, timeout=240)
    eager = h.make_llama(seed=0).state_dict()
    full, _ = results[0]
    assert sorted(full) == sorted(eager)
    for k in eager:
        assert torch.equal(full[k], eager[k]), k
    total = sum(v.numel() for v in eager.values())
    assert all(local < total for _, local in results)  # each rank materialised its shard only


def test_per_module_fallback_without_exact_replica(monkeypatch):
    """Above the size limit each module initialises itself: nothing left on meta, HF's scheme."""
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    from smshim.torch_sagemaker.delayed_param import DelayedParamIniter

    monkeypatch.setenv("SMSHIM_TSM_EXACT_INIT_MAX_MB", "0")
    with init_empty_weights():
        model = LlamaForCausalLM(h.llama_config())
    initer = DelayedParamIniter(model)
    with initer.validate_params_and_buffers_inited():
        for m in list(model.modules()):
            initer.get_param_init_fn()(m)
    w = model.model.layers[0].mlp.up_proj.weight
    assert not w.is_meta
    assert abs(w.std().item() - model.config.initializer_range) < 0.005
    assert torch.equal(model.model.norm.weight, torch.ones(32))


def test_validation_names_what_is_left_on_meta():
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    from smshim.torch_sagemaker.delayed_param import DelayedParamIniter

    with init_empty_weights():
        model = LlamaForCausalLM(h.llama_config())
    initer = DelayedParamIniter(model)
    try:
        with initer.validate_params_and_buffers_inited():
            pass  # FSDP never called the init function
    except AssertionError as e:
        assert "still on meta" in str(e) and "embed_tokens" in str(e)
    else:
        raise AssertionError("validation passed with every parameter on meta")


def _finetune_flow(hsd=2):
    """[FT]: rank 0 holds the pretrained weights, the others build on meta with a
    DelayedParamIniter; FSDP sync_module_states=True spreads rank 0's weights (HSDP: over the
    sharding group and across replicas; hybrid_shard_degree 1: over every rank, though FSDP's own
    group is each rank alone)."""
    import torch.distributed as dist
    import torch.sagemaker as tsm
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    dist.init_process_group("gloo")
    tsm.init({"hybrid_shard_degree": hsd})
    from torch.sagemaker.delayed_param import DelayedParamIniter

    extra = {}
    if dist.get_rank() == 0:
        model = h.make_llama(seed=3)  # "from_pretrained"
    else:
        torch.manual_seed(0)
        with init_empty_weights():
            model = LlamaForCausalLM(h.llama_config())
        initer = DelayedParamIniter(model)
        extra = {"param_init_fn": initer.get_param_init_fn(),
                 "post_param_init_fn": initer.get_post_param_init_fn()}
    fsdp = h.wrap(model, sync_module_states=True, **extra)
    return h.full_state_dict(fsdp), [p.detach().clone() for p in fsdp.parameters()]


@pytest.mark.parametrize("hsd", [2, 1])
def test_finetune_flow_spreads_rank0_weights(hsd):
    results = run_ranks(_finetune_flow, 4, hsd, timeout=240)
    pretrained = h.make_llama(seed=3).state_dict()
    full, _ = results[0]
    for k, v in pretrained.items():
        assert torch.equal(full[k], v), k
    # Replicas hold identical shards: rank 2 mirrors rank 0, rank 3 mirrors rank 1.
    for a, b in ((0, 2), (1, 3)):
        assert all(torch.equal(x, y) for x, y in zip(results[a][1], results[b][1]))
