"""GPT-2 pretraining written the way AWS's public SageMaker model-parallel GPT-2 example is
(amazon-sagemaker-examples, training/distributed_training/pytorch/model_parallel/gpt2,
`train_gpt_simple.py`): the same smp calls with the same arguments, on a tiny Hugging Face GPT-2
built from a config and synthetic `*.json.gz` shards in that example's data format (one JSON object
per line with `input_ids` and `attention_mask`). Our own code; it exists so that the calls such
scripts make are exercised end to end:

    smshim run --distribution '{"smdistributed": {"modelparallel": {"enabled": true, "parameters":
        {"partitions": 2, "tensor_parallel_degree": 2, "ddp": true, "shard_optimizer_state": true,
         "fp16": false, "bf16": true}}},
        "mpi": {"enabled": true, "processes_per_host": 8}}' \\
        --channel train=/tmp/gpt2_data examples/gpt2_aws_style.py --max_steps 12

The smp calls: `smp.init()`, `smp.model_creation(tensor_parallelism=..., dtype=...)`,
`smp.DistributedModel`, `smp.set_activation_checkpointing` on every transformer layer (with tensor
parallelism the GPT-2 becomes smp's distributed transformer: `get_module().transformer.seq_layers`,
checkpointed with `strategy=`, and its full state dict is translated back with
`translate_state_dict_to_hf_gpt2`, as AWS's script does),
`smp.DistributedOptimizer(opt, static_loss_scale=None, dynamic_loss_scale=True,
dynamic_loss_args={...})`, `@smp.step` with `model.backward`, `optimizer.clip_master_grads`,
`optimizer.overflow`, `smp.get_tp_group()`, `smp.tp_rank()`, `smp.rdp_rank()`, `smp.dp_rank()`,
`optimizer.local_state_dict(gather_if_shard=...)`, `smp.save(..., partial=True, v3=...)`, and
`smdistributed.modelparallel.torch.nn.FusedLayerNorm`. The data directory gets synthetic shards
when it has none. Exits non-zero when the loss did not fall.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import logging
import math
import os
import random
import sys

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

import smdistributed.modelparallel.torch as smp
from smdistributed.modelparallel.torch.nn import FusedLayerNorm as LayerNorm
from smdistributed.modelparallel.torch.nn.huggingface.gpt2 import translate_state_dict_to_hf_gpt2

logging.basicConfig(level=logging.INFO, format="%(message)s")
log = logging.getLogger("gpt2")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--training-dir", type=str, default=os.environ.get("SM_CHANNEL_TRAIN",
                                                                       "/tmp/gpt2_data"))
    p.add_argument("--max_steps", type=int, default=12)
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--train_batch_size", type=int, default=4)
    p.add_argument("--seq_length", type=int, default=16)
    p.add_argument("--n_layer", type=int, default=2)
    p.add_argument("--n_embd", type=int, default=32)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--vocab_size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--activation_checkpointing", type=int, default=1)
    p.add_argument("--save_final_model", type=int, default=1)
    p.add_argument("--checkpoint-dir", type=str,
                   default=os.path.join(os.environ.get("SM_MODEL_DIR", "/tmp/gpt2_model")))
    args, _ = p.parse_known_args()  # SageMaker also passes --mp_parameters
    return args


# ---- data: the example's format (json.gz shards, one sample per line) ----------------------------

def make_synthetic_shards(path: str, vocab: int, seq: int, shards: int = 2, per_shard: int = 256,
                          seed: int = 0) -> None:
    """Learnable sequences: each sample counts up from a random start modulo the vocabulary."""
    os.makedirs(path, exist_ok=True)
    rng = random.Random(seed)
    for s in range(shards):
        with gzip.open(os.path.join(path, f"train_synthetic_{s:02d}.json.gz"), "wt") as fh:
            for _ in range(per_shard):
                start = rng.randrange(vocab)
                ids = [(start + i) % vocab for i in range(seq)]
                fh.write(json.dumps({"input_ids": ids, "attention_mask": [1] * seq}) + "\n")


class JsonGzDataset(Dataset):
    def __init__(self, files, seq: int) -> None:
        self.samples = []
        for f in sorted(files):
            with gzip.open(f, "rt") as fh:
                for line in fh:
                    obj = json.loads(line)
                    self.samples.append((obj["input_ids"][:seq], obj["attention_mask"][:seq]))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):
        ids, mask = self.samples[i]
        return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)


def get_param_groups_by_weight_decay(module: nn.Module, weight_decay: float):
    decay, no_decay = [], []
    for mod in module.modules():
        for name, p in mod.named_parameters(recurse=False):
            (no_decay if isinstance(mod, (nn.LayerNorm, LayerNorm)) or name == "bias"
             else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


@smp.step
def train_step(model, input_ids, attention_mask):
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)["loss"]
    model.backward(loss)
    return loss


def main() -> int:
    args = parse_args()
    smp.init()
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.manual_seed(args.seed)
    mp = json.loads(os.environ.get("SM_HP_MP_PARAMETERS", "{}"))
    fp16, bf16 = bool(mp.get("fp16")), bool(mp.get("bf16"))
    if fp16 and bf16:
        raise ValueError("FP16 and BF16 cannot be simultaneously enabled.")
    dtype = torch.float16 if fp16 else torch.bfloat16 if bf16 else torch.get_default_dtype()

    if smp.rank() == 0 and not glob.glob(os.path.join(args.training_dir, "*.json.gz")):
        make_synthetic_shards(args.training_dir, args.vocab_size, args.seq_length)
    smp.barrier()

    model_config = GPT2Config(
        vocab_size=args.vocab_size, n_positions=args.seq_length, n_embd=args.n_embd,
        n_layer=args.n_layer, n_head=args.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, summary_first_dropout=0.0, use_cache=False, bos_token_id=0,
        eos_token_id=0, return_dict=True)
    # Under tensor parallelism smp runs the GPT-2 as its own distributed transformer.
    use_distributed_transformer = smp.tp_size() > 1
    with smp.model_creation(tensor_parallelism=use_distributed_transformer, dtype=dtype,
                            attention_in_fp32=False, query_key_layer_scaling=False,
                            fused_softmax=True, fused_bias_gelu=True):
        model = AutoModelForCausalLM.from_config(model_config)
    num_params = sum(p.numel() for p in model.parameters())
    log.info("rank %d: tp_rank %d of group %s, rdp_rank %d, %d local parameters before "
             "partitioning", smp.rank(), smp.tp_rank(), smp.get_tp_group(), smp.rdp_rank(),
             num_params)

    model = smp.DistributedModel(model, trace_device="gpu")
    if args.activation_checkpointing:
        if use_distributed_transformer:
            smp.set_activation_checkpointing(model.get_module().transformer.seq_layers,
                                             strategy="each")
        else:
            for c in model.get_module().transformer.h.children():
                smp.set_activation_checkpointing(c)

    optimizer = torch.optim.AdamW(get_param_groups_by_weight_decay(model.get_module(),
                                                                   args.weight_decay),
                                  lr=args.lr, betas=(0.9, 0.95))
    optimizer = smp.DistributedOptimizer(
        optimizer, static_loss_scale=None, dynamic_loss_scale=True,
        dynamic_loss_args={"scale_window": 1000, "min_scale": 1, "delayed_shift": 2})
    warmup = 2
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(
            math.pi * min(s, args.max_steps) / args.max_steps)))

    # Without prescaled_batch, the tensor-parallel ranks of a group read different samples
    # (the distributed modules gather them): the data is split over the whole DP group.
    prescaled = bool(mp.get("prescaled_batch"))
    dp_rank, dp_size = ((smp.rdp_rank(), smp.rdp_size()) if prescaled
                        else (smp.dp_rank(), smp.dp_size()))
    data = JsonGzDataset(glob.glob(os.path.join(args.training_dir, "*.json.gz")), args.seq_length)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=dp_size, rank=dp_rank,
                                                  shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(data, batch_size=args.train_batch_size, sampler=sampler, drop_last=True)

    losses, step, epoch = [], 0, 0
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for input_ids, attention_mask in loader:
            loss_mb = train_step(model, input_ids, attention_mask)
            loss = loss_mb.reduce_mean()
            if args.grad_clip > 0:
                optimizer.clip_master_grads(args.grad_clip)
            optimizer.step()
            if not optimizer.overflow:
                lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss))
            step += 1
            if smp.rank() == 0:
                log.info("step %d loss %.4f overflow %s", step, losses[-1], optimizer.overflow)
            if step >= args.max_steps:
                break
        epoch += 1

    if args.save_final_model:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        model_state = model.local_state_dict()
        gather_if_shard = False  # as the AWS script's default: each replica writes its shard
        opt_state = optimizer.local_state_dict(gather_if_shard=gather_if_shard)
        if smp.rdp_rank() == 0 or not gather_if_shard:  # v3: every replica has a shard
            smp.save({"model_state_dict": model_state, "optimizer_state_dict": opt_state},
                     os.path.join(args.checkpoint_dir, "trained_gpt_nparams"), partial=True,
                     v3=not gather_if_shard)
        full = model.state_dict()  # gathers pipeline stages and tensor-parallel shards
        if smp.rank() == 0:
            if use_distributed_transformer:  # smp's layout -> Hugging Face's
                full = translate_state_dict_to_hf_gpt2(full, max_seq_len=None)
            torch.save(full, os.path.join(args.checkpoint_dir, "full_model.pt"))
        smp.barrier()

    head, tail = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    if smp.rank() == 0:
        log.info("loss %.4f -> %.4f", head, tail)
    return 0 if tail < head else 1


if __name__ == "__main__":
    sys.exit(main())
