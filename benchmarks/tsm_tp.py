"""Benchmark: tsm.transform tensor parallelism under FSDP, TP2 × shard 2 against shard 4, on the
same Hugging Face Llama and the same global batch (4 processes, gloo, one thread each).

Both wrap the model with torch's FSDP1 (use_orig_params=True, auto-wrap on the decoder layer):
- "tp2_shard2": smshim.torch_sagemaker.parallelize.apply over a (dp=2, tp=2) mesh, FSDP over dp;
- "shard4": the plain HF model, FSDP over all 4 ranks.
Reported per configuration: parameter bytes each rank holds between steps (its FSDP shards), the
largest unit FSDP all-gathers for compute (a decoder layer: TP halves it), the median step time
(slowest rank), and the losses, which must agree (same model, same global batch).

    python benchmarks/tsm_tp.py [--steps 6] [--rounds 2] [--hidden 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from typing import Any, Dict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from smshim.testing import run_ranks  # noqa: E402

RESULTS = os.path.join(HERE, "results")


def _model(args):
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=args["vocab"], hidden_size=args["hidden"],
                         intermediate_size=args["hidden"] * 4, num_hidden_layers=args["layers"],
                         num_attention_heads=args["heads"], num_key_value_heads=args["heads"],
                         max_position_embeddings=args["seq"], tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg)


def job(tp: int, args: Dict[str, Any]) -> Dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from smshim.torch_sagemaker.parallelize import apply

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    model = _model(args)
    if tp > 1:
        model = apply(model, tp_mesh=mesh["tp"])
    model = FSDP(model, device_mesh=mesh["dp"], use_orig_params=True, device_id=torch.device("cpu"),
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                    transformer_layer_cls={LlamaDecoderLayer}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handles = [m._handle for m in model.modules() if isinstance(m, FSDP) and m._handle]
    held = sum(h.flat_param.numel() * h.flat_param.element_size() for h in handles)
    unit = max(h.flat_param._unpadded_unsharded_size.numel() * h.flat_param.element_size()
               for h in handles[1:] or handles)  # handles[0] is the root (embedding, head)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, args["vocab"], (args["batch"], args["seq"]), generator=g)
            for _ in range(args["warmup"] + args["steps"])]
    dp, ndp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    times, losses = [], []
    for i, x in enumerate(data):
        x = x.chunk(ndp)[dp]
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        full = loss.detach().clone()
        dist.all_reduce(full)
        losses.append(full.item() / world)
        if i >= args["warmup"]:
            times.append(dt)
    return {"held_bytes": held, "unit_bytes": unit, "times": times, "losses": losses}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    a = p.parse_args()
    args = {k: getattr(a, k) for k in ("steps", "warmup", "hidden", "layers", "heads", "vocab",
                                       "seq", "batch")}
    configs = {"tp2_shard2": 2, "shard4": 1}
    runs = {name: [] for name in configs}
    for _ in range(a.rounds):
        for name, tp in configs.items():
            runs[name].append(run_ranks(job, 4, tp, args, timeout=1200))
    ref = runs["shard4"][0][0]["losses"]
    for rs in runs["tp2_shard2"]:
        for got, want in zip(rs[0]["losses"], ref):
            assert abs(got - want) <= 1e-4 * abs(want), (got, want)
    summary = {}
    for name, rs in runs.items():
        step = statistics.median(statistics.median(max(t) for t in zip(*(r["times"] for r in ranks)))
                                 for ranks in rs)
        summary[name] = {"held_param_bytes_per_rank": max(r["held_bytes"] for r in rs[0]),
                         "gathered_layer_bytes": rs[0][0]["unit_bytes"], "step_s": step,
                         "final_loss": rs[0][0]["losses"][-1]}
    print(f"Llama hidden={a.hidden} layers={a.layers} heads={a.heads} vocab={a.vocab} "
          f"seq={a.seq} global batch={a.batch}; 4 gloo ranks, {a.rounds} round(s) x {a.steps} steps")
    print(f"  {'':12s} {'params held/rank':>17s} {'gathered layer':>15s} {'step':>9s}")
    for name, s in summary.items():
        print(f"  {name:12s} {s['held_param_bytes_per_rank'] / 2**20:14.2f} MB "
              f"{s['gathered_layer_bytes'] / 2**20:12.2f} MB {s['step_s'] * 1e3:7.0f} ms")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "tsm_tp.json"), "w") as f:
        json.dump({"args": args, "rounds": a.rounds, "configs": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
