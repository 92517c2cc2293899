"""Benchmark (d): the cost of smp's wrapping at pipeline_parallel_degree=1.

One process, one thread. The same MLP (two copies with the same initial weights) is trained
through `smp.DistributedModel` + `smp.DistributedOptimizer` + `@smp.step` (config
``{"pipeline_parallel_degree": 1, "microbatches": 1}``) and with a plain
``loss.backward(); opt.step(); opt.zero_grad()`` loop. The two alternate step by step (the order
flipping every pair) so that both see the same machine load; we report the median of the paired
ratios smshim/plain. A small MLP shows the per-step Python overhead, a medium one what is left of it
on a realistic step. The losses of the two copies are checked to stay equal (same work).

    python benchmarks/pp1_overhead.py [--steps 400 100] [--breakdown] [--profile]

Columns: median step times, median paired difference and ratio (wall clock), and the ratio of
thread CPU times (insensitive to other processes taking the core).

``--breakdown`` also runs the small model's step with smshim's layers added one at a time and
prints each layer's cost (median paired difference of thread CPU time) to show where the overhead
goes; ``--profile`` runs cProfile over
the smshim steps of each model and prints the functions with the most cumulative time.
"""

from __future__ import annotations

import argparse
import copy
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
from smshim.testing import run_ranks  # noqa: E402

RESULTS = os.path.join(HERE, "results")

# name -> (input width, hidden width, hidden layers, classes, batch)
SIZES = {
    "small": (32, 64, 2, 10, 32),
    "medium": (256, 1024, 4, 10, 128),
}
TARGET = 1.05


def make_mlp(d_in: int, hidden: int, layers: int, classes: int) -> nn.Module:
    torch.manual_seed(0)
    mods: List[nn.Module] = [nn.Linear(d_in, hidden), nn.ReLU()]
    for _ in range(layers - 1):
        mods += [nn.Linear(hidden, hidden), nn.ReLU()]
    mods.append(nn.Linear(hidden, classes))
    return nn.Sequential(*mods)


def _measure(size: str, warmup: int, steps: int, profile: bool) -> Dict[str, Any]:
    import smdistributed.modelparallel.torch as smp

    d_in, hidden, layers, classes, batch = SIZES[size]
    smp.init({"pipeline_parallel_degree": 1, "microbatches": 1})
    plain_model = make_mlp(d_in, hidden, layers, classes)
    model = smp.DistributedModel(copy.deepcopy(plain_model))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.01, momentum=0.9)

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    def ours(x, y):
        loss = train_step(model, x, y)
        opt.step()
        opt.zero_grad()
        return loss

    def plain(x, y):
        loss = F.cross_entropy(plain_model(x), y)
        loss.backward()
        plain_opt.step()
        plain_opt.zero_grad()
        return loss.detach()

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(batch, d_in, generator=g), torch.randint(0, classes, (batch,), generator=g))
            for _ in range(16)]  # reused cyclically: the data does not change the cost
    # Wall time, and this thread's CPU time: with one thread doing all the work, CPU time is the
    # same work minus the time other processes on this shared machine took the core away.
    t_ours: List[float] = []
    t_plain: List[float] = []
    c_ours: List[float] = []
    c_plain: List[float] = []
    last = {}
    for i in range(warmup + steps):
        x, y = data[i % len(data)]
        pair = [("ours", ours), ("plain", plain)]
        if i % 2:
            pair.reverse()
        for name, fn in pair:
            c0, t0 = time.thread_time(), time.perf_counter()
            out = fn(x, y)
            dt, dc = time.perf_counter() - t0, time.thread_time() - c0
            if i >= warmup:
                (t_ours if name == "ours" else t_plain).append(dt)
                (c_ours if name == "ours" else c_plain).append(dc)
            last[name] = out
    ours_loss = float(last["ours"].reduce_mean())
    plain_loss = float(last["plain"])
    if not math.isclose(ours_loss, plain_loss, rel_tol=1e-5, abs_tol=1e-6):
        raise AssertionError(f"{size}: smshim loss {ours_loss} != plain loss {plain_loss}: "
                             "the two loops do not do the same work")
    result = {
        "size": size, "mlp": dict(zip(("d_in", "hidden", "layers", "classes", "batch"), SIZES[size])),
        "params": sum(p.numel() for p in plain_model.parameters()), "steps": steps,
        "plain_ms": 1e3 * statistics.median(t_plain), "smshim_ms": 1e3 * statistics.median(t_ours),
        "ratio": statistics.median(a / b for a, b in zip(t_ours, t_plain)),
        "overhead_us": 1e6 * statistics.median(a - b for a, b in zip(t_ours, t_plain)),
        "cpu_ratio": statistics.median(a / b for a, b in zip(c_ours, c_plain)),
        "cpu_overhead_us": 1e6 * statistics.median(a - b for a, b in zip(c_ours, c_plain)),
        "final_loss": {"smshim": ours_loss, "plain": plain_loss},
    }
    if profile:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for i in range(steps):
            ours(*data[i % len(data)])
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(40)
        result["profile"] = buf.getvalue()
    return result


