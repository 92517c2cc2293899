"""A GPT-2 pretraining script that makes the smp calls of AWS's SageMaker model-parallel GPT-2
example (amazon-sagemaker-examples, training/distributed_training/pytorch/model_parallel/gpt2,
`train_gpt_simple.py` with `data_pipeline.py`), with the same arguments and command-line names.
Written for smshim's tests (tests/test_gpt2_aws_script.py); CPU instead of CUDA.

The calls: the example's imports (including smp.nn.huggingface.gpt2's translators),
`smp.init(dict)` with every key the example passes, `smp.model_creation(...)`,
`smp.DistributedModel(model, trace_device="gpu", backward_passes_per_step=...)`,
`get_module().transformer.seq_layers` (distributed transformer) or `.h` (Hugging Face blocks),
`smp.set_partition`, `smp.set_activation_checkpointing(..., strategy=...)`,
`smp.DistributedOptimizer(opt, static_loss_scale=None, dynamic_loss_scale=True,
dynamic_loss_args=...)`, `@smp.step` returning the model's dict output, `clip_master_grads`,
`overflow`, `smp.save_checkpoint` partial (every --checkpoint_freq steps) and full (at the end),
`smp.resume_from_checkpoint` (--load_partial / --load_full).

Added for tests: --init_weights (a Hugging Face GPT-2 state dict to start from, translated with
translate_hf_state_dict_to_smdistributed_gpt2 for the distributed transformer), --synthetic_data N
(rank 0 writes N json.gz shards of learnable token sequences into an empty --training-dir), and a
final `RESULT {json}` line on rank 0. On a laptop:

    smshim run -n 4 --channel train=/tmp/gpt2_data --output-dir /tmp/gpt2_out \
        tests/scripts/gpt2_aws/train_gpt_simple.py --synthetic_data 2 --pipeline_parallel_degree 2 \
        --microbatches 2 --use_distributed_transformer 0 --max_context_width 64 --vocab_size 256 \
        --hidden_width 64 --num_layers 4 --num_heads 4 --lr 1e-3 --max_steps 20 \
        --checkpoint-dir /tmp/gpt2_out/checkpoints --checkpoint_freq 10 --save_final_full_model 1
"""

import argparse
import json
import logging
import os
import time

import numpy as np
import smdistributed.modelparallel
import smdistributed.modelparallel.torch as smp
import torch
import transformers
from data_pipeline import create_pretraining_dataloader
from learning_rates import AnnealingLR
from smdistributed.modelparallel.torch.nn import FusedLayerNorm as LayerNorm
from torch import optim
from transformers import AutoModelForCausalLM, GPT2Config, set_seed

try:
    from smdistributed.modelparallel.torch.nn.huggingface.gpt2 import (
        translate_hf_state_dict_to_smdistributed_gpt2,
        translate_state_dict_to_hf_gpt2,
    )
except ModuleNotFoundError:  # issue 35 part A (smp.nn.huggingface) not there yet
    translate_hf_state_dict_to_smdistributed_gpt2 = translate_state_dict_to_hf_gpt2 = None

logging.getLogger("torch.distributed.distributed_c10d").setLevel(logging.ERROR)


def write_synthetic_shards(path, shards, vocab, seq, per_shard=64, seed=0):
    """Sequences that count up from a random start by a random stride: learnable in few steps."""
    import gzip
    import random

    os.makedirs(path, exist_ok=True)
    rng = random.Random(seed)
    for s in range(shards):
        with gzip.open(os.path.join(path, f"train_synthetic_{s:02d}.json.gz"), "wt") as fh:
            for _ in range(per_shard):
                start, stride = rng.randrange(vocab), rng.choice([1, 2, 3])
                ids = [(start + i * stride) % vocab for i in range(seq)]
                fh.write(json.dumps({"input_ids": ids, "attention_mask": [1] * seq}) + "\n")


