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
- sender: from the stage's compute end to its frame's posting (the rest of the module call,
  the caller's bookkeeping);
- post and wire: from the posting's start (pickling the header, gloo's isend) to the frame
  received and parsed on the other side (gloo, the receiver thread); the posting's own length
  is in the JSON ("post");
- receiver: frame received to compute start (dispatch, run queue, compute lock, unpacking).
The trace costs time itself, so the split comes from a separate, traced run and its parts add up
to more than the untraced hop.

Last, where an overhead-bound model's step goes: the tiny-block model of
`pipeline_as_written.py` (d = 16, batch 128, pp = 2, m = 8, interleaved), traced. Under 1F1B,
stage 0 may start microbatch k + 2 only once k's backward is over, which waits for stage 1's
gradient: each microbatch goes once round a loop through both ranks (gradient hop, stage 0's
backward of k and forward of k + 2, the requests for stage 1 issued and posted, forward hop),
and while that loop is longer than stage 1's own work, it is the step's period. `--no-loop`
skips it.

    python benchmarks/pipeline_hop.py [--m 8] [--steps 12] [--runs 3] [--messages 300] [--no-loop]
"""

from __future__ import annotations

import argparse
import collections
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
from pipeline_schedules import stage_per_rank  # noqa: E402
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
        g = g.clone()  # (a kernel reads its input first: on pp_rank 0, a handle is fetched here)
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
    model, train_step = stage_per_rank(
        {"pipeline_parallel_degree": 2, "microbatches": m, "pipeline": "simple",
         "active_microbatches": m, "auto_partition": False, "default_partition": 0},
        lambda: Pipe(_microbatch))

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
    stage_mod = Stage(rank, lambda: -1)  # (numbered below)
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
            # GPipe runs the microbatches in order, forward then backward: the k-th record of a
            # direction is microbatch k's.
            records.append((i, [(d, k, t0, t1) for d in "FB" for k, (_, _, t0, t1)
                                in enumerate(r for r in _RECORDS if r[0] == d)]))
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
    # goes before it). Posted frames are spans ("X": start and end, ns), received ones instants.
    def frames(rank, phase, kind, last):
        out = {}
        for e in sorted(events[rank], key=lambda e: e.get("ts", 0)):
            if e.get("cat") == "transfer" and e.get("ph") == phase and kind in e["name"]:
                key = (e["args"].get("step"), e["args"].get("microbatch"))
                if last or key not in out:
                    out[key] = ((e["ts"] * 1e3, (e["ts"] + e["dur"]) * 1e3) if phase == "X"
                                else e["ts"] * 1e3)
        return out

    parts: Dict[str, Dict[str, List[float]]] = {
        "forward": {"sender": [], "post": [], "wire": [], "receiver": []},
        "backward": {"sender": [], "post": [], "wire": [], "receiver": []}}
    for direction, src, dst, kind in (("forward", 0, 1, "fwd_req"), ("backward", 1, 0, "value")):
        last = direction == "backward"
        posted, received = frames(src, "X", kind, last), frames(dst, "i", kind, last)
        for (step, recs_src), (_, recs_dst) in zip(by_rank[src], by_rank[dst]):
            end = {mb: t1 for d, mb, _, t1 in recs_src if d == direction[0].upper()}
            start = {mb: t0 for d, mb, t0, _ in recs_dst if d == direction[0].upper()}
            for mb, t1 in end.items():
                key = (step, mb)
                if mb not in start or key not in posted or key not in received:
                    continue
                p0, p1 = posted[key]
                # (The post's end can come after the receipt: a sender thread that loses its
                # core right after the isend. The wire is counted from the post's start.)
                parts[direction]["sender"].append((p0 - t1) / 1e6)
                parts[direction]["post"].append((p1 - p0) / 1e6)
                parts[direction]["wire"].append((received[key] - p0) / 1e6)
                parts[direction]["receiver"].append((start[mb] - received[key]) / 1e6)
    return {d: {k: statistics.median(v) if v else float("nan") for k, v in p.items()}
            for d, p in parts.items()}


# ---- the overhead-bound model's critical loop ------------------------------------------------

def _loop_run(m: int, steps: int) -> int:
    """The tiny-block model as written (pipeline_as_written.py, d = 16, batch 128), pp = 2,
    interleaved, traced; returns the last step's number."""
    import pipeline_as_written as written

    os.sched_setaffinity(0, {int(os.environ["RANK"]) % os.cpu_count()})
    torch.set_num_threads(1)
    smp, _, step = written._smshim_setup(2, m, "interleaved", "manual", 16)
    for x, targets in written.make_batches(steps, 16, 128):
        step(x, targets)
    smp.reset()
    return steps - 1


