"""Where each rank's CPU goes in a pipeline step: smshim's parts against torch's stages.

The overhead-bound model of `pipeline_as_written.py` (8 pre-LN residual blocks of width d in a
`ModuleList` loop, a linear head computing the loss; pp = 2, the first four blocks on pp_rank 0,
`interleaved` against `Schedule1F1B`), both systems alternated step by step in the same two
processes, each pinned to a core of its own. Each rank reports its process CPU per step (median)
and the thread CPU per step spent inside a few functions of each system, summed over the
measured steps and divided by their number:

- smshim, pp_rank 0: the step body's forward (the root module's code and its own modules), of
  which the calls to modules on pp_rank 1; its backward (`model.backward`), of which the calls'
  backward nodes and the frames posted when the body waits;
- smshim, every rank: frames posted and received (each a gloo send or receive with its headers);
  pp_rank 1: the requests it served (module forwards and backwards with their bookkeeping);
- torch: its stages' `forward_one_chunk` and `backward_one_chunk`.

Nested rows are parts of the row above them. What a row leaves out (the step's set-up, threads
waking, the optimizer) is the difference to the process CPU.

    python benchmarks/pipeline_phases.py [--steps 60] [--d 16] [--m 8] [--batch 128]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from typing import Callable, Dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from smshim.testing import run_ranks  # noqa: E402

# (label, module, class, function): the functions timed, in the order printed.
_PARTS = [
    ("smshim: forward body", "smshim.modelparallel.torch.model", "DistributedModel", "forward"),
    ("  calls to pp_rank 1", "smshim.modelparallel.torch.pipeline.calls", "CallerSide", "call"),
    ("smshim: backward body", "smshim.modelparallel.torch.pipeline.pipeline", "Pipeline",
     "backward"),
    ("  the calls' backward nodes", "smshim.modelparallel.torch.pipeline.calls", "CallerSide",
     "_backward"),
    ("    frames posted before a wait", "smshim.modelparallel.torch.pipeline.calls",
     "CallerSide", "_before_wait"),
    ("smshim: requests served", "smshim.modelparallel.torch.pipeline.serving", "OwnerSide",
     "_serve_one"),
    ("smshim: frames posted", "smshim.modelparallel.torch.pipeline.transport", "Transport",
     "_post_frame"),
    ("smshim: frames received", "smshim.modelparallel.torch.pipeline.transport", "Transport",
     "_recv_frame"),
    ("torch: forward chunks", "torch.distributed.pipelining.stage", "_PipelineStageBase",
     "forward_one_chunk"),
    ("torch: backward chunks", "torch.distributed.pipelining.stage", "_PipelineStageBase",
     "backward_one_chunk"),
]


def _timed(acc: Dict[str, int], label: str, fn: Callable) -> Callable:
    def timed(*args, **kwargs):
        t0 = time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[label] += time.thread_time_ns() - t0
    return timed


def _measure(steps: int, d: int, m: int, batch: int, warmup: int = 5) -> dict:
    import importlib

    import torch
    import torch.distributed as dist

    import pipeline_as_written as written

    written.pin_rank_to_core()
    torch.set_num_threads(1)
    acc: Dict[str, int] = collections.Counter()
    for label, module, cls, name in _PARTS:
        owner = getattr(importlib.import_module(module), cls)
        setattr(owner, name, _timed(acc, label, getattr(owner, name)))
    smp, _, ours = written._smshim_setup(2, m, "interleaved", "manual", d)
    theirs = written._torch_setup(2, m, "interleaved", dist.get_rank(), d)
    cpu: Dict[str, list] = {"smshim": [], "torch": []}
    for i, (x, targets) in enumerate(written.make_batches(warmup + steps, d, batch)):
        if i == warmup:
            acc.clear()
        for name, step in (("smshim", ours), ("torch", theirs)):
            dist.barrier()
            c0 = time.process_time()
            step(x, targets)
            if i >= warmup:
                cpu[name].append(time.process_time() - c0)
    smp.reset()
    return {"rank": dist.get_rank(),
            "cpu_ms": {k: statistics.median(v) * 1e3 for k, v in cpu.items()},
            "parts_ms": {k: v / steps / 1e6 for k, v in acc.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--d", type=int, default=16)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--batch", type=int, default=128)
    a = ap.parse_args()
    results = run_ranks(_measure, 2, a.steps, a.d, a.m, a.batch, timeout=1800)
    print(f"CPU a step by rank (ms): pp = 2, m = {a.m}, d = {a.d}, batch {a.batch}, "
          f"{a.steps} steps of each system alternated")
    for r in sorted(results, key=lambda r: r["rank"]):
        print(f"rank {r['rank']}: process CPU smshim {r['cpu_ms']['smshim']:.1f}, "
              f"torch {r['cpu_ms']['torch']:.1f} (medians)")
        for label, *_ in _PARTS:
            if label in r["parts_ms"]:
                print(f"  {label:34s} {r['parts_ms'][label]:6.2f}")


if __name__ == "__main__":
    main()
