"""Benchmark: activation checkpointing on the GPT main job's model, pp=2 (2 processes, gloo, one
thread each), with and without `smp.set_activation_checkpointing` on every transformer block.

Memory: per rank, the peak resident set size over the measured steps minus the resident set
size when they start (Linux: writing 5 to /proc/self/clear_refs resets VmHWM, the peak, to the
current size; /proc/self/status then gives the peak). The model, optimizer state and allocator
caches are in place before the measurement starts (warm-up steps), so the difference is what the
steps themselves add at their peak: mostly activations kept for backward. Each configuration
runs in fresh processes (a freed heap does not shrink back, so one process cannot measure both).
Time: median step time (the slowest rank's), measured steps only. Configurations alternate,
`--rounds` times each, and medians over rounds are reported, so both see the same machine load.
The two configurations also have to give the same losses (they compute the same thing).

    python benchmarks/activation_checkpointing.py [--steps 6] [--rounds 2] [--context 256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
from smshim.testing import run_ranks  # noqa: E402

RESULTS = os.path.join(HERE, "results")


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _fixed_mmap_threshold() -> None:
    """glibc raises its mmap threshold as big blocks are freed, after which activations come
    from the heap and freeing them no longer lowers RSS; a fixed 64 KB threshold keeps every
    tensor-sized block mmapped, so RSS follows what is really held."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    except OSError:
        pass


def job(ckpt: bool, args: Dict[str, Any]) -> Dict[str, Any]:
    import smdistributed.modelparallel.torch as smp
    from gpt_pipeline import GPT

    _fixed_mmap_threshold()
    smp.init({"pipeline_parallel_degree": 2, "microbatches": args["microbatches"],
              "pipeline": "interleaved"})
    torch.manual_seed(0)
    module = GPT(256, args["context"], args["d_model"], args["heads"], args["layers"])
    if ckpt:
        for block in module.blocks:
            smp.set_activation_checkpointing(block)
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))

    @smp.step
    def train_step(model, idx, targets):
        logits = model(idx)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 256, (args["batch"], args["context"] + 1), generator=g)
            for _ in range(args["warmup"] + args["steps"])]
    times, losses = [], []
    start_rss = peak = 0
    for i, seq in enumerate(data):
        if i == args["warmup"]:
            smp.barrier()
            start_rss = _rss_kb("VmRSS")
            _reset_peak()
        smp.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        out = train_step(model, seq[:, :-1], seq[:, 1:])
        opt.step()
        dt = time.perf_counter() - t0
        if i >= args["warmup"]:
            times.append(dt)
        losses.append(out.reduce_mean().item())
    peak = _rss_kb("VmHWM")
    return {"pp_rank": smp.pp_rank(), "times": times, "losses": losses,
            "start_rss_kb": start_rss, "peak_rss_kb": peak, "added_kb": peak - start_rss,
            "params": sum(p.numel() for p in model.local_parameters())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    a = p.parse_args()
    args = {"steps": a.steps, "warmup": a.warmup, "batch": a.batch, "microbatches": a.microbatches,
            "context": a.context, "d_model": a.d_model, "heads": a.heads, "layers": a.layers}
    runs: Dict[bool, List[List[Dict[str, Any]]]] = {False: [], True: []}
    for _ in range(a.rounds):
        for ckpt in (False, True):
            runs[ckpt].append(run_ranks(job, 2, ckpt, args, timeout=900))
    base_losses = runs[False][0][0]["losses"]
    for rs in runs[True] + runs[False]:
        for got, want in zip(rs[0]["losses"], base_losses):
            assert abs(got - want) <= 1e-4 * abs(want), (got, want)

    def summary(ckpt: bool) -> Dict[str, Any]:
        per_rank = {}
        for r in (0, 1):
            per_rank[r] = {
                "added_peak_mb": statistics.median(rs[r]["added_kb"] for rs in runs[ckpt]) / 1024,
                "peak_rss_mb": statistics.median(rs[r]["peak_rss_kb"] for rs in runs[ckpt]) / 1024,
            }
        step = statistics.median(statistics.median(max(x) for x in zip(rs[0]["times"],
                                                                         rs[1]["times"]))
                                 for rs in runs[ckpt])
        return {"per_rank": per_rank, "step_s": step}

    off, on = summary(False), summary(True)
    result = {"args": args, "rounds": a.rounds, "without": off, "with": on,
              "step_time_ratio": on["step_s"] / off["step_s"],
              "added_peak_ratio": {r: on["per_rank"][r]["added_peak_mb"]
                                   / max(off["per_rank"][r]["added_peak_mb"], 1e-9)
                                   for r in (0, 1)}}
    print(f"GPT d={a.d_model} layers={a.layers} context={a.context} batch={a.batch} "
          f"microbatches={a.microbatches}, pp=2, {a.rounds} round(s) x {a.steps} steps")
    for r in (0, 1):
        before, after = off["per_rank"][r], on["per_rank"][r]
        print(f"  pp rank {r}: peak RSS added by the steps {before['added_peak_mb']:.1f} MB -> "
              f"{after['added_peak_mb']:.1f} MB with checkpointing "
              f"(x{result['added_peak_ratio'][r]:.2f}); process peak RSS "
              f"{before['peak_rss_mb']:.0f} -> {after['peak_rss_mb']:.0f} MB")
    print(f"  step time {off['step_s'] * 1e3:.0f} ms -> {on['step_s'] * 1e3:.0f} ms "
          f"(x{result['step_time_ratio']:.2f})")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "activation_checkpointing.json"), "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
