"""Benchmark: where an overhead-bound pipeline step's CPU goes, by library, smshim against torch.

The tiny-block model of `pipeline_as_written.py` (8 blocks of width 16, pp = 2, m = 8,
`interleaved` / Schedule1F1B, batch 128, ranks pinned) runs one system at a time, alone in its
two processes; after a warm-up, Linux `perf` samples pp_rank 0 (every thread) for a few seconds
at 2 kHz while the steps go on. Each library's share of the samples, times pp_rank 0's CPU per
step (`time.process_time`), gives its milliseconds a step: CPython's interpreter
(`libpython`), torch's kernels and autograd (`libtorch_cpu`), the kernel, gloo's event loop
thread, and so on. It shows what kind of work smshim does beyond torch's own pipeline, which
profilers that trace Python calls distort (they cost more than the calls they time).

Needs `perf` on PATH and permission to attach to a process (root, or
`kernel.perf_event_paranoid` <= 1); exits saying so otherwise.

    python benchmarks/cpu_by_library.py [--seconds 4] [--runs 2] [--partitions manual stages]
    python benchmarks/cpu_by_library.py --python-calls [--partitions manual stages]
    python benchmarks/cpu_by_library.py --bytecodes [--top 30] [--partitions manual stages]

`--python-calls` counts each rank's Python function calls a step instead (a profile hook on
every thread, 10 steps): a figure that does not move with the machine's load, but not a time
(cheap calls and expensive ones count alike). `--bytecodes` counts the bytecode instructions
each rank's interpreter executes a step (a trace function on every thread, 10 steps), the
measure of `libpython`'s share above that the machine's load does not move; `--top N` lists the
N functions that execute the most, a step.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from smshim.testing import run_ranks  # noqa: E402

RESULTS = os.path.join(HERE, "results")
RATE_HZ = 1999
WARMUP_STEPS = 5


def _systems(partitions: List[str]) -> List[tuple]:
    """(name, system, smshim partition) of each run: smshim in each layout, then torch."""
    return [(f"smshim {p}", "smshim", p) for p in partitions] + [("torch", "torch", "manual")]


def _setup(system: str, partition: str):
    """This rank's pinned process, the default group (brought up by smshim's setup, which every
    system needs), `system`'s step on the tiny-block model, and its batches."""
    import torch

    import pipeline_as_written as paw

    torch.set_num_threads(1)
    paw.pin_rank_to_core()
    smp, _, step = paw._smshim_setup(2, 8, "interleaved", partition, 16)
    if system == "torch":
        import torch.distributed as dist

        step = paw._torch_setup(2, 8, "interleaved", dist.get_rank(), 16)
    return smp, step, paw.make_batches(10, 16, 128)