def _loop(trace_dir: str, m: int, first_step: int, last_step: int) -> Dict[str, float]:
    """Under 1F1B at p = 2, stage 0 runs microbatch k + 2's forward only once k's backward is
    over, and k's backward starts when stage 1's input gradient for k comes: a loop through
    both ranks that each microbatch goes round once. Its parts (ms) from the trace:
    gradient hop (stage 1's frame posted to received), stage 0's backward of k, the gap to its
    forward of k + 2, that forward's own modules, the requests for stage 1's modules and the
    backward's requests issued, the frame posted, and the forward hop (posted to received);
    means over the steady state's microbatches."""
    ev = []
    for r in range(2):
        with open(os.path.join(trace_dir, f"trace_rank{r}.json")) as f:
            data = json.load(f)
        ev.append(sorted((e for e in (data["traceEvents"] if isinstance(data, dict) else data)
                          if "ts" in e and e.get("args", {}).get("step") is not None),
                         key=lambda e: e["ts"]))

    def spans(r, cat, step, mb):
        return [e for e in ev[r] if e.get("cat") == cat and e["args"]["step"] == step
                and e["args"].get("microbatch") == mb]

    parts: Dict[str, List[float]] = collections.defaultdict(list)
    for step in range(first_step, last_step + 1):
        for k in range(m - 2):
            grad_sends = [e for e in spans(1, "transfer", step, k)
                          if e["ph"] == "X" and "value" in e["name"]]
            grad_recvs = [e for e in spans(0, "transfer", step, k)
                          if e["ph"] == "i" and "value" in e["name"]]
            if not (grad_sends and grad_recvs):
                continue
            post_v, recv_v = grad_sends[-1], grad_recvs[-1]  # (the loss's value goes first)
            # (Stage 0's step body records a span per stretch it computes: its backward's
            # first issues the requests to stage 1, then it waits for the gradient.)
            back = [e for e in spans(0, "backward", step, k) if e["ts"] >= recv_v["ts"]]
            fwd = spans(0, "forward", step, k + 2)
            if not (back and fwd):
                continue
            f_end = fwd[-1]["ts"] + fwd[-1]["dur"]
            out = next((e for e in ev[0] if e.get("cat") == "transfer" and e["ph"] == "X"
                        and "fwd_req" in e["name"] and e["ts"] >= f_end), None)
            if out is None:
                continue
            arrive = next((e for e in ev[1] if e.get("cat") == "transfer" and e["ph"] == "i"
                           and "fwd_req" in e["name"] and e["ts"] >= out["ts"]), None)
            if arrive is None:
                continue
            b_end = back[-1]["ts"] + back[-1]["dur"]
            got = [("gradient hop", recv_v["ts"] - post_v["ts"]),
                   ("to its backward", back[0]["ts"] - recv_v["ts"]),
                   ("stage 0 backward", b_end - back[0]["ts"]),
                   ("to the next forward", fwd[0]["ts"] - b_end),
                   ("stage 0 forward", f_end - fwd[0]["ts"]),
                   ("requests issued", out["ts"] - f_end),
                   ("frame posted", out["dur"]),
                   ("forward hop", arrive["ts"] - out["ts"] - out["dur"]),
                   ("loop", arrive["ts"] - post_v["ts"]),
                   ("stage 1 busy", sum(e["dur"] for c in ("forward", "backward")
                                        for e in spans(1, c, step, k)))]
            for name, us in got:
                parts[name].append(us / 1e3)
    # Means, not medians: the parts of each round add up to it, and so do their means.
    return {name: statistics.fmean(v) for name, v in parts.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--runs", type=int, default=3, help="paired runs (smshim and torch each)")
    ap.add_argument("--messages", type=int, default=300, help="raw gloo messages")
    ap.add_argument("--out", default=os.path.join(RESULTS, "pipeline_hop.json"))
    ap.add_argument("--no-loop", action="store_true",
                    help="skip the overhead-bound model's critical loop (a traced run)")
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
        print(f"    {d:9s} hop {traced_hops[d]:.3f} ms = sender {s['sender']:.3f} + post and wire "
              f"{s['wire']:.3f} + receiver {s['receiver']:.3f}")
    loop: Dict[str, float] = {}
    if not a.no_loop:
        with tempfile.TemporaryDirectory() as trace_dir:
            last = run_ranks(_loop_run, 2, 8, 6, timeout=600,
                             env={"SMSHIM_TRACE": trace_dir})[0]
            loop = _loop(trace_dir, 8, last - 2, last)
        print("  the tiny-block model as written (d = 16, batch 128, pp = 2, m = 8, interleaved), "
              "traced: stage 0 -> 1 -> 0 once per microbatch (means, ms):")
        print("    " + " + ".join(f"{name} {loop[name]:.3f}" for name in loop
                                     if name not in ("loop", "stage 1 busy"))
              + f" = loop {loop['loop']:.3f}; stage 1 computes for "
              f"{loop['stage 1 busy']:.3f} of it")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"m": a.m, "steps": a.steps, "sleeps_s": SLEEPS,
                   "gloo_ms_median": statistics.median(gloo_ms), "runs": runs,
                   "traced_hops_ms": traced_hops, "traced_split_ms": split,
                   "tiny_model_loop_ms": loop}, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
