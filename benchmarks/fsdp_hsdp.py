"""Benchmark: SMP v2 hybrid sharding — FSDP step time with tsm's HSDP groups vs stock FSDP
HYBRID_SHARD on the same (replicate, shard) layout, and memory per rank vs hybrid_shard_degree.

Both variants run in one 4-process job on the same HF Llama and batches, alternated step by step,
and we report the median of the paired ratios (tsm / stock): tsm only chooses the process groups,
so the ratio should be 1.0. Memory per rank is what each rank holds of parameters + gradients +
AdamW state (bytes, counted from the tensors after a step) at hybrid_shard_degree 1, 2 and 4 of 4
ranks, against the ideal full/degree. On this 2-core machine 4 processes share 2 cores, so step
times are long and noisy; the ratio is what matters.

    python benchmarks/fsdp_hsdp.py [--steps 12] [--hidden 128] [--layers 4]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from smshim.testing import run_ranks  # noqa: E402

WORLD = 4


def _model(hidden, layers):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden,
                                        num_hidden_layers=layers, num_attention_heads=4,
                                        num_key_value_heads=4, vocab_size=512,
                                        max_position_embeddings=128, use_cache=False))


def _fsdp(model, **groups):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    return FSDP(model, auto_wrap_policy=policy, sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                device_id=torch.device("cpu"), use_orig_params=True, **groups)


def _held_bytes(model, opt):
    n = 0
    for p in model.parameters():
        n += p.numel() * p.element_size()
        if p.grad is not None:
            n += p.grad.numel() * p.grad.element_size()
    for s in opt.state.values():
        n += sum(v.numel() * v.element_size() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0)
    return n


def _bench(steps, hidden, layers):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 512, (2, 64), generator=g) for _ in range(steps)]

    # Stock FSDP HYBRID_SHARD on a (2 replicas, 2 shards) mesh of its own, before tsm is imported.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    stock = _fsdp(_model(hidden, layers),
                  process_group=(mesh["shard"].get_group(), mesh["rep"].get_group()))
    import torch.sagemaker as tsm

    tsm.init({"hybrid_shard_degree": 2})
    ours = _fsdp(_model(hidden, layers))  # groups from tsm.state
    assert sorted(dist.get_process_group_ranks(ours.process_group)) == \
        sorted(dist.get_process_group_ranks(stock.process_group))
    opts = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (stock, ours)}

    def step(model, x):
        dist.barrier()
        t = time.perf_counter()
        opts[id(model)].zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        opts[id(model)].step()
        dist.barrier()
        return time.perf_counter() - t

    ratios, t_stock, t_ours = [], [], []
    for i, x in enumerate(batches):
        a, b = (step(stock, x), step(ours, x)) if i % 2 else (None, None)
        if i % 2 == 0:  # alternate the order
            b = step(ours, x)
            a = step(stock, x)
        if i >= 2:  # warm-up
            t_stock.append(a)
            t_ours.append(b)
            ratios.append(b / a)

    memory = {}
    full_bytes = None
    for degree in (1, 2, 4):
        tsm.init({"hybrid_shard_degree": degree})
        model = _fsdp(_model(hidden, layers))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model(input_ids=batches[0], labels=batches[0]).loss.backward()
        opt.step()
        memory[degree] = _held_bytes(model, opt)
        if degree == 1:
            full_bytes = memory[1]
    return {"rank": rank, "median_ratio": statistics.median(ratios),
            "stock_ms": 1e3 * statistics.median(t_stock), "ours_ms": 1e3 * statistics.median(t_ours),
            "memory": memory, "full": full_bytes}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "fsdp_hsdp.json"))
    args = ap.parse_args()
    res = run_ranks(_bench, WORLD, args.steps, args.hidden, args.layers, timeout=900)
    r0 = res[0]
    ratio = statistics.median(r["median_ratio"] for r in res)
    print(f"HSDP step time, {WORLD} ranks = 2 replicas x hybrid_shard_degree 2 "
          f"(Llama hidden {args.hidden}, {args.layers} layers, fp32, gloo on CPU)")
    print(f"  stock FSDP HYBRID_SHARD : {r0['stock_ms']:8.1f} ms/step")
    print(f"  tsm hybrid_shard_degree : {r0['ours_ms']:8.1f} ms/step")
    print(f"  ratio tsm/stock (median of paired steps, median over ranks): {ratio:.3f}")
    print()
    print("Memory per rank: parameters + gradients + AdamW state")
    print(f"  {'degree':>6} {'bytes/rank':>12} {'vs degree 1':>12} {'ideal':>8}")
    for d in (1, 2, 4):
        held = max(r["memory"][d] for r in res)
        print(f"  {d:>6} {held:>12,} {held / r0['full']:>12.3f} {1 / d:>8.3f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "ratio": ratio, "ranks": res}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
