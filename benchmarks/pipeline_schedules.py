"""Benchmark (a) schedule efficiency and (b) peak live activations, on sleep stages.

Each of p stages sleeps tf in forward and tb = 2 tf in backward while holding a per-process lock
(a "device" that runs one thing at a time), so p = 4-8 processes fit on 2 cores and the timing is
exact. A perfect pipeline takes (m + p - 1)(tf + tb) per step. We run the same stages through
smshim (`simple` and `interleaved`) and through torch.distributed.pipelining (ScheduleGPipe,
Schedule1F1B), in the same processes, and report medians over several steps.

`--loss glue` computes the loss in the root module's forward instead (as users write
`criterion(model(x), y)` and Hugging Face models compute theirs): on pp_rank 0, from the last
stage's output; torch's runs keep `loss_fn` on the last stage.

    python benchmarks/pipeline_schedules.py [--tf-ms 20] [--steps 5] [--p 4] [--m 8 16]
                                            [--loss stage|glue]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from typing import Callable

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from smshim.testing import run_ranks  # noqa: E402

DEVICE_LOCK = threading.Lock()  # one "device" per process


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tf, tb):
        ctx.tb = tb
        with DEVICE_LOCK:
            time.sleep(tf)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        # A kernel reads its input before it computes: the gradient must be here (on pp_rank 0
        # it may be a handle to one still on its way from the next stage).
        g = g.clone()
        with DEVICE_LOCK:
            time.sleep(ctx.tb)
        return g, None, None


class SleepStage(nn.Module):
    def __init__(self, tf: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.tf = tf

    def forward(self, x):
        return _Sleep.apply(x * self.w, self.tf, 2 * self.tf)


class LossStage(SleepStage):
    """The last stage computes the loss, as torch's schedules do with `loss_fn` on the last
    stage: so neither system sends activations back to the first stage for it."""

    def forward(self, x):
        return super().forward(x).sum()


class SleepPipe(nn.Module):
    def __init__(self, p: int, tf: float, glue_loss: bool = False) -> None:
        super().__init__()
        last = SleepStage(tf) if glue_loss else LossStage(tf)
        self.stages = nn.ModuleList([SleepStage(tf) for _ in range(p - 1)] + [last])
        self.glue_loss = glue_loss

    def forward(self, x):
        for s in self.stages:
            x = s(x)
        return x.sum() if self.glue_loss else x


def stage_per_rank(cfg: dict, make_module: Callable[[], nn.Module]):
    """`smp.init(cfg)`, then the module `make_module` builds, its `stages[i]` on pp rank i, as a
    user's script would set it up; returns the DistributedModel and an @smp.step function that
    runs the forward and the backward of the loss (pipeline_hop.py uses it too)."""
    import smdistributed.modelparallel.torch as smp

    smp.init(cfg)
    module = make_module()
    model = smp.DistributedModel(module)
    for i, stage in enumerate(module.stages):
        smp.set_partition(stage, i)

    @smp.step
    def train_step(model, x):
        loss = model(x)
        model.backward(loss)
        return loss

    return model, train_step


def _smshim(p, m, tf, steps, schedule, glue_loss=False):
    # interleaved keeps the default active_microbatches, min(p + 2, m).
    cfg = {"pipeline_parallel_degree": p, "microbatches": m, "pipeline": schedule,
           "auto_partition": False, "default_partition": 0}
    if schedule == "simple":
        cfg["active_microbatches"] = m
    model, train_step = stage_per_rank(cfg, lambda: SleepPipe(p, tf, glue_loss))

    x = torch.ones(m, 4)
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        train_step(model, x)
        times.append(time.perf_counter() - t0)
    peak = model._pipeline.server.peak_live_microbatches
    return {"times": times[1:], "peak_live": peak}


def _torch_pipelining(p, m, tf, steps, schedule):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from smshim.runtime import launch as _runtime

    _runtime.init_distributed()
    rank = dist.get_rank()
    stage_mod = SleepStage(tf)
    stage = PipelineStage(stage_mod, rank, p, torch.device("cpu"))
    cls = ScheduleGPipe if schedule == "simple" else Schedule1F1B
    sched = cls(stage, n_microbatches=m, loss_fn=lambda out, target: out.sum())
    x = torch.ones(m, 4)
    times = []
    for _ in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            sched.step(x)
        elif rank == p - 1:
            sched.step(target=torch.zeros(m, 4), losses=[])
        else:
            sched.step()
        times.append(time.perf_counter() - t0)
    return {"times": times[1:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--m", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--tf-ms", type=float, default=20.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--loss", choices=["stage", "glue"], default="stage",
                    help="where the loss is computed: on the last stage, or in the root's forward")
    ap.add_argument("--out", default=None, help="default: results/pipeline_schedules[_glue].json")
    a = ap.parse_args()
    if a.out is None:
        a.out = os.path.join(os.path.dirname(__file__), "results", "pipeline_schedules"
                             + ("_glue" if a.loss == "glue" else "") + ".json")
    tf = a.tf_ms / 1000
    rows = []
    for m in a.m:
        theory = (m + a.p - 1) * 3 * tf
        for schedule in ("simple", "interleaved"):
            ours = run_ranks(_smshim, a.p, a.p, m, tf, a.steps, schedule, a.loss == "glue",
                             timeout=600)
            theirs = run_ranks(_torch_pipelining, a.p, a.p, m, tf, a.steps, schedule, timeout=600)
            ours_t = statistics.median(max(r["times"][i] for r in ours) for i in range(a.steps))
            theirs_t = statistics.median(max(r["times"][i] for r in theirs) for i in range(a.steps))
            rows.append({
                "p": a.p, "m": m, "schedule": schedule, "loss": a.loss, "theory_s": theory,
                "smshim_s": ours_t,
                "torch_s": theirs_t, "smshim_vs_theory": ours_t / theory,
                "smshim_vs_torch": ours_t / theirs_t,
                "torch_name": "ScheduleGPipe" if schedule == "simple" else "Schedule1F1B",
                "peak_live_microbatches": [r["peak_live"] for r in ours],
            })
    print(f"sleep stages: p={a.p}, tf={a.tf_ms:.0f} ms, tb={2 * a.tf_ms:.0f} ms, "
          f"median of {a.steps} steps, loss on the {'root' if a.loss == 'glue' else 'last stage'}")
    print(f"{'m':>3} {'schedule':<12} {'theory':>8} {'smshim':>8} {'/theory':>8} "
          f"{'torch':>8} {'vs torch':>10} {'peak live mb per stage':>24}")
    for r in rows:
        print(f"{r['m']:>3} {r['schedule']:<12} {r['theory_s']:8.3f} {r['smshim_s']:8.3f} "
              f"{r['smshim_vs_theory']:8.3f} {r['torch_s']:8.3f} {r['smshim_vs_torch']:10.3f} "
              f"{str(r['peak_live_microbatches']):>24}  ({r['torch_name']})")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