def get_param_groups_by_weight_decay(module):
    """No weight decay for smp's FusedLayerNorm parameters and for biases (as the example)."""
    decay, no_decay, seen = {"params": []}, {"params": [], "weight_decay": 0.0}, set()
    for mod in module.modules():
        for name, p in mod._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            (no_decay if isinstance(mod, LayerNorm) or name == "bias" else decay)["params"].append(p)
    return decay, no_decay


@smp.step
def train_step(model, optimizer, input_ids, attention_mask, args):
    if args.logits_output:
        output = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)
        loss = output["loss"]
    else:
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)["loss"]
    model.backward(loss)
    if args.logits_output:
        return output
    return loss


def train(model, optimizer, lr_scheduler, model_config, start_train_path_index,
          start_batch_index, num_params, total_steps, args):
    model.train()
    dp_rank = smp.dp_rank() if not args.prescaled_batch else smp.rdp_rank()
    dp_size = smp.dp_size() if not args.prescaled_batch else smp.rdp_size()
    ext = ".json.gz" if args.zipped_data > 0 else ".json"
    train_paths = sorted(os.path.join(args.training_dir, p) for p in os.listdir(args.training_dir)
                         if p.endswith(ext))
    losses, logits_shape = [], None

    def grad_accumulation_boundary(batch_idx):
        return batch_idx % args.gradient_accumulation == args.gradient_accumulation - 1

    set_seed(args.seed)
    for index in range(start_train_path_index, args.epochs * len(train_paths)):
        if total_steps >= args.max_steps:
            break
        curr_train_path_index = index % len(train_paths)
        loader = create_pretraining_dataloader(
            [train_paths[curr_train_path_index]], args.train_batch_size, args.max_context_width,
            seed=args.seed, dp_rank=dp_rank, dp_size=dp_size, shuffle=args.same_seed < 1,
            zipped=args.zipped_data > 0)
        for batch_idx, (input_ids, attention_mask) in enumerate(loader):
            if batch_idx < start_batch_index:
                continue
            start_batch_index = 0
            if total_steps >= args.max_steps:
                break
            if grad_accumulation_boundary(batch_idx - 1):
                optimizer.zero_grad(set_to_none=True)
            if args.logits_output:
                train_output = train_step(model, optimizer, input_ids, attention_mask, args)
                loss_mb, logits_mb = train_output["loss"], train_output["logits"]
                if smp.pp_rank() == 0:
                    logits = torch.cat(tuple(logits_mb.outputs), dim=1 if smp.tp_size() > 1 else 0)
                    logits_shape = list(logits.shape)
            else:
                loss_mb = train_step(model, optimizer, input_ids, attention_mask, args)
            loss = loss_mb.reduce_mean()
            overflow = False
            if grad_accumulation_boundary(batch_idx):
                if args.fp16:
                    optimizer.clip_master_grads(args.grad_clip)
                optimizer.step()
                overflow = bool(args.fp16 and optimizer.overflow)
                if not (args.fp16 and optimizer.overflow):
                    lr_scheduler.step()
            total_steps += 1
            losses.append(loss.item())
            if smp.rank() == 0 and not total_steps % args.logging_freq:
                print(f"step {total_steps} loss {losses[-1]:.6f} overflow {overflow} "
                      f"lr {optimizer.param_groups[0]['lr']:.6g}", flush=True)
            if not total_steps % args.checkpoint_freq:
                user_content = {
                    "cli_args": args.__dict__,
                    "num_params": num_params,
                    "total_steps": total_steps,
                    "start_train_path_index": curr_train_path_index,
                    "model_config": model_config,
                    "start_batch_index": batch_idx + 1,
                    "lr_scheduler": lr_scheduler.state_dict(),
                }
                smp.save_checkpoint(args.checkpoint_dir, tag=f"total_steps{total_steps}",
                                    partial=True, model=model, optimizer=optimizer,
                                    user_content=user_content,
                                    num_kept_partial_checkpoints=args.num_kept_checkpoints)
        start_batch_index = 0
    return total_steps, losses, logits_shape


