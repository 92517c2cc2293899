"""Benchmark: raw gloo one-way latency on this machine, the floor under every pipeline hop.

Rank 0 sends a 4 KiB tensor (`isend`, then waits) every `--gap-ms`, stamped with
`time.monotonic()` (one clock for all processes on a host); rank 1 receives it (`recv`, in the
main thread or in a second thread, as smshim's receivers do) and takes the difference. The other
ranks of `--procs` sit in a barrier, as idle pipeline stages would. Prints the median and 90th
percentile; the sleep-stage benchmark (`pipeline_schedules.py`) pays two such transfers per
microbatch on 1F1B's critical path, plus whatever each side adds around them.

`--both-ways`: ranks 0 and 1 each send a 64 KiB tensor to the other at the same moment, every
`--gap-ms` (each receiving in a second thread), as two pipeline stages under 1F1B do once per
microbatch (one's activation, the other's gradient): on one gloo group, and on two (one per
direction, as smshim's transport does). Prints the median latency and how many transfers took
over 1.5 ms.

    python benchmarks/gloo_latency.py [--procs 2 4] [--messages 300] [--gap-ms 20] [--both-ways]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from smshim.testing import run_ranks  # noqa: E402


def _one_way(messages: int, gap_s: float, in_thread: bool):
    import numpy as np
    import torch
    import torch.distributed as dist

    from smshim.runtime import launch as _runtime

    torch.set_num_threads(1)
    _runtime.init_distributed()
    rank = dist.get_rank()
    group = dist.new_group([0, 1], backend="gloo")
    latencies = []
    if rank == 0:
        for _ in range(messages):
            time.sleep(gap_s)
            x = torch.empty(4096, dtype=torch.uint8)
            x[:8] = torch.from_numpy(np.array([time.monotonic()]).view(np.uint8))
            dist.isend(x, 1, group=group).wait()
    elif rank == 1:
        buf = torch.empty(4096, dtype=torch.uint8)

        def receive():
            for _ in range(messages):
                dist.recv(buf, 0, group=group)
                now = time.monotonic()
                latencies.append(now - float(buf[:8].numpy().view(np.float64)[0]))

        if in_thread:
            t = threading.Thread(target=receive)
            t.start()
            t.join()
        else:
            receive()
    dist.barrier()
    return latencies[messages // 10:]  # without the first tenth (warm-up)


def _both_ways(messages: int, gap_s: float, per_direction: bool):
    import numpy as np
    import torch
    import torch.distributed as dist

    from smshim.runtime import launch as _runtime

    torch.set_num_threads(1)
    _runtime.init_distributed()
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1], backend="gloo") for _ in range(2)]
    # Rank 0's frames on groups[0]; rank 1's on groups[per_direction].
    send_group = groups[rank if per_direction else 0]
    recv_group = groups[1 - rank if per_direction else 0]
    peer = 1 - rank
    latencies = []

    def receive():
        buf = torch.empty(1 << 18, dtype=torch.uint8)  # smshim's frame buffer
        for _ in range(messages):
            recv_group.recv([buf], peer, 0).wait()
            latencies.append(time.monotonic() - float(buf[:8].numpy().view(np.float64)[0]))

    receiver = threading.Thread(target=receive)
    receiver.start()
    x = torch.empty(1 << 16, dtype=torch.uint8)
    # Both ranks send at the same moments (one clock for all processes on a host).
    start = float(_broadcast_time(time.monotonic() + 0.1))
    pending = []
    for i in range(messages):
        time.sleep(max(0.0, start + i * gap_s - time.monotonic()))
        x[:8] = torch.from_numpy(np.array([time.monotonic()]).view(np.uint8))
        pending.append(send_group.send([x], peer, 0))
        if len(pending) > 4:
            pending.pop(0).wait()
    for work in pending:
        work.wait()
    receiver.join()
    return latencies[messages // 10:]


def _broadcast_time(t: float) -> float:
    import torch
    import torch.distributed as dist

    v = torch.tensor([t], dtype=torch.float64)
    dist.broadcast(v, 0)
    return float(v[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--messages", type=int, default=300)
    ap.add_argument("--gap-ms", type=float, default=20.0)
    ap.add_argument("--both-ways", action="store_true",
                    help="two ranks sending to each other at once, on one group and on two")
    a = ap.parse_args()
    if a.both_ways:
        print(f"gloo one-way latency, 64 KiB both ways at once every {a.gap_ms:.0f} ms, "
              f"{a.messages} messages each way")
        for per_direction in (False, True):
            res = run_ranks(_both_ways, 2, a.messages, a.gap_ms / 1000, per_direction,
                            timeout=60 + a.messages * a.gap_ms / 500)
            ms = sorted(x * 1e3 for lat in res for x in lat)
            slow = sum(x > 1.5 for x in ms)
            how = "one group per direction" if per_direction else "one group"
            print(f"  {how}: median {statistics.median(ms):.3f} ms, p90 "
                  f"{ms[int(len(ms) * 0.9)]:.3f} ms, over 1.5 ms: {slow} of {len(ms)} "
                  f"({100 * slow / len(ms):.0f} %), max {ms[-1]:.1f} ms")
        return
    print(f"gloo one-way latency, 4 KiB every {a.gap_ms:.0f} ms, {a.messages} messages")
    for procs in a.procs:
        for in_thread in (False, True):
            lat = run_ranks(_one_way, procs, a.messages, a.gap_ms / 1000, in_thread,
                            timeout=60 + a.messages * a.gap_ms / 500)[1]
            ms = sorted(x * 1e3 for x in lat)
            where = "a second thread" if in_thread else "the main thread"
            print(f"  {procs} processes, received in {where}: median {statistics.median(ms):.3f}"
                  f" ms, p90 {ms[int(len(ms) * 0.9)]:.3f} ms")


if __name__ == "__main__":
    main()