def _rank(system: str, partition: str, seconds: float, perf_out: str) -> Dict[str, float]:
    """One rank: warm up, then run steps while perf samples pp_rank 0's process."""
    import torch
    import torch.distributed as dist

    import pipeline_as_written as paw

    smp, step, batches = _setup(system, partition)
    rank = dist.get_rank()
    warm = []
    for i in range(WARMUP_STEPS):
        t0 = time.perf_counter()
        step(*batches[i % len(batches)])
        warm.append(time.perf_counter() - t0)
    # Enough steps to outlast perf's window by a second or more (rank 0's estimate from its last
    # warm-up steps, for both ranks).
    n = torch.tensor([int((seconds + 1.0) / min(warm[-3:])) + 1])
    dist.broadcast(n, 0)
    paw.scheduled_as_shipped(system)  # (its threads as it runs them: see pipeline_as_written.py)
    perf = None
    if rank == 0:
        perf = subprocess.Popen(["perf", "record", "-q", "-F", str(RATE_HZ), "-p", str(os.getpid()),
                                 "-o", perf_out, "--", "sleep", str(seconds)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.3)  # (perf attaches)
    times: List[float] = []
    c0 = time.process_time()
    for i in range(int(n.item())):
        t1 = time.perf_counter()
        step(*batches[i % len(batches)])
        times.append(time.perf_counter() - t1)
    cpu = (time.process_time() - c0) / len(times)
    if perf is not None:
        perf.wait()
    smp.reset()
    return {"steps": len(times), "step_ms": statistics.median(times) * 1e3,
            "cpu_ms": cpu * 1e3}


def _hooked_steps(system: str, partition: str, steps: int, counting: list, setters: tuple,
                  hook) -> None:
    """One rank: `hook` set on every thread by `setters` (threading's and sys's setprofile, or
    settrace) before the system starts its threads; the warm-up, then `steps` steps with
    `counting[0]` True."""
    import torch.distributed as dist

    for set_hook in setters:
        set_hook(hook)
    smp, step, batches = _setup(system, partition)
    for i in range(WARMUP_STEPS):
        step(*batches[i % len(batches)])
    dist.barrier()
    counting[0] = True
    for i in range(steps):
        step(*batches[i % len(batches)])
    counting[0] = False
    for set_hook in setters:
        set_hook(None)
    smp.reset()


def _python_calls(system: str, partition: str, steps: int) -> float:
    """One rank: Python function calls a step (every thread of the process), counted with a
    profile hook, over `steps` steps after warm-up."""
    import threading

    calls = [0]
    counting = [False]

    def hook(frame, event, arg):
        if counting[0] and event == "call":
            calls[0] += 1

    _hooked_steps(system, partition, steps, counting, (threading.setprofile, sys.setprofile), hook)
    return calls[0] / steps


def _bytecodes(system: str, partition: str, steps: int, top: int) -> tuple:
    """One rank: bytecode instructions executed a step (every thread of the process), and the
    `top` functions' counts a step, over `steps` steps after warm-up. Every frame is traced from
    the start (a thread's loop entered before the count began counts too), so the warm-up runs
    slowly; only the counted steps count."""
    import threading

    counts: Dict[object, int] = collections.Counter()
    counting = [False]

    def local(frame, event, arg):
        if event == "opcode" and counting[0]:
            counts[frame.f_code] += 1
        return local

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        return local

    _hooked_steps(system, partition, steps, counting, (threading.settrace, sys.settrace), trace)
    root = os.path.dirname(HERE) + os.sep
    by_function: Dict[str, float] = collections.Counter()
    for code, n in counts.items():
        where = code.co_filename.split("site-packages" + os.sep)[-1].replace(root, "")
        by_function[f"{where}:{code.co_firstlineno} {code.co_name}"] += n / steps
    return sum(counts.values()) / steps, by_function.most_common(top)


def _by_library(perf_data: str) -> Dict[str, float]:
    """Each shared object's share of the samples, in percent, and gloo's event loop thread's."""
    def report(sort: str) -> Dict[str, float]:
        out = subprocess.run(["perf", "report", "-i", perf_data, "--sort", sort, "--stdio",
                              "-g", "none"], capture_output=True, text=True, check=True).stdout
        shares: Dict[str, float] = collections.Counter()
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0].endswith("%") and not line.startswith("#"):
                shares[parts[1]] += float(parts[0][:-1])
        return shares

    shares = report("dso")
    # (A thread, not a library: its samples are in the libraries' shares too.)
    shares["(gloo's loop thread, in the above)"] = report("comm").get("gloo_tcp_loop", 0.0)
    return shares


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=4.0, help="perf's sampling time per run")
    ap.add_argument("--runs", type=int, default=2, help="runs of each system, alternated")
    ap.add_argument("--partitions", nargs="+", default=["manual"], choices=["manual", "stages"],
                    help="smshim's layouts (pipeline_as_written.py); torch runs its stages")
    ap.add_argument("--out", default=os.path.join(RESULTS, "cpu_by_library.json"))
    ap.add_argument("--python-calls", action="store_true",
                    help="instead: count each rank's Python function calls a step (no perf)")
    ap.add_argument("--bytecodes", action="store_true",
                    help="instead: count each rank's bytecode instructions a step (no perf)")
    ap.add_argument("--top", type=int, default=0,
                    help="with --bytecodes: list the functions that execute the most")
    a = ap.parse_args()
    if a.bytecodes:
        for name, system, partition in _systems(a.partitions):
            res = run_ranks(_bytecodes, 2, system, partition, 10, a.top, timeout=900)
            print(f"{name}: bytecode instructions a step, pp_rank 0 {res[0][0]:.0f}, "
                  f"pp_rank 1 {res[1][0]:.0f}", flush=True)
            for rank, (_, functions) in enumerate(res):
                for where, n in functions:
                    print(f"  pp_rank {rank} {n:9.0f}  {where}")
        return
    if a.python_calls:
        for name, system, partition in _systems(a.partitions):
            counts = run_ranks(_python_calls, 2, system, partition, 10, timeout=300)
            print(f"{name}: Python function calls a step, pp_rank 0 {counts[0]:.0f}, "
                  f"pp_rank 1 {counts[1]:.0f}", flush=True)
        return
    if shutil.which("perf") is None:
        sys.exit("cpu_by_library.py needs Linux `perf` on PATH (linux-tools / linux-perf)")

    runs: Dict[str, list] = collections.defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.runs):
            for name, system, partition in _systems(a.partitions):
                data = os.path.join(tmp, f"{r}-{name.replace(' ', '-')}.data")
                res = run_ranks(_rank, 2, system, partition, a.seconds, data, timeout=300)[0]
                if not os.path.exists(data) or os.path.getsize(data) == 0:
                    sys.exit("perf recorded nothing: it may lack the permission to attach "
                             "(run as root, or set kernel.perf_event_paranoid to 1)")
                shares = _by_library(data)
                res["ms_by_library"] = {k: v / 100 * res["cpu_ms"] for k, v in shares.items()}
                runs[name].append(res)
                print(f"{name}: {res['step_ms']:.1f} ms a step, pp_rank 0 CPU "
                      f"{res['cpu_ms']:.1f} ms a step ({res['steps']} steps)", flush=True)

    libs = sorted({k for rs in runs.values() for r in rs for k in r["ms_by_library"]},
                  key=lambda k: -statistics.mean(r["ms_by_library"].get(k, 0.0)
                                                 for r in runs["torch"] + runs[f"smshim {a.partitions[0]}"]))
    names = list(runs)
    print(f"\npp_rank 0's CPU a step by library, ms (median of {a.runs} runs; each system alone, "
          "pinned, tiny blocks, pp 2, m 8, interleaved / 1F1B):")
    print(f"{'library':<34}" + "".join(f"{n:>16}" for n in names))
    for lib in ["(all)"] + libs[:10]:
        cells = []
        for n in names:
            vals = [r["cpu_ms"] if lib == "(all)" else r["ms_by_library"].get(lib, 0.0)
                    for r in runs[n]]
            cells.append(f"{statistics.median(vals):16.2f}")
        print(f"{lib[:34]:<34}" + "".join(cells))
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"rate_hz": RATE_HZ, "seconds": a.seconds, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
