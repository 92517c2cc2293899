"""Benchmark (c): a real-compute GPT-style transformer split into 2 pipeline stages.

The same model (token + position embedding, N pre-LN blocks with causal self-attention and an MLP,
final LayerNorm, LM head) is trained three ways, alternating step by step inside the same two
processes (one thread each) so that all three see the same machine load:

- smshim: `smp.DistributedModel` with pp=2, `m` microbatches, schedule `simple` or `interleaved`;
  partitioned manually (`manual`: embedding + first half of the blocks on partition 0, the rest +
  final LN + head on partition 1), automatically (`auto`), or manually with the same layers written
  as two stage modules (`stages`: the root's forward makes one remote call per microbatch instead
  of one per block, which shows what the module server's per-module round trips cost);
- torch.distributed.pipelining: two `PipelineStage`s built from the same layers (same split),
  `ScheduleGPipe` for `simple`, `Schedule1F1B` for `interleaved`, loss on the last stage;
- single process: the whole model on rank 0 (one thread) on the same global batch, while rank 1
  waits in a barrier.

Every step of each system includes `optimizer.step()` and `zero_grad()`. A step's time is the
slowest rank's; we report medians over the measured steps (after warm-up) and the medians of the
per-step paired ratios. The three copies start from the same weights and see the same batches, and
the benchmark asserts that smshim's (and torch's) losses match the single-process ones, so the
systems compare equal work.

    python benchmarks/pipeline_transformer.py [--m 2 4 8] [--steps 12] [--partitions manual auto stages]
                                              [--trace DIR]

With ``--trace DIR`` one extra run per smshim schedule is made with ``SMSHIM_TRACE`` set, and
``benchmarks/results/timeline_{simple,interleaved}.png`` are drawn from it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
from gpt_pipeline import Block  # noqa: E402  (the main job's transformer block)
from smshim.runtime import scheduling  # noqa: E402
from smshim.testing import run_ranks  # noqa: E402

RESULTS = os.path.join(HERE, "results")

# Model and batch size: one training step of the whole model takes ~100-200 ms on one thread
# of this machine's CPU.
MODEL = dict(vocab=512, seq=64, d=128, heads=4, layers=4)
BATCH = 16
LR = 1e-3
LOSS_RTOL = 1e-4  # fp32 reduction order differs between the three systems, nothing else


# ---- the model ---------------------------------------------------------------------------------

class Embed(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok(tokens) + self.pos(pos)


class Head(nn.Module):
    """Final LayerNorm + LM head; with targets it returns the loss, so the logits never leave the
    stage that computes them (in every system)."""

    def __init__(self, d: int, vocab: int) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, h: torch.Tensor, targets: torch.Tensor = None) -> torch.Tensor:
        logits = self.lm_head(self.ln_f(h))
        return logits if targets is None else lm_loss(logits, targets)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int, heads: int, layers: int) -> None:
        super().__init__()
        self.embed = Embed(vocab, seq, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.head = Head(d, vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h, targets)


class Stage0(nn.Module):
    def __init__(self, model: GPT) -> None:
        super().__init__()
        half = len(model.blocks) // 2
        self.embed, self.blocks = model.embed, nn.ModuleList(model.blocks[:half])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return h


class Stage1(nn.Module):
    def __init__(self, model: GPT) -> None:
        super().__init__()
        half = len(model.blocks) // 2
        self.blocks, self.head = nn.ModuleList(model.blocks[half:]), model.head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class LossStage1(nn.Module):
    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.stage = Stage1(model)

    def forward(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.stage(h), targets)


class StagedGPT(nn.Module):
    """The same layers, written as two stage modules: the root's forward then makes one call per
    microbatch into partition 1 instead of one per block (plus one for the head)."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.s0, self.s1 = Stage0(model), LossStage1(model)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.s1(self.s0(tokens), targets)


def make_model() -> GPT:
    torch.manual_seed(0)  # identical weights in every copy, on every rank
    return GPT(**MODEL)


