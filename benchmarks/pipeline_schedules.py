"""Benchmark (a) schedule efficiency and (b) peak live activations, on sleep stages.

Each of p stages sleeps tf in forward and tb = 2 tf in backward while holding a per-process lock
(a "device" that runs one thing at a time), so p = 4-8 processes fit on 2 cores and the timing is
exact. A perfect pipeline takes (m + p - 1)(tf + tb) per step. We run the same stages through
smshim (`simple` and `interleaved`) and through torch.distributed.pipelining (ScheduleGPipe,
Schedule1F1B), in the same processes, and report medians over several steps, and each rank's
CPU time a step (every thread's: the interpreter's work, which on a real device is what a
pipeline adds to its kernels).

`--loss glue` computes the loss in the root module's forward instead (as users write
`criterion(model(x), y)` and Hugging Face models compute theirs): on pp_rank 0, from the last
stage's output; torch's runs keep `loss_fn` on the last stage.

`--gaps` also says where each system's step lost time against the theory: every stage stamps
its sleeps, and each sleep's start is set against the later of its input's end (the previous
stage's forward of the microbatch, the next stage's backward, or the last stage's own forward)
and its stage's previous sleep's end: a "hop" when the input came last (the transfer and the
work on both sides of it), a "turn" when the stage's own previous sleep did (the stage going
from one piece of work to the next); in all, then stage by stage. On pp_rank 0 also the step's
"head" (from the step function's call to its first sleep) and "tail" (from its last sleep's end
to the step function's return). And which of them make pp_rank 0's step: its critical path,
walked back from its last sleep through the sleep each one waited for last (its input or its
stage's previous sleep), the sleeps ("work") and the gaps on it adding up to the step's time.

    python benchmarks/pipeline_schedules.py [--tf-ms 20] [--steps 5] [--p 4] [--m 8 16]
                                            [--loss stage|glue] [--gaps]
                                            [--schedules simple interleaved]
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from smshim.testing import run_ranks  # noqa: E402

DEVICE_LOCK = threading.Lock()  # one "device" per process

# `--gaps`: this process's sleeps, ("F" or "B", microbatch, start, end); None: not recorded.
_SLEEPS: Optional[list] = None


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tf, tb):
        ctx.tb = tb
        # (With --gaps each microbatch's inputs hold its index: `_inputs`. Torch's later stages
        # first run on uninitialized tensors to infer shapes, in the warm-up step: not a
        # microbatch, and their first element may be NaN or infinite.)
        mb = float(x.reshape(-1)[0]) if _SLEEPS is not None else -1.0
        ctx.mb = int(mb) if math.isfinite(mb) else -1
        with DEVICE_LOCK:
            t0 = time.perf_counter()
            time.sleep(tf)
            t1 = time.perf_counter()
        if _SLEEPS is not None:
            _SLEEPS.append(("F", ctx.mb, t0, t1))
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        # A kernel reads its input before it computes: the gradient must be here (on pp_rank 0
        # it may be a handle to one still on its way from the next stage).
        g = g.clone()
        with DEVICE_LOCK:
            t0 = time.perf_counter()
            time.sleep(ctx.tb)
            t1 = time.perf_counter()
        if _SLEEPS is not None:
            _SLEEPS.append(("B", ctx.mb, t0, t1))
        return g, None, None


def _inputs(m: int, gaps: bool) -> torch.Tensor:
    """A step's batch: with `gaps`, row i (microbatch i's) holds i, which the stages pass on."""
    if not gaps:
        return torch.ones(m, 4)
    return torch.arange(m, dtype=torch.float32)[:, None].expand(m, 4).contiguous()


def _recording(gaps: bool) -> None:
    global _SLEEPS
    _SLEEPS = [] if gaps else None


def _step_ops(results: list, p: int, step: int) -> Dict[tuple, tuple]:
    """Every sleep of one step, keyed (stage, kind, microbatch): (start, end, the gap before it
    as (kind of gap, seconds) or None for its stage's first sleep without an input to wait for,
    and the key of the sleep whose end it waited for last, or None); see the module docstring.
    `results[r]["sleeps"][step]` is stage r's sleeps."""
    ops = {(r, kind, mb): (t0, t1) for r in range(p)
           for kind, mb, t0, t1 in results[r]["sleeps"][step]}
    out = {}
    for r in range(p):
        prev = None
        for (t0, t1), (kind, mb) in sorted((v, k[1:]) for k, v in ops.items() if k[0] == r):
            if kind == "F":
                dep = (r - 1, "F", mb) if r > 0 else None
            else:
                dep = (r + 1, "B", mb) if r < p - 1 else (r, "F", mb)
            if dep is not None and dep not in ops:
                dep = None
            if dep is not None and (prev is None or ops[dep][1] >= ops[prev][1]):
                name = f"hop {kind}" if r < p - 1 or kind == "F" else "last F to B"
                gap, after = (name, t0 - ops[dep][1]), dep
            elif prev is not None:
                gap, after = (f"turn to {kind}", t0 - ops[prev][1]), prev
            else:
                gap, after = None, None  # (a step's first sleep)
            out[(r, kind, mb)] = (t0, t1, gap, after)
            prev = (r, kind, mb)
    return out


