"""Benchmark (e): real compute, the model written the way people write models.

An MLP of 8 pre-LN residual blocks (d = 512, hidden 4d) kept in an `nn.ModuleList` and looped
over in `forward`, then a linear head that computes the loss from the targets; batch 128. Three
systems train it, rotated step by step inside the same p processes (one thread each) so that all
see the same machine load:

- smshim: `smp.DistributedModel(model)` with pp = p, `m` microbatches, schedule `simple` or
  `interleaved`; the model as written (every block its own module, the root's forward a loop),
  partitioned manually (`manual`: blocks split evenly in order, the head with the last ones, by
  `smp.set_partition`) or automatically (`auto`); or, for comparison, the same split written as
  one module per stage (`stages`: the root's forward makes one remote call per microbatch and
  stage instead of one per block, the floor of what serving a stage's calls together could
  reach);
- torch.distributed.pipelining: `PipelineStage`s built from the same blocks (same split),
  `ScheduleGPipe` for `simple`, `Schedule1F1B` for `interleaved`, loss on the last stage;
- one process: the whole model on rank 0 on the same global batch, the other ranks waiting.

Every step includes `optimizer.step()` and `zero_grad()`. A step's time is the slowest rank's; we
report medians over the measured steps and medians of the per-step paired ratios. All three start
from the same weights and see the same batches; the benchmark asserts that smshim's and torch's
losses equal the single-process ones at every step. smshim's transport counters give the messages
and bytes each rank sent to each other rank per step.

    python benchmarks/pipeline_as_written.py [--p 2 4] [--m 4 8] [--steps 10] [--partitions manual auto stages]
                                             [--d 512] [--batch 128] [--pin] [--same-scheduling]
                                             [--block 10]

`--block K`: after the warm-up the systems take turns every K steps instead of every step (each
still takes the batches in order), so that a step does not always start with caches that the
other systems' steps filled.

`--d 16 --batch 64 --m 8 32` makes the blocks tiny: the step is then almost all the engines'
own work around each module call (what many microbatches of a small model cost), and the
table's thread switches of rank 0 show how much of it is threads waking up. `--pin` puts rank r
on core r mod (cores), which makes such CPU-bound runs far less noisy on a shared machine.

Each system runs its threads as shipped: smshim's pipeline puts them in the batch scheduling
class and, on a CPU-only host whose cores the ranks share, each rank on cores of its own
(smshim/runtime/scheduling.py; `--pin` binds every system beforehand); torch and one process
keep the default class and every core. `--same-scheduling` runs them all as smshim does (what
torch would gain from it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections import Counter
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from pipeline_transformer import scheduled_as_shipped, single_process_step  # noqa: E402
from smshim.testing import run_ranks  # noqa: E402

RESULTS = os.path.join(HERE, "results")
D, BLOCKS, CLASSES, BATCH, LR = 512, 8, 16, 128, 1e-3
LOSS_RTOL = 1e-4  # fp32 reduction order differs between the systems, nothing else


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Head(nn.Module):
    def __init__(self, d: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, classes)

    def forward(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc(h), targets)


class MLP(nn.Module):
    """As written: blocks in a ModuleList, looped over; the head computes the loss."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(BLOCKS)])
        self.head = Head(d, CLASSES)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x, targets)


class Stage(nn.Module):
    """torch.distributed.pipelining's stage k: its share of the blocks (+ the head's linear on
    the last stage; the loss is the schedule's loss_fn there)."""

    def __init__(self, model: MLP, k: int, p: int) -> None:
        super().__init__()
        n = BLOCKS // p
        self.blocks = nn.ModuleList(model.blocks[k * n:(k + 1) * n])
        self.fc = model.head.fc if k == p - 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.fc(x) if self.fc is not None else x


class _Chunk(nn.Module):
    """`stages`: a later stage's blocks as one module (the last one's with the head and loss)."""

    def __init__(self, blocks, head: Optional[Head]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = head

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x, targets) if self.head is not None else x


