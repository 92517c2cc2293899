"""Benchmark: what the same Python work costs right after its thread idled, on this machine.

A latency-bound pipeline stage (the sleep stages of `pipeline_schedules.py`, or a host thread
waiting for a GPU) idles between its pieces of work, and whatever runs when it wakes (a hop's
bookkeeping, the post of a result) runs on a core whose caches, and here the VM's virtual CPU,
went cold meanwhile. This measures that: one thread builds the frame of one VALUE message (the
smallest thing a stage posts after its compute: a pickled header and the tensor's bytes, as
`Transport._post_frame` assembles them, without the gloo send) once after sleeping `gap` ms, and
reports the median CPU time it took (`time.thread_time_ns`) for each gap; gap 0 is the same work
done back to back, hot. One process, one thread; nothing else runs.

`--poll-idle` (root): hold the kernel's CPU latency request at 0 (`/dev/cpu_dma_latency`) while
it runs, so that an idle CPU polls instead of halting: measures the same with warm wakes, and,
given a command after `--`, runs that command under the setting instead (e.g. the sleep-stage
benchmark, to see what the cold wakes cost it: docs/benchmarks.md).

    python benchmarks/idle_cpu_cost.py [--gaps-ms 0 1 5 20 40] [--repeats 300] [--poll-idle]
    python benchmarks/idle_cpu_cost.py --poll-idle -- python benchmarks/pipeline_schedules.py --m 8
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import struct
import subprocess
import sys
import time
from typing import Dict, List

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from smshim.modelparallel.torch.pipeline.frames import _DTYPE_CODE, _PREFIX, _as_bytes  # noqa: E402

RESULTS = os.path.join(HERE, "results")


def _frame(value: torch.Tensor) -> np.ndarray:
    """A one-VALUE frame, assembled as the transport does (prefix, pickled header, bytes)."""
    arr = _as_bytes(value)
    header = pickle.dumps([("value", 3, 1, -1, None, (0, 7, "igrad", 0),
                            [(tuple(value.shape), _DTYPE_CODE[value.dtype], arr.size)])],
                          protocol=pickle.HIGHEST_PROTOCOL)
    end = _PREFIX + len(header)
    nf = np.empty(end + arr.size, dtype=np.uint8)
    nf[_PREFIX:end] = np.frombuffer(header, dtype=np.uint8)
    nf[end:] = arr
    nf[:_PREFIX] = np.array([len(header), arr.size], dtype=np.int64).view(np.uint8)
    torch.from_numpy(nf)
    return nf


def measure(gaps_ms: List[float], repeats: int) -> Dict[str, float]:
    torch.set_num_threads(1)
    value = torch.ones(1, 4)
    out: Dict[str, float] = {}
    for gap in gaps_ms:
        cpu_us = []
        for _ in range(repeats):
            if gap:
                time.sleep(gap / 1e3)
            c0 = time.thread_time_ns()
            _frame(value)
            cpu_us.append((time.thread_time_ns() - c0) / 1e3)
        out[str(gap)] = statistics.median(cpu_us[repeats // 10:])
    return out


def _poll_idle() -> int:
    """Ask the kernel for zero CPU wake-up latency while the returned descriptor is open."""
    try:
        fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
    except OSError as e:
        sys.exit(f"--poll-idle needs to write /dev/cpu_dma_latency (root, Linux): {e}")
    os.write(fd, struct.pack("i", 0))
    return fd


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gaps-ms", type=float, nargs="+", default=[0, 1, 5, 20, 40])
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--poll-idle", action="store_true",
                    help="idle CPUs poll instead of halting while this runs (root)")
    ap.add_argument("--out", default=None,
                    help="default: results/idle_cpu_cost[_poll].json")
    ap.add_argument("command", nargs=argparse.REMAINDER,
                    help="after --: run this instead of measuring (with --poll-idle)")
    args = ap.parse_args()
    fd = _poll_idle() if args.poll_idle else None
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if command:
        sys.exit(subprocess.run(command).returncode)  # (the setting ends with this process)
    res = measure(args.gaps_ms, args.repeats)
    if fd is not None:
        os.close(fd)
    if args.out is None:
        args.out = os.path.join(RESULTS, f"idle_cpu_cost{'_poll' if args.poll_idle else ''}.json")
    hot = res[str(args.gaps_ms[0])]
    print("one VALUE frame assembled (header pickled, bytes copied) right after the thread "
          f"slept, CPU time, median of {args.repeats}"
          f"{' (idle CPUs poll)' if args.poll_idle else ''}:")
    for gap, us in res.items():
        print(f"  after {float(gap):5.1f} ms idle: {us:6.2f} us  ({us / hot:.2f}x the first)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"cpu_us_per_frame_by_idle_ms": res, "repeats": args.repeats,
                   "poll_idle": args.poll_idle}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