def _steps(results: list, p: int) -> List[Tuple[Dict[tuple, tuple], Tuple[float, float]]]:
    """Each recorded step's sleeps (`_step_ops`) with pp_rank 0's span of it, worked out once
    for the gaps and the critical path."""
    return [(_step_ops(results, p, step), results[0]["spans"][step])
            for step in range(len(results[0]["sleeps"]))]


def _head_and_tail(ops: Dict[tuple, tuple], span: Tuple[float, float]) -> Optional[tuple]:
    """pp_rank 0's step head (the step function's call to its first sleep) and tail (its last
    sleep's end to the return), in seconds, and the key of that last sleep; None if it has no
    sleep in the step."""
    mine = [k for k in ops if k[0] == 0]
    if not mine:
        return None
    first = min(mine, key=lambda k: ops[k][0])
    last = max(mine, key=lambda k: ops[k][1])
    return ops[first][0] - span[0], span[1] - ops[last][1], last


def _step_gaps(ops: Dict[tuple, tuple], span: Tuple[float, float]) -> List[Tuple[str, int, float]]:
    """(kind, stage, seconds) of every gap of one step, and pp_rank 0's head and tail."""
    gaps = [(gap[0], key[0], gap[1]) for key, (_, _, gap, _) in ops.items() if gap is not None]
    head_tail = _head_and_tail(ops, span)
    if head_tail is not None:
        gaps.append(("step head", 0, head_tail[0]))
        gaps.append(("step tail", 0, head_tail[1]))
    return gaps


def _critical_path(steps: list) -> Dict[str, float]:
    """What pp_rank 0's step is made of, in ms, means over the steps (`_steps`): walking back
    from its last sleep, each sleep ("work") and the gap before it, through the sleep it waited
    for last, to the step's first; with the step's head and tail they add up to its time. Keyed
    as the gaps are ("kind, stage r")."""
    sums: Dict[str, float] = collections.defaultdict(float)
    for ops, span in steps:
        head_tail = _head_and_tail(ops, span)
        if head_tail is None:
            continue
        head, tail, key = head_tail
        sums["step tail, stage 0"] += tail
        while key is not None:
            t0, t1, gap, after = ops[key]
            sums["work"] += t1 - t0
            if gap is not None:
                sums[f"{gap[0]}, stage {key[0]}"] += gap[1]
            elif key[0] == 0:  # (pp_rank 0's first sleep)
                sums["step head, stage 0"] += head
            key = after
    return {k: v * 1e3 / len(steps)
            for k, v in sorted(sums.items(), key=lambda kv: _gap_order(kv[0]))}


def _gaps(steps: list) -> Tuple[Dict[str, Tuple[float, float]], Dict[str, Tuple[float, float]]]:
    """(Sum in ms, count) a step of each kind of gap, medians over the steps (`_steps`): by
    kind, and by kind at each stage (keyed "kind, stage r"), from one pass over each step's
    gaps."""
    per_step = []
    for ops, span in steps:
        sums: Dict[str, float] = collections.defaultdict(float)
        counts: Dict[str, int] = collections.defaultdict(int)
        for name, r, gap in _step_gaps(ops, span):
            for key in (name, f"{name}, stage {r}"):
                sums[key] += gap
                counts[key] += 1
        per_step.append((sums, counts))
    names = sorted({n for sums, _ in per_step for n in sums}, key=_gap_order)
    medians = {n: (statistics.median(s[n] for s, _ in per_step) * 1e3,
                   statistics.median(c[n] for _, c in per_step)) for n in names}
    by_kind = {n: v for n, v in medians.items() if ", stage " not in n}
    return by_kind, {n: v for n, v in medians.items() if n not in by_kind}