class StagedMLP(nn.Module):
    """`stages`: the same blocks and split, written as pp_rank 0's blocks and one module per
    later stage, so that the root's forward makes one remote call per microbatch and stage."""

    def __init__(self, model: MLP, p: int) -> None:
        super().__init__()
        n = BLOCKS // p
        self.blocks = nn.ModuleList(model.blocks[:n])
        self.stages = nn.ModuleList(_Chunk(model.blocks[k * n:(k + 1) * n],
                                           model.head if k == p - 1 else None)
                                    for k in range(1, p))

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        for stage in self.stages:
            x = stage(x, targets)
        return x


def make_model(d: int = D) -> MLP:
    torch.manual_seed(0)
    return MLP(d)


def make_batches(n: int, d: int = D, batch: int = BATCH) -> List[tuple]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, d, generator=g), torch.randint(0, CLASSES, (batch,), generator=g))
            for _ in range(n)]


def _smshim_setup(p: int, m: int, schedule: str, partition: str, d: int = D):
    import smdistributed.modelparallel.torch as smp

    cfg: Dict[str, Any] = {"pipeline_parallel_degree": p, "microbatches": m, "pipeline": schedule,
                           "auto_partition": partition == "auto", "default_partition": 0}
    if schedule == "simple":
        cfg["active_microbatches"] = m  # else smp switches simple to interleaved
    smp.init(cfg)
    module = StagedMLP(make_model(d), p) if partition == "stages" else make_model(d)
    model = smp.DistributedModel(module)
    if partition == "manual":
        for i, block in enumerate(module.blocks):
            smp.set_partition(block, i // (BLOCKS // p))
        smp.set_partition(module.head, p - 1)
    elif partition == "stages":
        for k, stage in enumerate(module.stages, start=1):
            smp.set_partition(stage, k)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=LR))

    @smp.step
    def train_step(model, x, targets):
        loss = model(x, targets)
        model.backward(loss)
        return loss

    def step(x, targets) -> float:
        loss = train_step(model, x, targets)
        opt.step()
        opt.zero_grad()
        return float(loss.reduce_mean())

    return smp, model, step


