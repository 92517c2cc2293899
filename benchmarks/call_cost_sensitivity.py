"""Benchmark: what a microsecond of work per module call costs the overhead-bound pipeline step.

The tiny-block model of `pipeline_as_written.py` (8 blocks of width 16 in a `ModuleList` loop,
batch 128, pp = 2, m = 8, `interleaved` / Schedule1F1B, ranks pinned, the systems in turns of 10
steps) runs three ways, rotated run by run: as shipped; with `--us` microseconds of busy CPU
added to every call pp_rank 0 makes to a module on another rank (the caller's side of a call,
`CallerSide.call`); and with as many added to every call its owner serves (the owner's side,
`OwnerSide._forward_call`). The model as written makes 40 such calls a step. The rise of
smshim / torch per added microsecond says how much shorter either side of a call would have to
get to bring the ratio down by a given amount (the response is taken as linear: each variant
adds the same work to every step).

    python benchmarks/call_cost_sensitivity.py [--us 50] [--runs 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import pipeline_as_written as paw  # noqa: E402
from smshim.testing import run_ranks  # noqa: E402

RESULTS = os.path.join(HERE, "results")
VARIANTS = ("as shipped", "caller side", "owner side")
P, M, D, BATCH, STEPS, WARMUP, BLOCK = 2, 8, 16, 128, 30, 2, 10


def _spin(seconds: float) -> None:
    """Busy CPU, holding the GIL as the interpreter's own work does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _slowed(method, seconds: float):
    """`method` with `seconds` of busy CPU before it."""
    def slower(self, *args, **kwargs):
        _spin(seconds)
        return method(self, *args, **kwargs)

    return slower


def _added(variant: str, us: float) -> None:
    """Add `us` of work to every call on the side that `variant` names (in this process)."""
    from smshim.modelparallel.torch.pipeline.calls import CallerSide
    from smshim.modelparallel.torch.pipeline.serving import OwnerSide

    if variant == "caller side":
        CallerSide.call = _slowed(CallerSide.call, us * 1e-6)
    elif variant == "owner side":
        OwnerSide._forward_call = _slowed(OwnerSide._forward_call, us * 1e-6)


def _run(variant: str, us: float):
    _added(variant, us)
    return paw._compare(P, M, "interleaved", "manual", WARMUP, STEPS, D, BATCH, pin=True,
                        block=BLOCK)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--us", type=float, default=50.0, help="work added to each call (µs)")
    ap.add_argument("--runs", type=int, default=10, help="runs of each variant")
    ap.add_argument("--out", default=os.path.join(RESULTS, "call_cost_sensitivity.json"))
    a = ap.parse_args()

    ratios: Dict[str, List[float]] = {v: [] for v in VARIANTS}
    cpu: Dict[str, List[List[float]]] = {v: [] for v in VARIANTS}
    for i in range(a.runs):
        for k in range(len(VARIANTS)):
            variant = VARIANTS[(i + k) % len(VARIANTS)]  # (the first variant rotates)
            row = paw._summarise(run_ranks(_run, P, variant, a.us, timeout=900),
                                 P, M, "interleaved", "manual")
            ratios[variant].append(row["smshim_vs_torch"])
            cpu[variant].append(row["cpu_by_rank_s"]["smshim"])
        print(f"run {i + 1}: " + ", ".join(f"{v} {ratios[v][-1]:.3f}" for v in VARIANTS),
              flush=True)

    base = statistics.median(ratios["as shipped"])
    summary = {}
    print(f"\nsmshim / torch, tiny blocks (d {D}, batch {BATCH}, pp {P}, m {M}, 40 remote calls a "
          f"step), {a.runs} runs each, {a.us:g} µs added to each call:")
    for v in VARIANTS:
        med = statistics.median(ratios[v])
        q = statistics.quantiles(ratios[v], n=4) if len(ratios[v]) > 1 else [med, med, med]
        ranks = [statistics.median(c[r] for c in cpu[v]) * 1e3 for r in range(P)]
        slope = None if v == "as shipped" else (med - base) / a.us
        summary[v] = {"median": med, "quartiles": q, "cpu_ms_by_rank": ranks,
                      "per_us": slope, "ratios": ratios[v]}
        print(f"  {v:<12} median {med:.3f} (quartiles {q[0]:.3f} / {q[2]:.3f}), CPU a step "
              f"pp_rank 0 {ranks[0]:.1f} ms, pp_rank 1 {ranks[1]:.1f} ms"
              + ("" if slope is None else f"; {slope:+.4f} a µs a call"))
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"us": a.us, "runs": a.runs, "d": D, "batch": BATCH, "p": P, "m": M,
                   "variants": summary}, f, indent=1)


if __name__ == "__main__":
    main()