def make_batches(n: int) -> List[tuple]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, MODEL["vocab"], (BATCH, MODEL["seq"]), generator=g)
        out.append((tokens, torch.roll(tokens, -1, dims=1)))
    return out


# ---- the three systems, alternated in one pair of processes --------------------------------

def _smshim_setup(m: int, schedule: str, partition: str):
    import smdistributed.modelparallel.torch as smp

    cfg: Dict[str, Any] = {"pipeline_parallel_degree": 2, "microbatches": m, "pipeline": schedule,
                           "auto_partition": partition == "auto", "default_partition": 0}
    if schedule == "simple":
        cfg["active_microbatches"] = m  # else smp switches simple to interleaved
    smp.init(cfg)
    module = StagedGPT(make_model()) if partition == "stages" else make_model()
    model = smp.DistributedModel(module)
    if partition == "manual":
        half = len(module.blocks) // 2
        for block in module.blocks[half:]:
            smp.set_partition(block, 1)
        smp.set_partition(module.head, 1)
    elif partition == "stages":
        smp.set_partition(module.s1, 1)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=LR))

    @smp.step
    def train_step(model, tokens, targets):
        loss = model(tokens, targets)
        model.backward(loss)
        return loss

    def step(tokens, targets) -> float:
        loss = train_step(model, tokens, targets)
        opt.step()
        opt.zero_grad()
        return float(loss.reduce_mean())

    return smp, model, step


def _torch_setup(m: int, schedule: str, rank: int):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    full = make_model()
    stage_mod = Stage0(full) if rank == 0 else Stage1(full)
    stage = PipelineStage(stage_mod, rank, 2, torch.device("cpu"))
    cls = ScheduleGPipe if schedule == "simple" else Schedule1F1B
    sched = cls(stage, n_microbatches=m, loss_fn=lm_loss)
    opt = torch.optim.Adam(stage_mod.parameters(), lr=LR)

    def step(tokens, targets) -> float:
        if rank == 0:
            sched.step(tokens)
            loss = math.nan
        else:
            losses: List[torch.Tensor] = []
            sched.step(target=targets, losses=losses)
            loss = float(torch.stack(losses).detach().mean())
        opt.step()
        opt.zero_grad()
        return loss

    return step


def single_process_step(model: nn.Module, lr: float = LR):
    """One training step of `model(inputs, targets) -> loss` in this process, with Adam (the
    single-process reference of the pipeline benchmarks)."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)

    def step(inputs, targets) -> float:
        loss = model(inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    return step


def scheduled_as_shipped(system: str, same_scheduling: bool = False) -> None:
    """The process's threads as `system` runs them as shipped: smshim's pipeline puts them in
    the batch scheduling class and, on a CPU-only host, on its rank's own cores
    (smshim/runtime/scheduling.py); torch and one process keep the default class and every core,
    unless `same_scheduling` (what they would gain from it). The systems alternate in one
    process: set before each step, outside its timing."""
    if not scheduling.available():
        return
    as_smshim = system == "smshim" or same_scheduling
    batch = as_smshim and os.environ.get(scheduling.ENV, "1") != "0"
    policy = os.SCHED_BATCH if batch else os.SCHED_OTHER
    bound = scheduling.binding()
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            if os.sched_getscheduler(tid) in (os.SCHED_OTHER, os.SCHED_BATCH):
                os.sched_setscheduler(tid, policy, os.sched_param(0))
            if bound is not None:
                os.sched_setaffinity(tid, bound[0] if as_smshim else bound[1])
        except OSError:
            pass  # (a thread that ended meanwhile)


def _compare(m: int, schedule: str, partition: str, warmup: int, steps: int) -> Dict[str, Any]:
    import torch.distributed as dist

    smp, model, ours = _smshim_setup(m, schedule, partition)  # brings up the default group
    rank = dist.get_rank()
    theirs = _torch_setup(m, schedule, rank)
    single = single_process_step(make_model()) if rank == 0 else None
    systems = {"smshim": ours, "torch": theirs, "single": single}
    data = make_batches(warmup + steps)
    times: Dict[str, List[float]] = {k: [] for k in systems}
    cpu: Dict[str, List[float]] = {k: [] for k in systems}
    losses: Dict[str, List[float]] = {k: [] for k in systems}
    for i, (tokens, targets) in enumerate(data):
        # Rotate the order each step so no system always runs right after another one.
        order = list(systems)[i % 3:] + list(systems)[:i % 3]
        for name in order:
            scheduled_as_shipped(name)
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            fn = systems[name]
            loss = fn(tokens, targets) if fn is not None else math.nan
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            losses[name].append(loss)
    # Which blocks each rank ended up owning (interesting for the auto partition).
    owned = sorted({".".join(n.split(".")[:2 if n.startswith("blocks.") else 1])
                    for n, _ in model.local_named_parameters()}) if partition != "stages" else []
    smp.reset()
    return {"rank": rank, "times": {k: v[warmup:] for k, v in times.items()},
            "cpu": {k: v[warmup:] for k, v in cpu.items()}, "losses": losses, "owned": owned}


def _traced(m: int, schedule: str, partition: str) -> int:
    """Warm-up step, then one step to draw; returns that step's number."""
    smp, model, ours = _smshim_setup(m, schedule, partition)
    for tokens, targets in make_batches(2):
        ours(tokens, targets)
    smp.reset()
    return 1