def _torch_setup(p: int, m: int, schedule: str, rank: int, d: int = D):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage_mod = Stage(make_model(d), rank, p)
    stage = PipelineStage(stage_mod, rank, p, torch.device("cpu"))
    cls = ScheduleGPipe if schedule == "simple" else Schedule1F1B
    sched = cls(stage, n_microbatches=m, loss_fn=F.cross_entropy)
    opt = torch.optim.Adam(stage_mod.parameters(), lr=LR)

    def step(x, targets) -> float:
        loss = math.nan
        if rank == 0:
            sched.step(x)
        elif rank == p - 1:
            losses: List[torch.Tensor] = []
            sched.step(target=targets, losses=losses)
            loss = float(torch.stack(losses).detach().mean())
        else:
            sched.step()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def pin_rank_to_core() -> None:
    """`--pin`: this process (rank r) on core r mod (the cores it may use)."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[int(os.environ["RANK"]) % len(cores)]})


def run_order(n: int, warmup: int, block: int, names: List[str]) -> List[tuple]:
    """(batch index, system) in the order they run: each system takes every batch in order; the
    systems take turns every step during the warm-up and then every `block` steps, the one
    that goes first rotating, so that all see the same machine. (With `block` 1 each step
    starts with caches that the other systems' steps filled; in blocks, as in a job that runs
    one of them, only a block's first step does.)"""
    order = []
    turns = [(i, i + 1) for i in range(warmup)] + [(i, min(i + block, n))
                                                  for i in range(warmup, n, block)]
    for k, (start, end) in enumerate(turns):
        for name in names[k % 3:] + names[:k % 3]:
            order += [(i, name) for i in range(start, end)]
    return order


def _compare(p: int, m: int, schedule: str, partition: str, warmup: int, steps: int,
             d: int = D, batch: int = BATCH, pin: bool = False, same_scheduling: bool = False,
             block: int = 1):
    import resource

    import torch.distributed as dist

    if pin:
        pin_rank_to_core()
    smp, model, ours = _smshim_setup(p, m, schedule, partition, d)  # brings up the default group
    rank = dist.get_rank()
    systems = {"smshim": ours, "torch": _torch_setup(p, m, schedule, rank, d),
               "single": single_process_step(make_model(d), LR) if rank == 0 else None}
    n = warmup + steps
    times: Dict[str, List[float]] = {k: [math.nan] * n for k in systems}
    cpu: Dict[str, List[float]] = {k: [math.nan] * n for k in systems}
    switches: Dict[str, List[int]] = {k: [0] * n for k in systems}  # this process's switches
    losses: Dict[str, List[float]] = {k: [math.nan] * n for k in systems}
    sent_before: Counter = Counter()
    frames_before: Counter = Counter()
    batches = make_batches(n, d, batch)
    counted = False
    for i, name in run_order(n, warmup, block, list(systems)):
        if i >= warmup and not counted:  # (the warm-up is over: smshim's counts from here)
            sent_before = Counter(model._pipeline.transport.sent_messages)
            frames_before = Counter(model._pipeline.transport.sent_frames)
            counted = True
        x, targets = batches[i]
        scheduled_as_shipped(name, same_scheduling)
        dist.barrier()
        u0 = resource.getrusage(resource.RUSAGE_SELF)
        c0, t0 = time.process_time(), time.perf_counter()
        fn = systems[name]
        loss = fn(x, targets) if fn is not None else math.nan
        times[name][i] = time.perf_counter() - t0
        cpu[name][i] = time.process_time() - c0
        u1 = resource.getrusage(resource.RUSAGE_SELF)
        switches[name][i] = u1.ru_nvcsw + u1.ru_nivcsw - u0.ru_nvcsw - u0.ru_nivcsw
        losses[name][i] = loss
    transport = model._pipeline.transport
    per_step = {f"{kind}->{peer}": n / steps
                for (kind, peer), n in (Counter(transport.sent_messages) - sent_before).items()}
    # Frames (one gloo send each, the messages queued together): what costs CPU per message.
    per_step.update({f"frames->{peer}": n / steps
                     for peer, n in (Counter(transport.sent_frames) - frames_before).items()})
    owned = sorted({n.split(".")[0] + ("." + n.split(".")[1] if n.startswith(("blocks.", "stages.")) else "")
                    for n, _ in model.local_named_parameters()})
    peak = model._pipeline.server.peak_live_microbatches
    smp.reset()
    return {"rank": rank, "times": {k: v[warmup:] for k, v in times.items()},
            "cpu": {k: v[warmup:] for k, v in cpu.items()}, "losses": losses,
            "switches": {k: v[warmup:] for k, v in switches.items()},
            "sent_per_step": per_step, "owned": owned, "peak_live": peak}


def _summarise(results, p, m, schedule, partition) -> Dict[str, Any]:
    n = len(results[0]["times"]["smshim"])
    step_t = {k: [max(r["times"][k][i] for r in results) for i in range(n)]
              for k in ("smshim", "torch", "single")}
    # CPU time of all processes (all threads): the work each system does per step, which other
    # load on a shared machine inflates far less than it inflates wall time.
    step_cpu = {k: [sum(r["cpu"][k][i] for r in results) for i in range(n)]
                for k in ("smshim", "torch", "single")}
    ours, single = results[0]["losses"]["smshim"], results[0]["losses"]["single"]
    theirs = results[p - 1]["losses"]["torch"]
    for name, got in (("smshim", ours), ("torch.distributed.pipelining", theirs)):
        for step, (a, b) in enumerate(zip(got, single)):
            if not math.isclose(a, b, rel_tol=LOSS_RTOL):
                raise AssertionError(f"p={p} m={m} {schedule} {partition}: {name} loss {a:.7f} != "
                                     f"single-process loss {b:.7f} at step {step}")

    def ratio(a, b):
        return statistics.median(x / y for x, y in zip(step_t[a], step_t[b]))

    return {"p": p, "m": m, "schedule": schedule, "partition": partition,
            "torch_name": "ScheduleGPipe" if schedule == "simple" else "Schedule1F1B",
            "smshim_s": statistics.median(step_t["smshim"]),
            "torch_s": statistics.median(step_t["torch"]),
            "single_s": statistics.median(step_t["single"]),
            "smshim_vs_torch": ratio("smshim", "torch"),
            "smshim_vs_single": ratio("smshim", "single"),
            "torch_vs_single": ratio("torch", "single"),
            "ideal_vs_single": (m + p - 1) / (p * m),
            "cpu_s": {k: statistics.median(v) for k, v in step_cpu.items()},
            "cpu_smshim_vs_torch": statistics.median(
                a / b for a, b in zip(step_cpu["smshim"], step_cpu["torch"])),
            # Each process's CPU per step: where a rank's own work is longer than the other
            # system's whole step, no schedule can make up the difference.
            "cpu_by_rank_s": {k: [statistics.median(r["cpu"][k]) for r in results]
                              for k in ("smshim", "torch")},
            # Thread switches per step of pp_rank 0 (which runs the step bodies).
            "rank0_switches": {k: statistics.median(results[0]["switches"][k])
                               for k in ("smshim", "torch", "single")},
            "owned_by_rank": [r["owned"] for r in results],
            "peak_live_by_rank": [r["peak_live"] for r in results],
            "sent_per_step_by_rank": [r["sent_per_step"] for r in results],
            "step_times_s": step_t}


def _traced(p: int, m: int, schedule: str, partition: str) -> int:
    """Warm-up steps, then the step to draw; returns that step's number."""
    smp, _, step = _smshim_setup(p, m, schedule, partition)
    batches = make_batches(3)
    for x, targets in batches:
        step(x, targets)
    smp.reset()
    return len(batches) - 1


def draw_trace(trace_dir: str, p: int, m: int, schedule: str, partition: str, out: str) -> str:
    from smshim.timeline.plot import draw

    os.makedirs(trace_dir, exist_ok=True)
    for old in os.listdir(trace_dir):
        if old.startswith("trace_rank"):
            os.remove(os.path.join(trace_dir, old))
    step = run_ranks(_traced, p, p, m, schedule, partition, timeout=300,
                     env={"SMSHIM_TRACE": os.path.abspath(trace_dir)})[0]
    draw(trace_dir, out, step, f"smshim {schedule}, MLP as written, pp={p}, m={m}, step {step}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--p", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--m", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--steps", type=int, default=10, help="measured steps (after warm-up)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--partitions", nargs="+", default=["manual", "auto"],
                    choices=["manual", "auto", "stages"],
                    help="stages: the same split written as one module per stage (a remote call "
                         "per microbatch and stage instead of one per block)")
    ap.add_argument("--schedules", nargs="+", default=["simple", "interleaved"],
                    choices=["simple", "interleaved"])
    ap.add_argument("--d", type=int, default=D, help="block width")
    ap.add_argument("--batch", type=int, default=BATCH, help="global batch")
    ap.add_argument("--pin", action="store_true", help="rank r on core r mod cores")
    ap.add_argument("--block", type=int, default=1,
                    help="the systems take turns every BLOCK measured steps (1: every step)")
    ap.add_argument("--same-scheduling", action="store_true",
                    help="torch and one process scheduled as smshim's pipeline runs its threads "
                         "(SCHED_BATCH, its rank's cores)")
    ap.add_argument("--out", default=None,
                    help="default: results/pipeline_as_written.json (_d<d>.json for another --d)")
    ap.add_argument("--trace", metavar="DIR", default=None,
                    help="only trace one step (pp=2, m=8, interleaved, manual) into DIR and draw "
                         "results/timeline_as_written.png")
    a = ap.parse_args()
    if a.out is None:
        a.out = os.path.join(RESULTS, "pipeline_as_written"
                             + ("" if a.d == D else f"_d{a.d}") + ".json")
    if a.trace:
        print("wrote", draw_trace(a.trace, 2, 8, "interleaved", "manual",
                                  os.path.join(RESULTS, "timeline_as_written.png")))
        return

    t_start, load = time.perf_counter(), os.getloadavg()
    rows = []
    for p in a.p:
        for m in a.m:
            for partition in a.partitions:
                if p > 2 and partition == "auto":
                    continue  # one auto-partitioned layout (pp = 2) is enough to show it
                for schedule in a.schedules:
                    res = run_ranks(_compare, p, p, m, schedule, partition, a.warmup, a.steps,
                                    a.d, a.batch, a.pin, a.same_scheduling, a.block,
                                    timeout=900)
                    rows.append(_summarise(res, p, m, schedule, partition))
                    r = rows[-1]
                    print(f"p={p} m={m} {partition} {schedule}: smshim {1e3 * r['smshim_s']:.1f} "
                          f"ms, torch {1e3 * r['torch_s']:.1f} ms, single {1e3 * r['single_s']:.1f} "
                          f"ms; ours/torch {r['smshim_vs_torch']:.3f}, ours/single "
                          f"{r['smshim_vs_single']:.3f}", flush=True)
    print(f"\nMLP {BLOCKS} x pre-LN residual block (d={a.d}, hidden {4 * a.d}), head + loss, batch "
          f"{a.batch}; one thread per process{'; pinned' if a.pin else ''}"
          f"{'; every system scheduled as smshim' if a.same_scheduling else ''}; median of "
          f"{a.steps} "
          f"steps after {a.warmup} warm-up"
          f"{f', the systems in turns of {a.block} steps' if a.block > 1 else ''}; "
          f"load avg at start {load[0]:.2f}")
    print(f"{'p':>2} {'m':>3} {'partition':<9} {'schedule':<12} {'smshim ms':>9} {'torch ms':>9} "
          f"{'single ms':>9} {'ours/torch':>10} {'ours/single':>11} {'torch/single':>12} "
          f"{'ideal':>6} {'cpu ours/torch':>14} {'rank-0 switches ours/torch':>26}  peak live mb "
          "per rank")
    for r in rows:
        print(f"{r['p']:>2} {r['m']:>3} {r['partition']:<9} {r['schedule']:<12} "
              f"{1e3 * r['smshim_s']:9.1f} {1e3 * r['torch_s']:9.1f} {1e3 * r['single_s']:9.1f} "
              f"{r['smshim_vs_torch']:10.3f} {r['smshim_vs_single']:11.3f} "
              f"{r['torch_vs_single']:12.3f} {r['ideal_vs_single']:6.3f} "
              f"{r['cpu_smshim_vs_torch']:14.3f} "
              f"{r['rank0_switches']['smshim']:>15.0f} / {r['rank0_switches']['torch']:<8.0f} "
              f"{r['peak_live_by_rank']}")
    for r in rows:
        if r["partition"] == "auto":
            print(f"auto partition (p={r['p']}): " + "; ".join(
                f"rank {i} owns {o}" for i, o in enumerate(r["owned_by_rank"])))
            break
    print("CPU per step by rank, smshim / torch (ms): " + "; ".join(
        f"p={r['p']} m={r['m']} {r['schedule']}: " + ", ".join(
            f"rank {i} {1e3 * a:.1f} / {1e3 * b:.1f}"
            for i, (a, b) in enumerate(zip(r["cpu_by_rank_s"]["smshim"], r["cpu_by_rank_s"]["torch"])))
        for r in rows))
    print("smshim messages per step, by sender (kind->receiving pp rank), last row:")
    for i, sent in enumerate(rows[-1]["sent_per_step_by_rank"]):
        print(f"  rank {i}: {dict(sorted(sent.items()))}")
    print(f"losses equal to single-process within rtol {LOSS_RTOL} at every step (smshim and torch)")
    wall = time.perf_counter() - t_start
    print(f"wall time {wall:.0f} s; load avg at end {os.getloadavg()[0]:.2f}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"d": a.d, "blocks": BLOCKS, "batch": a.batch, "pinned": a.pin,
                   "same_scheduling": a.same_scheduling,
                   "steps": a.steps, "warmup": a.warmup, "block": a.block,
                   "load_avg_start": load, "load_avg_end": os.getloadavg(), "wall_s": wall,
                   "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
