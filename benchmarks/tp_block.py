"""Benchmark: one transformer block split over tp=2 ranks vs the same block unsplit.

Two processes (one thread each). The tensor-parallel run is `smp.DistributedModel` around one
`smp.nn.DistributedTransformerLayer` with tensor_parallel_degree 2 and prescaled_batch true (both
TP ranks hold the same batch, so each does half of every matmul and two all-reduces per direction
join the halves). The unsplit run is the same block written in plain torch (same weights: the gathered
state dict) trained in one process on the same batch while the other process waits in a barrier.
The two alternate step by step inside the same processes so both see the same machine load; every
step includes the optimizer step. A step's time is the slowest rank's; we report the median of
the per-step ratios (tp / unsplit) and the medians of the step times, plus the parameter bytes
each TP rank holds vs the unsplit block (expect about 1/2: LayerNorms and the output biases are
replicated). The benchmark asserts the two runs' losses agree at every step.

    python benchmarks/tp_block.py [--steps 40] [--hidden 512] [--batch 8] [--seq 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict

import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from smshim.testing import run_ranks  # noqa: E402

RESULTS = os.path.join(HERE, "results")
WARMUP = 5


class PlainBlock(nn.Module):
    """The unsplit pre-LayerNorm block with causal attention; DistributedTransformerLayer's keys."""

    def __init__(self, hidden: int, heads: int, seq: int) -> None:
        super().__init__()
        self.heads, self.seq = heads, seq
        self.attention = nn.Module()
        a = self.attention
        a.query, a.key, a.value, a.dense = (nn.Linear(hidden, hidden) for _ in range(4))
        a.pre_layernorm_module = nn.LayerNorm(hidden)
        self.output = nn.Module()
        o = self.output
        o.dense_h_to_4h, o.dense_4h_to_h = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden,
                                                                                    hidden)
        o.pre_layernorm_module = nn.LayerNorm(hidden)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        a, o = self.attention, self.output
        n, s, d = h.shape
        x = a.pre_layernorm_module(h)

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, s, self.heads, d // self.heads).transpose(1, 2)

        ctx = F.scaled_dot_product_attention(split(a.query(x)), split(a.key(x)),
                                             split(a.value(x)), is_causal=True)
        h = a.dense(ctx.transpose(1, 2).reshape(n, s, d)) + h
        return o.dense_4h_to_h(F.gelu(o.dense_h_to_4h(o.pre_layernorm_module(h)))) + h


def _bench(steps: int, hidden: int, heads: int, batch: int, seq: int) -> Dict[str, Any]:
    import torch.distributed as dist

    import smdistributed.modelparallel.torch as smp

    smp.init({"tensor_parallel_degree": 2, "prescaled_batch": True})
    kwargs = dict(num_attention_heads=heads, attention_head_size=hidden // heads,
                  hidden_size=hidden, intermediate_size=4 * hidden, attention_dropout_prob=0.0,
                  hidden_dropout_prob=0.0, causal_mask_size=seq, pre_layernorm=True,
                  post_layernorm=False)
    torch.manual_seed(0)
    layer = smp.nn.DistributedTransformerLayer(**kwargs)  # the all-zero mask adds nothing
    model = smp.DistributedModel(layer)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    full_sd = model.state_dict()  # gathered: the unsplit weights

    # The unsplit block: plain torch, the same weights (the gathered state dict), rank 0 only.
    plain = None
    if smp.rank() == 0:
        plain = PlainBlock(hidden, heads, seq)
        plain.load_state_dict(full_sd)
        plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-3)

    @smp.step
    def tp_step(model, x, mask, target):
        out = model((x, mask))[0]
        loss = torch.nn.functional.mse_loss(out, target)
        model.backward(loss)
        return loss

    def plain_step(x, mask, target):
        plain_opt.zero_grad()
        loss = torch.nn.functional.mse_loss(plain(x, mask), target)
        loss.backward()
        plain_opt.step()
        return loss.item()

    g = torch.Generator().manual_seed(1)
    tp_times, plain_times, max_loss_diff = [], [], 0.0
    for step in range(steps + WARMUP):
        x = torch.randn(batch, seq, hidden, generator=g)
        target = torch.randn(batch, seq, hidden, generator=g)
        mask = torch.zeros(batch, 1, 1, seq)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        tp_loss = tp_step(model, x, mask, target).reduce_mean().item()
        opt.step()
        t_tp = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t_tp, op=dist.ReduceOp.MAX)
        dist.barrier()
        t0 = time.perf_counter()
        plain_loss = plain_step(x, mask, target) if plain is not None else tp_loss
        t_plain = torch.tensor([time.perf_counter() - t0 if plain is not None else 0.0])
        dist.all_reduce(t_plain, op=dist.ReduceOp.MAX)
        if step >= WARMUP:
            tp_times.append(t_tp.item())
            plain_times.append(t_plain.item())
        if plain is not None:
            max_loss_diff = max(max_loss_diff, abs(tp_loss - plain_loss) / abs(plain_loss))
    rank_bytes = sum(p.numel() * p.element_size() for p in model.local_parameters())
    full_bytes = sum(v.numel() * v.element_size() for v in full_sd.values())
    return {"tp_times": tp_times, "plain_times": plain_times, "rank_param_bytes": rank_bytes,
            "full_param_bytes": full_bytes, "max_rel_loss_diff": max_loss_diff}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    a = ap.parse_args()
    res = run_ranks(_bench, 2, a.steps, a.hidden, a.heads, a.batch, a.seq, timeout=1800)
    r0 = res[0]
    assert r0["max_rel_loss_diff"] < 1e-4, r0["max_rel_loss_diff"]
    ratios = [t / p for t, p in zip(r0["tp_times"], r0["plain_times"])]
    out = {
        "config": vars(a),
        "median_step_s_tp2": statistics.median(r0["tp_times"]),
        "median_step_s_unsplit": statistics.median(r0["plain_times"]),
        "median_ratio_tp2_over_unsplit": statistics.median(ratios),
        "param_bytes_per_tp_rank": [r["rank_param_bytes"] for r in res],
        "param_bytes_unsplit": r0["full_param_bytes"],
        "param_bytes_ratio": [r["rank_param_bytes"] / r0["full_param_bytes"] for r in res],
        "max_rel_loss_diff": r0["max_rel_loss_diff"],
        "load_avg_1min": os.getloadavg()[0],
    }
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "tp_block.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items()}, indent=1))


if __name__ == "__main__":
    main()
