"""Benchmark: pipeline x data parallel (pp=2 x dp=2) — overlapped vs end-of-step gradient reduction,
and scaling against pp=2 alone.

Overlapped and end-of-step reduction are alternated step by step inside one 4-process job (the
same model and process groups; only the reduction trigger differs), and we report the median of
the paired ratios. pp=2 alone runs as a 2-process job on the same per-replica batch. On this
2-core machine 4 processes share 2 cores, so the scaling figure is a lower bound of what separate
devices would give; it is printed as measured.

    python benchmarks/hybrid_ddp.py [--steps 20] [--width 512] [--blocks 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from smshim.testing import run_ranks  # noqa: E402


class MLP(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(blocks)])
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        return self.head(x)


def _job(pp: int, ddp: bool, steps: int, width: int, blocks: int, batch: int, alternate: bool):
    import smdistributed.modelparallel.torch as smp

    smp.init({"pipeline_parallel_degree": pp, "microbatches": 4, "ddp": ddp})
    torch.manual_seed(0)
    module = MLP(width, blocks)
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(smp.dp_rank())
    x, y = torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)
    train_step(model, x, y)  # partitioning + warm-up
    early = model._pipeline.reduce_early
    times = {"overlapped": [], "end_of_step": []}
    for i in range(2 * steps if alternate else steps):
        mode = "end_of_step" if alternate and i % 2 else "overlapped"
        model._pipeline.reduce_early = early if mode == "overlapped" else None
        smp.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        train_step(model, x, y)
        opt.step()
        times[mode].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64, help="per replica")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "hybrid_ddp.json"))
    a = ap.parse_args()
    args = (a.steps, a.width, a.blocks, a.batch)
    hybrid = run_ranks(_job, 4, 2, True, *args, True, timeout=600)
    alone = run_ranks(_job, 2, 2, False, *args, False, timeout=600)

    def step_times(results, mode):  # a step takes as long as its slowest rank
        return [max(r[mode][i] for r in results) for i in range(len(results[0][mode]))]

    over, end = step_times(hybrid, "overlapped"), step_times(hybrid, "end_of_step")
    solo = step_times(alone, "overlapped")
    grad_mb = (a.blocks * (a.width * a.width + a.width) + 10 * a.width + 10) * 4 / 2 ** 20
    row = {
        "model": f"MLP {a.blocks}x{a.width} ({grad_mb:.1f} MiB of gradients), microbatches 4",
        "overlapped_ms": 1e3 * statistics.median(over),
        "end_of_step_ms": 1e3 * statistics.median(end),
        "overlapped_vs_end_of_step": statistics.median(o / e for o, e in zip(over, end)),
        "pp2_alone_ms": 1e3 * statistics.median(solo),
        "samples_per_s_pp2xdp2": 2 * a.batch / statistics.median(over),
        "samples_per_s_pp2": a.batch / statistics.median(solo),
        "load_avg_1min": os.getloadavg()[0],
    }
    row["scaling_pp2xdp2_vs_pp2"] = row["samples_per_s_pp2xdp2"] / row["samples_per_s_pp2"]
    print(f"pp=2 x dp=2 vs pp=2 alone, {row['model']}, median of {a.steps} steps "
          f"(load {row['load_avg_1min']:.1f})")
    print(f"  overlapped reduction   {row['overlapped_ms']:8.1f} ms/step")
    print(f"  end-of-step reduction  {row['end_of_step_ms']:8.1f} ms/step   "
          f"overlapped/end-of-step (median of paired ratios) {row['overlapped_vs_end_of_step']:.3f}")
    print(f"  pp=2 alone             {row['pp2_alone_ms']:8.1f} ms/step")
    print(f"  throughput pp2xdp2 / pp2 = {row['scaling_pp2xdp2_vs_pp2']:.2f} "
          f"({row['samples_per_s_pp2xdp2']:.0f} vs {row['samples_per_s_pp2']:.0f} samples/s; "
          "4 processes share 2 cores here)")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
