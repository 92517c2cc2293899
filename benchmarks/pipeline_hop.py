"""Benchmark: what one pipeline hop costs, next to raw gloo's latency, and where the time goes.

A hop is the time from the end of one stage's compute for a microbatch to the start of the next
stage's compute for it: forward (stage 0 to 1, the activation) and backward (stage 1 to 0, the
input gradient). Two sleep stages (p = 2, m microbatches, GPipe order: smshim `simple`, torch
`ScheduleGPipe`) make the compute exact and idle the receiver whenever a microbatch comes: stage 0
sleeps 4 ms forward and 1 ms backward, stage 1 sleeps 1 ms forward and 4 ms backward, so no hop
waits behind compute. Each stage records when its compute starts and ends (CLOCK_MONOTONIC, one
clock per host), in smshim and in `torch.distributed.pipelining` alike, in the same processes.
Raw gloo: a 4 KiB `isend` from rank 0, received by a second thread on rank 1 (as smshim's
receivers do), `benchmarks/gloo_latency.py`'s measurement.

smshim's hop is then split with its own trace (`SMSHIM_TRACE`; `smshim timeline` draws it):
- sender: from the stage's compute end to its frame posted (the rest of the module call, the
  caller's bookkeeping, pickling the header, gloo's isend);
- wire: frame posted to frame received and parsed on the other side (gloo, the receiver thread);
- receiver: frame received to compute start (dispatch, run queue, compute lock, unpacking).
The trace costs time itself, so the split comes from a separate, traced run and its parts add up
to more than the untraced hop.

    python benchmarks/pipeline_hop.py [--m 8] [--steps 12] [--runs 3] [--messages 300]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Dict, List, Tuple

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from gloo_latency import _one_way  # noqa: E402
from smshim.testing import run_ranks  # noqa: E402

RESULTS = os.path.join(HERE, "results")
# (forward, backward) sleep of each stage, in seconds: the receiver of every hop is idle.
SLEEPS = ((0.004, 0.001), (0.001, 0.004))
_DEVICE = threading.Lock()  # one "device" per process
_RECORDS: List[Tuple[str, int, int, int]] = []  # (direction, microbatch, start ns, end ns)


def _microbatch() -> int:
    from smshim.modelparallel.torch.state import state

    return state.microbatch


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tf, tb, tag):
        ctx.tb, ctx.tag = tb, tag
        with _DEVICE:
            t0 = time.perf_counter_ns()
            time.sleep(tf)
            _RECORDS.append(("F", tag(), t0, time.perf_counter_ns()))
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        with _DEVICE:
            t0 = time.perf_counter_ns()
            time.sleep(ctx.tb)
            _RECORDS.append(("B", ctx.tag(), t0, time.perf_counter_ns()))
        return g, None, None, None


class Stage(nn.Module):
    def __init__(self, k: int, tag) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.tf, self.tb = SLEEPS[k]
        self.tag = tag

    def forward(self, x):
        return _Sleep.apply(x * self.w, self.tf, self.tb, self.tag)


class Pipe(nn.Module):
    def __init__(self, tag) -> None:
        super().__init__()
        self.stages = nn.ModuleList([Stage(0, tag), Stage(1, tag)])

    def forward(self, x):
        for s in self.stages:
            x = s(x)
        return x.sum()


def _smshim(m: int, steps: int) -> List[tuple]:
    import smdistributed.modelparallel.torch as smp

    torch.set_num_threads(1)
    smp.init({"pipeline_parallel_degree": 2, "microbatches": m, "pipeline": "simple",
              "active_microbatches": m, "auto_partition": False, "default_partition": 0})
    module = Pipe(_microbatch)
    model = smp.DistributedModel(module)
    for i, stage in enumerate(module.stages):
        smp.set_partition(stage, i)

    @smp.step
    def train_step(model, x):
        loss = model(x)
        model.backward(loss)
        return loss

    x = torch.ones(m, 4)
    records = []
    for i in range(steps + 2):
        _RECORDS.clear()
        train_step(model, x)
        smp.barrier()
        if i >= 2:  # (warm-up: the first steps learn the modules' output shapes)
            records.append((i, list(_RECORDS)))
    smp.reset()
    return records


def _torch(m: int, steps: int) -> List[tuple]:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from smshim.runtime import launch as _runtime

    torch.set_num_threads(1)
    _runtime.init_distributed()
    rank = dist.get_rank()
    counter = {"F": 0, "B": 0}

    # GPipe runs the microbatches in order, forward then backward: count them.
    def tag():
        return -1

    stage_mod = Stage(rank, tag)
    stage = PipelineStage(stage_mod, rank, 2, torch.device("cpu"))
    sched = ScheduleGPipe(stage, n_microbatches=m, loss_fn=lambda out, target: out.sum())
    x = torch.ones(m, 4)
    records = []
    for i in range(steps + 2):
        _RECORDS.clear()
        dist.barrier()
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=torch.zeros(m, 4), losses=[])
        dist.barrier()
        if i >= 2:
            recs = []
            for direction, _, t0, t1 in _RECORDS:
                recs.append((direction, counter[direction] % m, t0, t1))
                counter[direction] += 1
            records.append((i, recs))
        counter = {"F": 0, "B": 0}
    return records


def _hops(by_rank: List[List[tuple]]) -> Dict[str, List[float]]:
    """Forward and backward hops (ms) from both ranks' compute records, step by step."""
    out: Dict[str, List[float]] = {"forward": [], "backward": []}
    for (_, r0), (_, r1) in zip(by_rank[0], by_rank[1]):
        s0 = {(d, mb): (t0, t1) for d, mb, t0, t1 in r0}
        s1 = {(d, mb): (t0, t1) for d, mb, t0, t1 in r1}
        for (d, mb), (t0, t1) in s0.items():
            if d == "F" and ("F", mb) in s1:
                out["forward"].append((s1[("F", mb)][0] - t1) / 1e6)
        for (d, mb), (t0, t1) in s1.items():
            if d == "B" and ("B", mb) in s0:
                out["backward"].append((s0[("B", mb)][0] - t1) / 1e6)
    return out


