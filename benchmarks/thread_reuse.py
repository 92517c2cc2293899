"""What a fresh thread costs the compute it runs: one training pass (forward and backward) over
the second half of the small GPT of `pipeline_transformer.py` (two blocks, final LayerNorm, LM
head) on one microbatch, run in the main thread, in one long-lived second thread, and in a new
thread each time, as pp_rank 0 ran its step bodies before they went to long-lived workers
(`smshim/modelparallel/torch/workers.py`). CPU time of the running thread, medians of rounds.

    python benchmarks/thread_reuse.py [--passes 50] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import pipeline_transformer as pt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--passes", type=int, default=50, help="passes per round")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = pt.make_model()
    layers = list(model.blocks[len(model.blocks) // 2:])
    x = torch.randn(2, pt.MODEL["seq"], pt.MODEL["d"])  # batch 16 in 8 microbatches
    targets = torch.randint(0, pt.MODEL["vocab"], (2, pt.MODEL["seq"]))

    def one_pass() -> float:
        c0 = time.thread_time()
        h = x.requires_grad_()
        for layer in layers:
            h = layer(h)
        model.head(h, targets).backward()
        return time.thread_time() - c0

    def in_thread(fn):
        out = []
        t = threading.Thread(target=lambda: out.append(fn()))
        t.start()
        t.join()
        return out[0]

    ways = {
        "main thread": lambda: sum(one_pass() for _ in range(args.passes)),
        "one long-lived thread": lambda: in_thread(
            lambda: sum(one_pass() for _ in range(args.passes))),
        "a new thread per pass": lambda: sum(in_thread(one_pass) for _ in range(args.passes)),
    }
    ways["main thread"]()  # warm-up
    ms = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():
            ms[name].append(way() / args.passes * 1e3)
    base = statistics.median(ms["main thread"])
    print(f"{'ran in':24s} {'CPU ms per pass':>16s} {'/ main thread':>14s}")
    for name, values in ms.items():
        med = statistics.median(values)
        print(f"{name:24s} {med:16.2f} {med / base:14.3f}")


if __name__ == "__main__":
    main()