# ---- driver -----------------------------------------------------------------------------------

def _summarise(results: List[Dict[str, Any]], m: int, schedule: str, partition: str) -> Dict[str, Any]:
    n = len(results[0]["times"]["smshim"])
    step_t = {k: [max(r["times"][k][i] for r in results) for i in range(n)]
              for k in ("smshim", "torch", "single")}
    # CPU time of both processes (all threads): the work each system does per step, which other
    # processes on this shared machine cannot inflate the way they inflate wall time.
    step_cpu = {k: [sum(r["cpu"][k][i] for r in results) for i in range(n)]
                for k in ("smshim", "torch", "single")}
    r0, r1 = results  # rank 0 has the single-process and smshim losses, rank 1 torch's
    ours_loss, single_loss, torch_loss = r0["losses"]["smshim"], r0["losses"]["single"], r1["losses"]["torch"]
    for name, got in (("smshim", ours_loss), ("torch.distributed.pipelining", torch_loss)):
        for step, (a, b) in enumerate(zip(got, single_loss)):
            if not math.isclose(a, b, rel_tol=LOSS_RTOL):
                raise AssertionError(
                    f"m={m} {schedule} {partition}: {name} loss {a:.7f} != single-process loss "
                    f"{b:.7f} at step {step}: the systems do not do the same work")
    return {
        "m": m, "schedule": schedule, "partition": partition,
        "torch_name": "ScheduleGPipe" if schedule == "simple" else "Schedule1F1B",
        "smshim_s": statistics.median(step_t["smshim"]),
        "torch_s": statistics.median(step_t["torch"]),
        "single_s": statistics.median(step_t["single"]),
        "smshim_vs_torch": statistics.median(a / b for a, b in zip(step_t["smshim"], step_t["torch"])),
        "smshim_vs_single": statistics.median(a / b for a, b in zip(step_t["smshim"], step_t["single"])),
        "torch_vs_single": statistics.median(a / b for a, b in zip(step_t["torch"], step_t["single"])),
        "cpu_s": {k: statistics.median(v) for k, v in step_cpu.items()},
        "cpu_smshim_vs_torch": statistics.median(
            a / b for a, b in zip(step_cpu["smshim"], step_cpu["torch"])),
        "final_loss": {"smshim": ours_loss[-1], "torch": torch_loss[-1], "single": single_loss[-1]},
        "owned_by_rank": [r["owned"] for r in results],
        "step_times_s": step_t,
        "step_cpu_s": step_cpu,
    }


