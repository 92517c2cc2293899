"""Shared pieces of the SMP v2 (`torch.sagemaker`) tests: a tiny HF Llama, a fixed global batch,
single-process reference training, and a rank function that trains under the script's own FSDP."""

from __future__ import annotations

import functools

import torch

STEPS = 3
GLOBAL_BATCH = 8
SEQ = 8
VOCAB = 100
LR = 1e-2


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                       max_position_embeddings=64, attn_implementation="eager",
                       use_cache=False)  # as the scripts: no KV cache under checkpointing


def make_llama(seed: int = 0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config())


def batches(steps: int = STEPS, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g) for _ in range(steps)]


def reference(steps: int = STEPS):
    """One process, the whole global batch: the parameters every distributed run must reach."""
    model = make_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x in batches(steps):
        opt.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def decoder_layer_cls():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def wrap(model, strategy: str = "HYBRID_SHARD", **extra):
    """The FSDP call of AWS's v2 scripts, unchanged (no process groups: SMP supplies them)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={decoder_layer_cls()})
    return FSDP(model, auto_wrap_policy=policy,
                mixed_precision=MixedPrecision(torch.float32, torch.float32, torch.float32),
                sharding_strategy=getattr(ShardingStrategy, strategy),
                device_id=torch.device("cuda", 0) if torch.cuda.is_available() else None,
                use_orig_params=True, **extra)


def full_state_dict(model):
    """What scripts take at the end: rank 0 only, offloaded to the CPU."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def sharded_state_dict(model, opt=None):
    """What AWS's scripts save: the SHARDED_STATE_DICT of the model (and of `opt`, if given)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sd = {"model": model.state_dict()}
        if opt is not None:
            sd["optimizer"] = FSDP.optim_state_dict(model, opt)
    return sd


def local_batch(x, dp_rank: int, dp_size: int):
    per = x.shape[0] // dp_size
    return x[dp_rank * per:(dp_rank + 1) * per]


def checkpoint_layers(model, impl: str = "REENTRANT", offload: bool = False):
    """AWS's scripts: activation checkpointing on every decoder layer after FSDP, then (with
    sm_activation_offloading) torch's offload_wrapper on the root."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper, offload_wrapper)

    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                       checkpoint_impl=getattr(CheckpointImpl, impl)),
        check_fn=lambda m: isinstance(m, decoder_layer_cls()))
    return offload_wrapper(model) if offload else model


def train_fsdp(smp_config, strategies=("HYBRID_SHARD",), steps: int = STEPS, ac: str = ""):
    """Per rank: tsm.init, then for each strategy the script's FSDP; return groups and weights."""
    import torch.distributed as dist
    import torch.sagemaker as tsm

    dist.init_process_group("gloo")
    tsm.init(smp_config)
    out = {}
    for strategy in strategies:
        fsdp = model = wrap(make_llama(), strategy)
        if ac:
            model = checkpoint_layers(model, ac, offload=tsm.state.sm_activation_offloading)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = []
        for x in batches(steps):
            opt.zero_grad()
            xl = local_batch(x, tsm.state.dp_rank, tsm.state.dp_size)
            loss = model(input_ids=xl, labels=xl).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        pg = fsdp.process_group
        out[strategy] = {
            "shard_ranks": sorted(dist.get_process_group_ranks(pg)),
            "strategy": fsdp.sharding_strategy.name,
            "local_numel": sum(p.numel() for p in fsdp.parameters()),
            "full": full_state_dict(fsdp),
            "losses": losses,
        }
    return out