def parse_args():
    p = argparse.ArgumentParser()
    add = p.add_argument
    add("--train_batch_size", type=int, default=4)
    add("--max_steps", type=int, default=10)
    add("--seed", type=int, default=12345)
    add("--same_seed", type=int, default=0)
    add("--n_gpus", type=str, default=os.environ.get("SM_NUM_GPUS", "0"))
    add("--fp16", default=0, type=int)
    add("--bf16", default=0, type=int)
    add("--sharded_data_parallel_degree", default=1, type=int)
    add("--grad_clip", default=1.0, type=float)
    add("--weight_decay", default=0.01, type=float)
    add("--beta1", default=0.9, type=float)
    add("--beta2", default=0.95, type=float)
    # Not in AWS's script (torch's default): the equivalence tests raise it, since Adam turns the
    # rounding noise of a gradient that is mathematically zero (GPT-2's key bias) into lr-sized
    # steps, whatever the engine.
    add("--adam_eps", default=1e-8, type=float)
    add("--activation_checkpointing", type=int, default=1)
    add("--logging_freq", type=int, default=1)
    add("--zipped_data", type=int, default=1)
    add("--epochs", type=int, default=3)
    add("--checkpoint-dir", type=str, default="/opt/ml/checkpoints")
    add("--model-dir", type=str, default=os.environ.get("SM_MODEL_DIR", "/opt/ml/model"))
    add("--training-dir", type=str, default=os.environ.get("SM_CHANNEL_TRAIN", "/opt/ml/input"))
    add("--save_final_full_model", type=int, default=0)
    add("--load_partial", type=int, default=0)
    add("--load_full", type=int, default=0)
    add("--logits_output", type=str, default="")
    add("--prescaled_batch", type=int, default=1)
    add("--max_context_width", type=int, default=1024)
    add("--vocab_size", type=int, default=50264)
    add("--hidden_width", type=int, default=768)
    add("--num_layers", type=int, default=12)
    add("--num_heads", type=int, default=12)
    add("--resid_pdrop", type=float, default=0.1)
    add("--embd_pdrop", type=float, default=0.1)
    add("--attn_pdrop", type=float, default=0.1)
    add("--summary_first_pdrop", type=float, default=0.1)
    add("--use_adamw", type=int, default=0)
    add("--use_distributed_transformer", type=int, default=1)
    add("--checkpoint_sublayers", type=int, default=0)
    add("--tensor_parallel_degree", type=int, default=1)
    add("--pipeline_parallel_degree", type=int, default=1)
    add("--microbatches", type=int, default=1)
    add("--active_microbatches", type=int, default=None)
    add("--optimize", type=str, default="speed")
    add("--activation_strategy", type=str, default="each")
    add("--shard_optimizer_state", type=int, default=0)
    add("--offload_activations", type=int, default=0)
    add("--fast_mode", type=int, default=0)
    add("--static_mode", type=int, default=0)
    add("--delayed_param", type=int, default=0)
    add("--attention_in_fp32", type=int, default=0)
    add("--placement_strategy", type=str, default="cluster")
    add("--activation_loading_horizon", type=int, default=4)
    add("--skip_tracing", type=int, default=0)
    add("--query_key_layer_scaling", type=int, default=1)
    add("--fused_softmax", type=int, default=1)
    add("--fused_dropout", type=int, default=0)
    add("--fused_bias_gelu", type=int, default=1)
    add("--gradient_accumulation", type=int, default=1)
    add("--num_kept_checkpoints", type=int, default=5)
    add("--checkpoint_freq", type=int, default=10000)
    add("--manual_partition", type=int, default=0)
    add("--partition_assignment", type=str, default="")
    add("--lr", type=float, default=None)
    add("--lr_decay_iters", type=int, default=None)
    add("--min_lr", type=float, default=0.0)
    add("--warmup", type=float, default=0.01)
    add("--init_weights", type=str, default="")
    add("--synthetic_data", type=int, default=0)
    args, _ = p.parse_known_args()
    return args


