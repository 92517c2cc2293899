"""Benchmark: where pp_rank 0's and pp_rank 1's threads spend a step, by role.

`pipeline_schedules.py`'s sleep stages (smshim only, `interleaved`), then for each of the first
two ranks and each kind of thread (step bodies, receivers, the sender thread, the main thread,
torch's and gloo's own, "?"), per step: CPU time, time runnable but waiting for a core, and
how many times the threads were scheduled in (mostly wakes). From the kernel's
`/proc/self/task/*/schedstat` before and after the measured steps.

    python benchmarks/pipeline_threads.py [--p 8] [--m 32] [--tf-ms 10] [--steps 4]

2026-12-07, p = 8, m = 32, tf = 10 ms (8 processes on 2 cores), pp_rank 0 per 1.3 s step, two
runs each: with a sender thread per peer (7, each waking every 5 ms while holds came), those
threads took 76-88 ms of CPU, 307-345 ms waiting for a core and ~2,900 wakes; with one sender
thread for all peers (sender.py), 36-38 ms, 42-66 ms and 328-338. With held messages' deadline
at 50 ms instead of 5 (transport.py, `HOLD_S`; 2026-12-07 night): 5.3-6.1 ms, 12-18 ms and 86-93
(p = 8); 2.4-2.7 ms and 22-26 wakes against 5.9 and 133 at p = 4 (`--p 4 --m 8 --tf-ms 20`).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time
from typing import Dict, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import pipeline_schedules as ps  # noqa: E402
from smshim.testing import run_ranks  # noqa: E402


def _threads() -> Dict[int, Tuple[str, int, int, int]]:
    """Each thread of this process: (its Python name, or "?"; ns on CPU, ns waiting for a core,
    times scheduled in)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, wait, slices = map(int, f.read().split())
        except (OSError, ValueError):  # (a thread that ended meanwhile)
            continue
        out[int(tid)] = (names.get(int(tid), "?"), run, wait, slices)
    return out


def _role(name: str) -> str:
    """smp-body-0_3 -> smp-body, smp-recv-1_2 -> smp-recv, smp-send-0 -> smp-send."""
    return "-".join(name.split("_")[0].split("-")[:2]) if name.startswith("smp-") else name


def _rank(p: int, m: int, tf: float, steps: int):
    cfg = {"pipeline_parallel_degree": p, "microbatches": m, "pipeline": "interleaved",
           "auto_partition": False, "default_partition": 0}
    model, train_step = ps.stage_per_rank(cfg, lambda: ps.SleepPipe(p, tf, False))
    x = ps._inputs(m, False)
    train_step(model, x)  # (warm-up)
    before, t0 = _threads(), time.perf_counter()
    for _ in range(steps):
        train_step(model, x)
    step_s, after = (time.perf_counter() - t0) / steps, _threads()
    roles = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for tid, (name, run, wait, slices) in after.items():
        _, run0, wait0, slices0 = before.get(tid, (name, 0, 0, 0))
        r = roles[_role(name)]
        r[0] += 1
        r[1] += (run - run0) / 1e6 / steps
        r[2] += (wait - wait0) / 1e6 / steps
        r[3] += (slices - slices0) / steps
    return step_s, dict(roles)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--p", type=int, default=8)
    ap.add_argument("--m", type=int, default=32)
    ap.add_argument("--tf-ms", type=float, default=10.0)
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    results = run_ranks(_rank, a.p, a.p, a.m, a.tf_ms / 1000, a.steps, timeout=600)
    for pp_rank, (step_s, roles) in enumerate(results[:2]):
        print(f"pp_rank {pp_rank}: {step_s * 1e3:.0f} ms a step; per step, by kind of thread:")
        for role, (n, cpu, wait, slices) in sorted(roles.items(), key=lambda kv: -kv[1][1]):
            print(f"  {role:12s} {n:3d} threads  CPU {cpu:7.1f} ms  waiting for a core "
                  f"{wait:7.1f} ms  scheduled in {slices:6.0f} times")


if __name__ == "__main__":
    main()