def _breakdown(size: str, rounds: int) -> Dict[str, float]:
    """Where smshim's time goes: complete training steps that add smshim's layers one at a time,
    run in turn for `rounds` rounds; each layer's cost is the median paired difference (thread CPU
    time) to the step without it. Measured inside whole steps on purpose: Python code runs slower
    right after the compute has evicted the caches than in a tight loop of its own."""
    import smdistributed.modelparallel.torch as smp
    from smshim.modelparallel.torch.pipeline.microbatch import join_step_outputs, split_step_inputs
    from smshim.modelparallel.torch.pipeline.context import ctx
    from smshim.modelparallel.torch.state import state

    d_in, hidden, layers, classes, batch = SIZES[size]
    smp.init({"pipeline_parallel_degree": 1, "microbatches": 1})
    model = smp.DistributedModel(make_mlp(d_in, hidden, layers, classes))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    inner = opt.optimizer
    x, y = torch.randn(batch, d_in), torch.randint(0, classes, (batch,))

    def body(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    step = smp.step(body)
    step(model, x, y)  # the first step sets the model's per-step state
    mb_inputs = split_step_inputs(body, (model, x, y), {}, 1)

    def in_step(fn):
        ctx.in_step = True
        try:
            return fn()
        finally:
            ctx.in_step = False

    def finish(o):
        o.step()
        o.zero_grad()

    # Each variant adds one layer to the one before it. All run on the same parameters and
    # optimizer state (the plain loop uses the wrapped module and optimizer directly), so that no
    # variant pays for colder caches than another.
    variants = [
        ("plain loop", None,
         lambda: (F.cross_entropy(model.module(x), y).backward(), finish(inner))),
        ("DistributedModel.__call__ (model.py forward)", "model.py",
         lambda: (in_step(lambda: F.cross_entropy(model(x), y).backward()), finish(inner))),
        ("model.backward instead of loss.backward (model.py)", "model.py",
         lambda: (in_step(lambda: body(model, x, y)), finish(inner))),
        ("_run_step/_run_local (model.py)", "model.py",
         lambda: (model._run_step(body, mb_inputs), finish(inner))),
        ("join_step_outputs (microbatch.py)", "microbatch.py",
         lambda: (join_step_outputs(model._run_step(body, mb_inputs), True), finish(inner))),
        ("split_step_inputs (microbatch.py)", "microbatch.py",
         lambda: (join_step_outputs(model._run_step(
             body, split_step_inputs(body, (model, x, y), {}, state.cfg.microbatches)), True),
             finish(inner))),
        ("rest of @smp.step (step.py)", "step.py", lambda: (step(model, x, y), finish(inner))),
        ("DistributedOptimizer.step (optimizer.py)", "optimizer.py",
         lambda: (step(model, x, y), opt.step(), inner.zero_grad())),
        ("DistributedOptimizer.zero_grad (optimizer.py)", "optimizer.py",
         lambda: (step(model, x, y), finish(opt))),
    ]
    times: List[List[int]] = [[] for _ in variants]
    n = len(variants)
    for i in range(rounds + 20):
        # Rotate the order so that no variant always runs in the same place in the round.
        for k in [(i + j) % n for j in range(n)]:
            c0 = time.thread_time_ns()
            variants[k][2]()
            if i >= 20:
                times[k].append(time.thread_time_ns() - c0)
    out = {"plain step (reference; same parameters)": statistics.median(times[0]) / 1e3}
    for k in range(1, len(variants)):
        out[variants[k][0]] = statistics.median(a - b for a, b in zip(times[k], times[k - 1])) / 1e3
    out["all of smshim"] = statistics.median(a - b for a, b in zip(times[-1], times[0])) / 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--steps", type=int, nargs="+", default=[400, 100],
                    help="measured steps per size (one value for all, or one per size)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--out", default=os.path.join(RESULTS, "pp1_overhead.json"))
    a = ap.parse_args()
    steps = a.steps if len(a.steps) == len(a.sizes) else [a.steps[0]] * len(a.sizes)

    load = os.getloadavg()
    rows = []
    for size, n in zip(a.sizes, steps):
        rows.append(run_ranks(_measure, 1, size, a.warmup, n, a.profile, timeout=240)[0])
    print(f"pp=1 step overhead: smp.DistributedModel + DistributedOptimizer + @smp.step vs a plain "
          f"loop, one process, one thread, alternating; load avg at start {load[0]:.2f}")
    print("ratio: median of paired wall-time ratios smshim/plain (the target); cpu ratio: the same "
          "with thread CPU time")
    print(f"{'model':<7} {'params':>9} {'batch':>5} {'steps':>5} {'plain ms':>9} {'smshim ms':>9} "
          f"{'overhead us':>11} {'ratio':>7} {'cpu ratio':>9}  target <= {TARGET}")
    for r in rows:
        ok = "met" if r["ratio"] <= TARGET else "NOT met"
        print(f"{r['size']:<7} {r['params']:>9} {r['mlp']['batch']:>5} {r['steps']:>5} "
              f"{r['plain_ms']:9.3f} {r['smshim_ms']:9.3f} {r['overhead_us']:11.1f} "
              f"{r['ratio']:7.3f} {r['cpu_ratio']:9.3f}  {ok}")
    breakdown = run_ranks(_breakdown, 1, "small", 2000, timeout=240)[0] if a.breakdown else None
    if breakdown:
        print("\nwhere the small model's overhead goes (us of thread CPU time per step; median "
              "paired difference over 2000 rounds):")
        for k, v in breakdown.items():
            print(f"{v:9.1f}  {k}")
    for r in rows:
        if "profile" in r:
            print(f"\ncProfile of {r['steps']} smshim steps, {r['size']} model:\n{r['profile']}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"load_avg_start": load, "load_avg_end": os.getloadavg(), "target": TARGET,
                   "rows": [{k: v for k, v in r.items() if k != "profile"} for r in rows],
                   "breakdown_small_us": breakdown},
                  f, indent=1)


if __name__ == "__main__":
    main()