def _draw_traces(trace_dir: str, m: int) -> List[str]:
    from smshim.timeline.plot import draw

    written = []
    for schedule in ("simple", "interleaved"):
        d = os.path.join(os.path.abspath(trace_dir), schedule)
        os.makedirs(d, exist_ok=True)
        for old in os.listdir(d):
            if old.startswith("trace_rank"):
                os.remove(os.path.join(d, old))
        step = run_ranks(_traced, 2, m, schedule, "manual", timeout=180,
                         env={"SMSHIM_TRACE": d})[0]
        out = os.path.join(RESULTS, f"timeline_{schedule}.png")
        draw(d, out, step, f"smshim {schedule}, GPT 2 stages, m={m}, step {step}")
        written.append(out)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--steps", type=int, default=12, help="measured steps (after warm-up)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--partitions", nargs="+", default=["manual", "auto", "stages"],
                    choices=["manual", "auto", "stages"],
                    help="manual: blocks[:N/2] + embedding on 0, the rest + head on 1; auto: "
                         "smp's auto partition; stages: the same split with the model written as "
                         "two stage modules (one remote call per microbatch)")
    ap.add_argument("--trace", metavar="DIR", default=None,
                    help="also trace one step of each smshim schedule into DIR and draw "
                         "results/timeline_{simple,interleaved}.png")
    ap.add_argument("--trace-m", type=int, default=4, help="microbatches of the traced step")
    ap.add_argument("--out", default=os.path.join(RESULTS, "pipeline_transformer.json"))
    a = ap.parse_args()

    t_start = time.perf_counter()
    load = os.getloadavg()
    rows = []
    for m in a.m:
        for partition in a.partitions:
            for schedule in ("simple", "interleaved"):
                res = run_ranks(_compare, 2, m, schedule, partition, a.warmup, a.steps, timeout=300)
                rows.append(_summarise(res, m, schedule, partition))
    params = sum(p.numel() for p in make_model().parameters())
    header = (f"GPT {MODEL} ({params / 1e6:.2f} M params), batch {BATCH}, 2 stages (pp=2), "
              f"one thread per process; median of {a.steps} steps after {a.warmup} warm-up; "
              f"load avg at start {load[0]:.2f}")
    print(header)
    print("ms: median step time (slowest rank); ratios: medians of per-step paired ratios; cpu "
          "ours/torch: the same for the CPU time of both processes")
    print(f"{'m':>3} {'partition':<9} {'schedule':<12} {'smshim ms':>9} {'torch ms':>9} "
          f"{'single ms':>9} {'ours/torch':>10} {'ours/single':>11} {'torch/single':>12} "
          f"{'cpu ours/torch':>14}  torch schedule")
    for r in rows:
        print(f"{r['m']:>3} {r['partition']:<9} {r['schedule']:<12} {1e3 * r['smshim_s']:9.1f} "
              f"{1e3 * r['torch_s']:9.1f} {1e3 * r['single_s']:9.1f} {r['smshim_vs_torch']:10.3f} "
              f"{r['smshim_vs_single']:11.3f} {r['torch_vs_single']:12.3f} "
              f"{r['cpu_smshim_vs_torch']:14.3f}  {r['torch_name']}")
    for r in rows:
        if r["partition"] == "auto" and r["schedule"] == "simple":
            print(f"auto partition (m={r['m']}): rank 0 owns {r['owned_by_rank'][0]}, "
                  f"rank 1 owns {r['owned_by_rank'][1]}")
            break
    print(f"losses equal to single-process within rtol {LOSS_RTOL} for every step of every run "
          f"(smshim and torch)")
    pngs = _draw_traces(a.trace, a.trace_m) if a.trace else []
    for p in pngs:
        print(f"wrote {os.path.relpath(p)}")
    wall = time.perf_counter() - t_start
    print(f"wall time {wall:.0f} s; load avg at end {os.getloadavg()[0]:.2f}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"model": MODEL, "params": params, "batch": BATCH, "steps": a.steps,
                   "warmup": a.warmup, "load_avg_start": load, "load_avg_end": os.getloadavg(),
                   "wall_s": wall, "loss_rtol": LOSS_RTOL, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