def _gap_order(name: str) -> Tuple[str, int]:
    """Sort key of a gap's name: its kind, then its stage as a number (stage 10 after 9)."""
    kind, _, stage = name.partition(", stage ")
    return kind, int(stage) if stage else -1


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


def _timed_steps(steps: int, gaps: bool, one_step: Callable[[], None],
                 before: Callable[[], None] = lambda: None) -> dict:
    """Run `one_step` steps + 1 times (the first is a warm-up, left out), each after `before`
    (untimed); each step's span on this process's clock, CPU time and (with `gaps`) sleeps."""
    spans, sleeps, cpu = [], [], []
    for _ in range(steps + 1):
        before()
        _recording(gaps)
        c0, t0 = time.process_time(), time.perf_counter()
        one_step()
        spans.append((t0, time.perf_counter()))
        cpu.append(time.process_time() - c0)
        sleeps.append(_SLEEPS)
    _recording(False)
    return {"times": [b - a for a, b in spans[1:]], "spans": spans[1:], "sleeps": sleeps[1:],
            "cpu": cpu[1:]}


def _smshim(p, m, tf, steps, schedule, glue_loss=False, gaps=False):
    # interleaved keeps the default active_microbatches, min(p + 2, m).
    cfg = {"pipeline_parallel_degree": p, "microbatches": m, "pipeline": schedule,
           "auto_partition": False, "default_partition": 0}
    if schedule == "simple":
        cfg["active_microbatches"] = m
    model, train_step = stage_per_rank(cfg, lambda: SleepPipe(p, tf, glue_loss))

    x = _inputs(m, gaps)
    out = _timed_steps(steps, gaps, lambda: train_step(model, x))
    out["peak_live"] = model._pipeline.server.peak_live_microbatches
    return out


