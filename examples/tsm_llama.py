"""Llama pretraining written the way AWS's SMP v2 example scripts are (amazon-sagemaker-examples,
build_and_train_models/sm-distributed_model_parallel_v2/shared-scripts/train_lib.py): the same
torch.sagemaker calls in the same order, on a tiny Hugging Face Llama built from a config and
synthetic token data. Our own code; it exists so that the calls such scripts make run end to end:

    smshim run -n 4 --distribution '{"torch_distributed": {"enabled": true}, "smdistributed":
        {"modelparallel": {"enabled": true, "parameters": {"hybrid_shard_degree": 2}}}}' \\
        examples/tsm_llama.py --max_steps 20 --checkpoint_dir /tmp/tsm_ckpt

(or `torchrun --nproc-per-node 4 examples/tsm_llama.py --smp_config smp_config.json`).
With `"tensor_parallel_degree": 2` added to the parameters, `tsm.transform` splits the model over
TP pairs and FSDP shards it over the data-parallel ranks of each TP rank (TP2 x shard 2 on 4).
The calls: `dist.init_process_group`, `tsm.init()`, `tsm.state` (tp/cp sizes and ranks for the
data-parallel rank), `init_empty_weights()` + `AutoModelForCausalLM.from_config`, `tsm.transform`,
`DelayedParamIniter` (`get_param_init_fn`, `get_post_param_init_fn`,
`validate_params_and_buffers_inited`), FSDP with `transformer_auto_wrap_policy`, `MixedPrecision`,
`HYBRID_SHARD`, `backward_prefetch`, `forward_prefetch`, `limit_all_gathers`, `device_id`,
`use_orig_params=True`, `apply_activation_checkpointing` (REENTRANT), `offload_wrapper` when
`tsm.state.sm_activation_offloading`, AdamW after FSDP, `tsm.grad_norm.clip_grad_norm_`, sharded
checkpoints every N steps from replica 0 with `async_save` and an `AsyncCallsQueue`, resume with
`load` + `load_sharded_optimizer_state_dict(..., process_group=model.process_group)`, a full HF checkpoint at the end. Exits non-zero when
the loss did not fall.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.sagemaker as tsm
from accelerate import init_empty_weights
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper, offload_wrapper)
from torch.distributed.fsdp import BackwardPrefetch, FullStateDictConfig
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

logger = logging.getLogger("tsm_llama")


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--smp_config", default=None, help="JSON file or inline JSON for tsm.init")
    p.add_argument("--max_steps", type=int, default=20)
    p.add_argument("--train_batch_size", type=int, default=2, help="per data-parallel rank")
    p.add_argument("--max_context_width", type=int, default=16)
    p.add_argument("--hidden_width", type=int, default=32)
    p.add_argument("--num_layers", type=int, default=2)
    p.add_argument("--num_heads", type=int, default=4)
    p.add_argument("--vocab_size", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--bf16", type=int, default=0, help="MixedPrecision in bf16 (else fp32)")
    p.add_argument("--activation_checkpointing", type=int, default=1)
    p.add_argument("--offload_activations", type=int, default=1)
    p.add_argument("--delayed_param", type=int, default=1)
    p.add_argument("--checkpoint_freq", type=int, default=10)
    p.add_argument("--async_checkpoint", type=int, default=1)
    p.add_argument("--checkpoint_dir", default=os.environ.get("SM_CHECKPOINT_DIR", "/tmp/tsm_checkpoints"))
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--model_dir", default=os.environ.get("SM_MODEL_DIR", None))
    p.add_argument("--seed", type=int, default=12345)
    args, unknown = p.parse_known_args(argv)  # SageMaker also passes --mp_parameters etc.
    return args


def synthetic_batch(step: int, dp_rank: int, args, generator_seed: int):
    """Sequences that count up from a random start (mod vocab): a pattern a tiny model learns."""
    g = torch.Generator().manual_seed(generator_seed * 1_000_003 + step * 1009 + dp_rank)
    start = torch.randint(0, args.vocab_size, (args.train_batch_size, 1), generator=g)
    return (start + torch.arange(args.max_context_width)) % args.vocab_size


def smp_config_arg(value):
    if value is None:
        return None
    value = value.strip()
    if value.startswith("{"):
        import json

        return json.loads(value)
    return value


def save_sharded(model, optimizer, step, args, queue):
    from torch.sagemaker.distributed.checkpoint.state_dict_saver import async_save, save
    from torch.sagemaker.utils.process_group_utils import get_global_ranks

    queue.maybe_finalize_async_calls(blocking=True, process_group=model.process_group)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state_dict = {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model, optimizer),
                      "step": step}
    if tsm.state.ranker.get_rep_rank(dist.get_rank()) == 0:
        path = os.path.join(args.checkpoint_dir, f"{step}steps",
                            f"tp{tsm.state.tp_rank}_ep{tsm.state.ep_rank}")
        coordinator = min(get_global_ranks(model.process_group))
        if args.async_checkpoint:
            async_save(state_dict, checkpoint_id=path, process_group=model.process_group,
                       coordinator_rank=coordinator, queue=queue)
        else:
            save(state_dict, checkpoint_id=path, process_group=model.process_group,
                 coordinator_rank=coordinator)
        logger.info("sharded checkpoint of step %d -> %s%s", step, path,
                    " (async)" if args.async_checkpoint else "")


def load_sharded(model, optimizer, path):
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.sagemaker.distributed.checkpoint.filesystem import DistributedFileSystemReader
    from torch.sagemaker.distributed.checkpoint.state_dict_loader import load
    from torch.sagemaker.utils.process_group_utils import get_global_ranks

    path = os.path.join(path, f"tp{tsm.state.tp_rank}_ep{tsm.state.ep_rank}")
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state_dict = {"model": model.state_dict(), "step": 0}
        load(state_dict, checkpoint_id=path, process_group=model.process_group,
             coordinator_rank=min(get_global_ranks(model.process_group)))
        model.load_state_dict(state_dict["model"])
        optim = load_sharded_optimizer_state_dict(model_state_dict=state_dict["model"],
                                                  optimizer_key="optimizer",
                                                  storage_reader=DistributedFileSystemReader(path),
                                                  process_group=model.process_group)
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, optim["optimizer"]))
    return int(state_dict["step"])


def save_full(model, model_config, directory):
    cfg = FullStateDictConfig(rank0_only=True, offload_to_cpu=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state_dict = model.state_dict()
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        torch.save(state_dict, os.path.join(directory, "pytorch_model.bin"))
        model_config.save_pretrained(directory)
        logger.info("full checkpoint -> %s", directory)
    dist.barrier()


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    tsm.init(smp_config_arg(args.smp_config))

    global_rank, world_size = dist.get_rank(), dist.get_world_size()
    tp, cp = tsm.state.tensor_parallel_degree, tsm.state.context_parallel_degree
    dp_rank, dp_size = global_rank // (tp * cp), world_size // (tp * cp)
    if global_rank == 0:
        logger.info("world %d: dp %d x tp %d x cp %d, hybrid_shard_degree %d", world_size, dp_size,
                    tp, cp, tsm.state.hybrid_shard_degree)

    model_config = LlamaConfig(hidden_size=args.hidden_width, intermediate_size=4 * args.hidden_width,
                               num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads,
                               num_key_value_heads=args.num_heads, vocab_size=args.vocab_size,
                               max_position_embeddings=args.max_context_width,
                               use_cache=False)  # a KV cache would grow again in recomputation
    torch.manual_seed(args.seed)
    if args.delayed_param:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(model_config)
    else:
        model = AutoModelForCausalLM.from_config(model_config)
    model = tsm.transform(model)  # right after building, as AWS's v2 scripts (all degrees 1: as is)
    assert all(p.dtype == torch.float32 for p in model.parameters())

    param_init_fn = post_param_init_fn = None
    initer = None
    if args.delayed_param:
        from torch.sagemaker.delayed_param import DelayedParamIniter

        initer = DelayedParamIniter(model)
        param_init_fn = initer.get_param_init_fn()
        post_param_init_fn = initer.get_post_param_init_fn()

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    mixed_precision = MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=torch.float32)
    auto_wrap_policy = functools.partial(transformer_auto_wrap_policy,
                                         transformer_layer_cls={LlamaDecoderLayer})
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    with initer.validate_params_and_buffers_inited() if initer else _nothing():
        model = FSDP(model, auto_wrap_policy=auto_wrap_policy, mixed_precision=mixed_precision,
                     sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                     backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=False,
                     limit_all_gathers=True, device_id=device, use_orig_params=True,
                     param_init_fn=param_init_fn, post_param_init_fn=post_param_init_fn,
                     sync_module_states=False)
    dist.barrier()

    if args.activation_checkpointing:
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                           checkpoint_impl=CheckpointImpl.REENTRANT),
            check_fn=lambda m: isinstance(m, LlamaDecoderLayer))
    if args.offload_activations and tsm.state.sm_activation_offloading:
        model = offload_wrapper(model)
    fsdp_model = model if isinstance(model, FSDP) else model._checkpoint_wrapped_module

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    from torch.sagemaker.distributed.checkpoint.async_utils import AsyncCallsQueue
    from torch.sagemaker.grad_norm import clip_grad_norm_

    queue = AsyncCallsQueue()
    start = 0
    if args.resume_from_checkpoint:
        start = load_sharded(fsdp_model, optimizer, args.resume_from_checkpoint)
        logger.info("resumed from %s at step %d", args.resume_from_checkpoint, start)

    first = last = None
    for step in range(start, args.max_steps):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        input_ids = synthetic_batch(step, dp_rank, args, args.seed)
        loss = model(input_ids=input_ids, attention_mask=None, labels=input_ids)["loss"]
        loss.backward()
        grad_norm = clip_grad_norm_(model, args.grad_clip)
        optimizer.step()
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        reported = (reported / world_size).item()
        first = reported if first is None else first
        last = reported
        if global_rank == 0:
            logger.info("step %d loss %.4f grad_norm %.3f (%.3f s)", step, reported,
                        grad_norm.detach().cpu().item(), time.perf_counter() - t0)
        if args.checkpoint_freq and (step + 1) % args.checkpoint_freq == 0:
            save_sharded(fsdp_model, optimizer, step + 1, args, queue)

    queue.maybe_finalize_async_calls(blocking=True, process_group=fsdp_model.process_group)
    save_full(fsdp_model, model_config, args.model_dir or os.path.join(args.checkpoint_dir, "full"))
    if global_rank == 0 and first is not None:
        print(f"loss {first:.4f} -> {last:.4f}", flush=True)
    dist.destroy_process_group()
    if first is not None and not (math.isfinite(last) and last < first):
        return 1
    return 0


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    sys.exit(main())