def main():
    args = parse_args()
    if args.partition_assignment != "" and args.manual_partition == 0:
        args.manual_partition = 1

    smp_config = {
        "ddp": True,
        "tensor_parallel_degree": args.tensor_parallel_degree,
        "pipeline_parallel_degree": args.pipeline_parallel_degree,
        "microbatches": args.microbatches,
        "shard_optimizer_state": args.shard_optimizer_state > 0,
        "prescaled_batch": args.prescaled_batch > 0,
        "fp16": args.fp16 > 0,
        "bf16": args.bf16 > 0,
        "offload_activations": args.offload_activations > 0,
        "delayed_parameter_initialization": args.delayed_param > 0,
        "optimize": args.optimize,
        "placement_strategy": args.placement_strategy,
        "activation_loading_horizon": args.activation_loading_horizon,
        "skip_tracing": args.skip_tracing > 0,
        "auto_partition": False if args.manual_partition else True,
        "default_partition": 0,
        "static_mode": args.static_mode > 0,
        "fast_mode": args.fast_mode > 0,
        "sharded_data_parallel_degree": args.sharded_data_parallel_degree,
    }
    if args.active_microbatches is not None:
        smp_config["active_microbatches"] = args.active_microbatches
    smp.init(smp_config)
    if args.synthetic_data and smp.rank() == 0 and not (
            os.path.isdir(args.training_dir) and any(
                p.endswith(".json.gz") for p in os.listdir(args.training_dir))):
        write_synthetic_shards(args.training_dir, args.synthetic_data, args.vocab_size,
                               args.max_context_width)
    smp.barrier()
    if smp.rank() == 0:
        print(f"Transformers {transformers.__version__}, smdistributed.modelparallel "
              f"{getattr(smdistributed.modelparallel, '__version__', '?')}, config {smp_config}")

    model_config = GPT2Config(
        vocab_size=args.vocab_size, n_positions=args.max_context_width, n_embd=args.hidden_width,
        n_layer=args.num_layers, n_head=args.num_heads, n_inner=None,
        activation_function="gelu_new", resid_pdrop=args.resid_pdrop, embd_pdrop=args.embd_pdrop,
        attn_pdrop=args.attn_pdrop, layer_norm_epsilon=1e-05, initializer_range=0.02,
        summary_type="cls_index", summary_use_proj=True, summary_activation=None,
        summary_proj_to_labels=True, summary_first_dropout=args.summary_first_pdrop,
        use_cache=False, bos_token_id=0, eos_token_id=0, return_dict=True)
    if args.use_distributed_transformer > 0:
        from transformers.modeling_utils import PreTrainedModel

        PreTrainedModel.init_weights = lambda x: None
    set_seed(args.seed)

    if args.fp16 and args.bf16:
        raise ValueError("FP16 and BF16 cannot be simultaneously enabled.")
    dtype = (torch.float16 if args.fp16 else torch.bfloat16 if args.bf16
             else torch.get_default_dtype())
    with smp.model_creation(
            tensor_parallelism=smp.tp_size() > 1 or args.use_distributed_transformer > 0,
            dtype=dtype, attention_in_fp32=args.attention_in_fp32 > 0,
            query_key_layer_scaling=args.query_key_layer_scaling > 0 and args.bf16 < 1,
            fused_softmax=args.fused_softmax > 0, fused_dropout=args.fused_dropout > 0,
            fused_bias_gelu=args.fused_bias_gelu > 0):
        model = AutoModelForCausalLM.from_config(model_config)
    # As the example computes it: a numpy integer (it lands in user_content).
    num_params = sum(np.prod(p.size()) for p in {id(q): q for q in model.parameters()}.values())

    if not args.same_seed:
        set_seed(args.seed + smp.tp_rank())
    model = smp.DistributedModel(model, trace_device="gpu",
                                 backward_passes_per_step=args.gradient_accumulation)
    if args.init_weights:
        sd = torch.load(args.init_weights, map_location="cpu", weights_only=True)
        if args.use_distributed_transformer > 0:
            sd = translate_hf_state_dict_to_smdistributed_gpt2(sd)
        model.load_state_dict(sd, strict=False)

    m = model.get_module()
    if args.use_distributed_transformer > 0:
        transformer_layers = m.transformer.seq_layers
    else:
        transformer_layers = m.transformer.h

    if args.manual_partition:
        if args.partition_assignment != "":
            counts = [int(x) for x in args.partition_assignment.split(",")]
        else:
            div, rem = divmod(args.num_layers, smp.pp_size())
            counts = [div + 1 if r >= smp.pp_size() - rem else div for r in range(smp.pp_size())]
        assignments = [r for r, n in enumerate(counts) for _ in range(n)]
        for i, c in enumerate(transformer_layers.children()):
            smp.set_partition(c, assignments[i])

    param_groups = get_param_groups_by_weight_decay(m)
    opt_cls = optim.AdamW if args.use_adamw > 0 else optim.Adam
    optimizer = opt_cls(param_groups, betas=(args.beta1, args.beta2), lr=args.lr,
                        weight_decay=args.weight_decay, eps=args.adam_eps)

    if args.activation_checkpointing:
        if args.use_distributed_transformer or smp.tp_size() > 1:
            if args.checkpoint_sublayers:
                for c in transformer_layers.children():
                    smp.set_activation_checkpointing(c.attention)
                    smp.set_activation_checkpointing(c.output)
            else:
                smp.set_activation_checkpointing(transformer_layers,
                                                 strategy=args.activation_strategy)
        else:
            for c in transformer_layers.children():
                if args.checkpoint_sublayers:
                    smp.set_activation_checkpointing(c.attn)
                    smp.set_activation_checkpointing(c.mlp)
                else:
                    smp.set_activation_checkpointing(c)

    optimizer = smp.DistributedOptimizer(
        optimizer, static_loss_scale=None, dynamic_loss_scale=True,
        dynamic_loss_args={"scale_window": 1000, "min_scale": 1, "delayed_shift": 2})
    num_iters = max(1, args.lr_decay_iters if args.lr_decay_iters is not None else args.max_steps)
    lr_scheduler = AnnealingLR(optimizer, start_lr=args.lr, warmup_iter=args.warmup * num_iters,
                               total_iters=num_iters, min_lr=args.min_lr)

    if args.load_full or args.load_partial:
        partial = not args.load_full
        path = args.checkpoint_dir if partial else args.model_dir
        tag = None if partial else "fullmodel.pt"
        user_content = smp.resume_from_checkpoint(path, tag=tag, partial=partial)
        total_steps = user_content["total_steps"] if partial else 0
        start_train_path_index = user_content.get("start_train_path_index", 0)
        start_batch_index = user_content.get("start_batch_index", 0)
        if "lr_scheduler" in user_content:
            lr_scheduler.load_state_dict(user_content["lr_scheduler"])
        if smp.rank() == 0:
            print(f"resumed at step {total_steps} (file {start_train_path_index}, batch "
                  f"{start_batch_index}); saved config n_embd={user_content['model_config'].n_embd}")
    else:
        total_steps, start_train_path_index, start_batch_index = 0, 0, 0

    start = time.time()
    first_step = total_steps
    total_steps, losses, logits_shape = train(
        model, optimizer, lr_scheduler, model_config, start_train_path_index, start_batch_index,
        num_params, total_steps, args)

    if args.save_final_full_model:
        user_content = {"cli_args": args.__dict__, "num_params": num_params,
                        "total_steps": total_steps, "model_config": model_config}
        smp.save_checkpoint(args.model_dir, tag="fullmodel.pt", partial=False, model=model,
                            user_content=user_content)
    smp.barrier()
    if smp.rank() == 0:
        print("RESULT " + json.dumps({
            "first_step": first_step, "total_steps": total_steps, "losses": losses,
            "logits_shape": logits_shape, "num_params": int(num_params),
            "seconds": round(time.time() - start, 1),
            "sizes": {"pp": smp.pp_size(), "tp": smp.tp_size(), "dp": smp.dp_size(),
                      "rdp": smp.rdp_size()}}), flush=True)
        print("SMP training finished successfully", flush=True)


if __name__ == "__main__":
    main()