def _torch_pipelining(p, m, tf, steps, schedule, gaps=False):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from smshim.runtime import launch as _runtime

    _runtime.init_distributed()
    rank = dist.get_rank()
    stage_mod = SleepStage(tf)
    stage = PipelineStage(stage_mod, rank, p, torch.device("cpu"))
    cls = ScheduleGPipe if schedule == "simple" else Schedule1F1B
    sched = cls(stage, n_microbatches=m, loss_fn=lambda out, target: out.sum())
    x = _inputs(m, gaps)

    def one_step() -> None:
        if rank == 0:
            sched.step(x)
        elif rank == p - 1:
            sched.step(target=torch.zeros(m, 4), losses=[])
        else:
            sched.step()

    return _timed_steps(steps, gaps, one_step, before=dist.barrier)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--m", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--tf-ms", type=float, default=20.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--loss", choices=["stage", "glue"], default="stage",
                    help="where the loss is computed: on the last stage, or in the root's forward")
    ap.add_argument("--out", default=None,
                    help="default: results/pipeline_schedules[_glue][_gaps].json")
    ap.add_argument("--schedules", nargs="+", choices=["simple", "interleaved"],
                    default=["simple", "interleaved"])
    ap.add_argument("--gaps", action="store_true",
                    help="also where each step lost time against the theory (see above)")
    a = ap.parse_args()
    if a.out is None:  # (a --gaps run has its own file: the plain runs' figures stay)
        a.out = os.path.join(os.path.dirname(__file__), "results", "pipeline_schedules"
                             + ("_glue" if a.loss == "glue" else "")
                             + ("_gaps" if a.gaps else "") + ".json")
    tf = a.tf_ms / 1000
    rows = []
    for m in a.m:
        theory = (m + a.p - 1) * 3 * tf
        for schedule in a.schedules:
            ours = run_ranks(_smshim, a.p, a.p, m, tf, a.steps, schedule, a.loss == "glue",
                             a.gaps, timeout=600)
            theirs = run_ranks(_torch_pipelining, a.p, a.p, m, tf, a.steps, schedule, a.gaps,
                               timeout=600)
            ours_t = statistics.median(max(r["times"][i] for r in ours) for i in range(a.steps))
            theirs_t = statistics.median(max(r["times"][i] for r in theirs) for i in range(a.steps))
            rows.append({
                "p": a.p, "m": m, "schedule": schedule, "loss": a.loss, "theory_s": theory,
                "smshim_s": ours_t,
                "torch_s": theirs_t, "smshim_vs_theory": ours_t / theory,
                "smshim_vs_torch": ours_t / theirs_t,
                "torch_name": "ScheduleGPipe" if schedule == "simple" else "Schedule1F1B",
                "peak_live_microbatches": [r["peak_live"] for r in ours],
                "cpu_ms_per_step": {  # each rank's, every thread's, median over the steps
                    "smshim": [statistics.median(r["cpu"]) * 1e3 for r in ours],
                    "torch": [statistics.median(r["cpu"]) * 1e3 for r in theirs]},
            })
            if a.gaps:
                ours_steps, theirs_steps = _steps(ours, a.p), _steps(theirs, a.p)
                (ours_gaps, ours_by_stage), (theirs_gaps, theirs_by_stage) = (
                    _gaps(ours_steps), _gaps(theirs_steps))
                rows[-1]["gaps_ms_and_count"] = {"smshim": ours_gaps, "torch": theirs_gaps}
                rows[-1]["gaps_by_stage_ms_and_count"] = {"smshim": ours_by_stage,
                                                          "torch": theirs_by_stage}
                rows[-1]["critical_path_ms"] = {"smshim": _critical_path(ours_steps),
                                                "torch": _critical_path(theirs_steps)}
    print(f"sleep stages: p={a.p}, tf={a.tf_ms:.0f} ms, tb={2 * a.tf_ms:.0f} ms, "
          f"median of {a.steps} steps, loss on the {'root' if a.loss == 'glue' else 'last stage'}")
    print(f"{'m':>3} {'schedule':<12} {'theory':>8} {'smshim':>8} {'/theory':>8} "
          f"{'torch':>8} {'vs torch':>10} {'peak live mb per stage':>24}")
    for r in rows:
        print(f"{r['m']:>3} {r['schedule']:<12} {r['theory_s']:8.3f} {r['smshim_s']:8.3f} "
              f"{r['smshim_vs_theory']:8.3f} {r['torch_s']:8.3f} {r['smshim_vs_torch']:10.3f} "
              f"{str(r['peak_live_microbatches']):>24}  ({r['torch_name']})")
    for r in rows:
        cpu = r["cpu_ms_per_step"]
        print(f"m = {r['m']} {r['schedule']}: CPU a step by rank (ms, every thread): smshim "
              f"{[round(c, 1) for c in cpu['smshim']]}, torch {[round(c, 1) for c in cpu['torch']]}")
    for r in rows:
        for field, title in (("gaps_ms_and_count", "gaps a step"),
                             ("gaps_by_stage_ms_and_count", "the same, stage by stage")):
            if field not in r:
                continue
            g = r[field]
            print(f"m = {r['m']} {r['schedule']}: {title} (median), ms in all (count, mean)")
            for name in sorted(set(g["smshim"]) | set(g["torch"]), key=_gap_order):
                cells = []
                for system in ("smshim", "torch"):
                    total, n = g[system].get(name, (0.0, 0))
                    cells.append(f"{system} {total:7.1f} ({n:4.0f}, {total / max(n, 1):.3f})")
                print(f"  {name:<20} " + "   ".join(cells))
    for r in rows:
        if "critical_path_ms" not in r:
            continue
        c = r["critical_path_ms"]
        print(f"m = {r['m']} {r['schedule']}: pp_rank 0's step along its critical path (mean ms)")
        for name in sorted(set(c["smshim"]) | set(c["torch"]), key=_gap_order):
            ours, theirs = c["smshim"].get(name, 0.0), c["torch"].get(name, 0.0)
            print(f"  {name:<20} smshim {ours:7.2f}   torch {theirs:7.2f}   {ours - theirs:+6.2f}")
        ours, theirs = sum(c["smshim"].values()), sum(c["torch"].values())
        print(f"  {'in all':<20} smshim {ours:7.2f}   torch {theirs:7.2f}   {ours - theirs:+6.2f}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