def _split(trace_dir: str, by_rank: List[List[tuple]]) -> Dict[str, Dict[str, float]]:
    """smshim's hops cut in three with its trace: sender, wire, receiver (medians, ms)."""
    events = []
    for r in range(2):
        with open(os.path.join(trace_dir, f"trace_rank{r}.json")) as f:
            data = json.load(f)
        events.append(data["traceEvents"] if isinstance(data, dict) else data)

    # Frames by (step, microbatch of their first message): the first carrying a forward request
    # (the activation's), or the last carrying a value (the input gradient; the loss's value
    # goes before it).
    def sends(rank, kind, last):
        out = {}
        for e in sorted(events[rank], key=lambda e: e.get("ts", 0)):
            if e.get("cat") == "transfer" and e.get("ph") == "X" and kind in e["name"]:
                key = (e["args"].get("step"), e["args"].get("microbatch"))
                if last or key not in out:
                    out[key] = (e["ts"] * 1e3, (e["ts"] + e["dur"]) * 1e3)
        return out

    def recvs(rank, kind, last):
        out = {}
        for e in sorted(events[rank], key=lambda e: e.get("ts", 0)):
            if e.get("cat") == "transfer" and e.get("ph") == "i" and kind in e["name"]:
                key = (e["args"].get("step"), e["args"].get("microbatch"))
                if last or key not in out:
                    out[key] = e["ts"] * 1e3
        return out

    parts: Dict[str, Dict[str, List[float]]] = {
        "forward": {"sender": [], "wire": [], "receiver": []},
        "backward": {"sender": [], "wire": [], "receiver": []}}
    for direction, src, dst, kind in (("forward", 0, 1, "fwd_req"), ("backward", 1, 0, "value")):
        last = direction == "backward"
        posted, received = sends(src, kind, last), recvs(dst, kind, last)
        for (step, recs_src), (_, recs_dst) in zip(by_rank[src], by_rank[dst]):
            end = {mb: t1 for d, mb, _, t1 in recs_src if d == direction[0].upper()}
            start = {mb: t0 for d, mb, t0, _ in recs_dst if d == direction[0].upper()}
            for mb, t1 in end.items():
                key = (step, mb)
                if mb not in start or key not in posted or key not in received:
                    continue
                p0, p1 = posted[key]
                parts[direction]["sender"].append((p1 - t1) / 1e6)
                parts[direction]["wire"].append((received[key] - p1) / 1e6)
                parts[direction]["receiver"].append((start[mb] - received[key]) / 1e6)
    return {d: {k: statistics.median(v) if v else float("nan") for k, v in p.items()}
            for d, p in parts.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--runs", type=int, default=3, help="paired runs (smshim and torch each)")
    ap.add_argument("--messages", type=int, default=300, help="raw gloo messages")
    ap.add_argument("--out", default=os.path.join(RESULTS, "pipeline_hop.json"))
    a = ap.parse_args()

    gloo_ms = [1e3 * x for x in run_ranks(_one_way, 2, a.messages, 0.005, True, timeout=300)[1]]
    runs = []
    for _ in range(a.runs):
        ours = _hops(run_ranks(_smshim, 2, a.m, a.steps, timeout=600))
        theirs = _hops(run_ranks(_torch, 2, a.m, a.steps, timeout=600))
        runs.append({"smshim": {k: statistics.median(v) for k, v in ours.items()},
                     "torch": {k: statistics.median(v) for k, v in theirs.items()}})
    with tempfile.TemporaryDirectory() as trace_dir:
        traced = run_ranks(_smshim, 2, a.m, 4, timeout=600, env={"SMSHIM_TRACE": trace_dir})
        split = _split(trace_dir, traced)
        traced_hops = {k: statistics.median(v) for k, v in _hops(traced).items()}

    def med(system, direction):
        return statistics.median(r[system][direction] for r in runs)

    print(f"pipeline hop, p=2, m={a.m}, GPipe order, idle receiver; medians over {a.steps} steps "
          f"x {a.m} microbatches, median of {a.runs} runs")
    print(f"  raw gloo one-way (4 KiB, received in a second thread): "
          f"{statistics.median(gloo_ms):.3f} ms")
    print(f"  {'':10s} {'smshim ms':>10s} {'torch ms':>10s} {'smshim/torch':>13s}   runs (smshim/torch)")
    for d in ("forward", "backward"):
        ratios = " ".join(f"{r['smshim'][d] / r['torch'][d]:.2f}" for r in runs)
        print(f"  {d:10s} {med('smshim', d):10.3f} {med('torch', d):10.3f} "
              f"{med('smshim', d) / med('torch', d):13.2f}   {ratios}")
    print("  smshim's hop in its trace (a traced run: the trace adds its own cost):")
    for d in ("forward", "backward"):
        s = split[d]
        print(f"    {d:9s} hop {traced_hops[d]:.3f} ms = sender {s['sender']:.3f} + wire "
              f"{s['wire']:.3f} + receiver {s['receiver']:.3f}")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"m": a.m, "steps": a.steps, "sleeps_s": SLEEPS,
                   "gloo_ms_median": statistics.median(gloo_ms), "runs": runs,
                   "traced_hops_ms": traced_hops, "traced_split_ms": split}, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
