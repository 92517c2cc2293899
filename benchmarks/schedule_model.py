"""A model of the sleep stages' pipeline: what a step costs for given hop and turn latencies.

`pipeline_schedules.py` runs p sleep stages (forward tf, backward tb = 2 tf) through smshim's
`interleaved` schedule and torch's Schedule1F1B. Both keep at most p - r microbatches live on
stage r, and both run a backward first when one is ready: under that cap the order of work is
the same, and the step differs only by how long each transition takes. This simulates that
schedule with fixed latencies (a forward hop from stage r to r + 1, a backward hop back, a
stage's turn from one piece of its work to a forward or to a backward, and the last stage's
turn from a microbatch's forward to its backward) and prints:

- how the step grows with each latency (ms of step per ms of it, around the given point):
  how many of each lie on the critical path;
- with `--gaps FILE` (the JSON of `pipeline_schedules.py --gaps`; its `interleaved` rows of
  this p), the step each system's measured mean gaps give, next to its measured step: the
  share of the difference between the two systems that the transitions inside the pipeline
  explain (each row with its own m and tf). The model leaves out the step's head and tail, and
  takes every transition of a kind as its mean: at p = 4 its steps come out 6-12 ms below the
  measured ones.

    python benchmarks/schedule_model.py [--p 4] [--m 8] [--tf-ms 20]
    python benchmarks/schedule_model.py --gaps benchmarks/results/pipeline_schedules_gaps.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Dict, List, Optional

_EPS = 1e-9  # times are sums of the same latencies in different orders: compare with slack


@dataclasses.dataclass(frozen=True)
class Latencies:
    """Milliseconds each transition takes (`pipeline_schedules.py --gaps`' kinds)."""

    hop_f: float = 0.0  # a forward's end on stage r to the next forward's start on r + 1
    hop_b: float = 0.0  # a backward's end on stage r + 1 to the backward's start on r
    turn_f: float = 0.0  # a stage's previous work's end to its next forward's start
    turn_b: float = 0.0  # ... to its next backward's start
    last_f_to_b: float = 0.0  # the last stage, from a microbatch's forward to its backward


def step_ms(p: int, m: int, tf: float, tb: float, lat: Latencies) -> float:
    """The step's length (first start to last end) of the schedule described above."""
    f_end: Dict[tuple, float] = {}  # (stage, microbatch) -> end of its forward
    b_end: Dict[tuple, float] = {}
    free_at = [0.0] * p  # when each stage's current work ends
    # The next forward and backward of each stage (each in microbatch order): next_f - next_b
    # microbatches are live, and a stage's first work is its first forward.
    next_f = [0] * p
    next_b = [0] * p
    t = 0.0
    while any(b < m for b in next_b):
        for r in range(p):
            if free_at[r] > t + _EPS:
                continue
            op = _ready(r, p, m, t, lat, f_end, b_end, free_at, next_f, next_b)
            if op is None:
                continue
            kind, j = op
            if kind == "B":
                next_b[r] += 1
                free_at[r] = b_end[(r, j)] = t + tb
            else:
                next_f[r] += 1
                free_at[r] = f_end[(r, j)] = t + tf
        t = _next_event(t, lat, f_end, b_end, free_at)
    return max(free_at)


def _ready(r, p, m, t, lat, f_end, b_end, free_at, next_f, next_b):
    """The work stage r can start at time t (a backward first), or None."""
    j = next_b[r]
    if j < m and (r, j) in f_end:
        if r == p - 1:
            # (Its previous work is this microbatch's forward: one transition, not two.)
            ready = f_end[(r, j)] + lat.last_f_to_b
            if free_at[r] != f_end[(r, j)]:
                ready = max(ready, _after_turn(r, lat.turn_b, free_at, next_f))
        elif (r + 1, j) in b_end:
            ready = max(b_end[(r + 1, j)] + lat.hop_b, _after_turn(r, lat.turn_b, free_at, next_f))
        else:
            ready = None
        if ready is not None and ready <= t + _EPS:
            return "B", j
    j = next_f[r]
    if j < m and next_f[r] - next_b[r] < p - r:
        if r == 0:
            ready = 0.0
        else:
            ready = f_end[(r - 1, j)] + lat.hop_f if (r - 1, j) in f_end else None
        if ready is not None and max(ready, _after_turn(r, lat.turn_f, free_at, next_f)) <= t + _EPS:
            return "F", j
    return None


def _after_turn(r: int, turn: float, free_at: List[float], next_f: List[int]) -> float:
    """When stage r's turn after its previous work ends; 0 before its first work (a forward)."""
    return free_at[r] + turn if next_f[r] else 0.0


def _next_event(t, lat, f_end, b_end, free_at) -> float:
    """The earliest moment after t at which some stage may become able to start work."""
    delays = (0.0, lat.hop_f, lat.hop_b, lat.turn_f, lat.turn_b, lat.last_f_to_b)
    times = [x + d for x in list(f_end.values()) + list(b_end.values()) + free_at
             for d in delays]
    return min(x for x in times if x > t + _EPS)


def sensitivities(p: int, m: int, tf: float, tb: float, at: Latencies,
                  delta: float = 0.1) -> Dict[str, float]:
    """ms of step per ms of each latency, by a finite difference above `at`."""
    base = step_ms(p, m, tf, tb, at)
    out = {}
    for field in dataclasses.fields(Latencies):
        name = field.name
        bumped = dataclasses.replace(at, **{name: getattr(at, name) + delta})
        out[name] = (step_ms(p, m, tf, tb, bumped) - base) / delta
    return out


def from_gaps(gaps: Dict[str, list]) -> Latencies:
    """Mean latencies from one system's `gaps_ms_and_count` ({kind: [ms a step, count]})."""
    def mean(kind: str) -> float:
        total, count = gaps.get(kind, (0.0, 0))
        return total / count if count else 0.0
    return Latencies(mean("hop F"), mean("hop B"), mean("turn to F"), mean("turn to B"),
                     mean("last F to B"))


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--tf-ms", type=float, default=20.0)
    ap.add_argument("--gaps", default=None,
                    help="a pipeline_schedules.py --gaps JSON: model each system's step")
    a = ap.parse_args(argv)
    p, m, tf = a.p, a.m, a.tf_ms
    print(f"sleep stages p={p}, m={m}, tf={tf:g} ms, tb={2 * tf:g} ms: theory "
          f"{(m + p - 1) * 3 * tf:.1f} ms; at most p - r microbatches live on stage r")
    at = Latencies(1.0, 1.0, 1.0, 1.0, 0.5)
    sens = sensitivities(p, m, tf, 2 * tf, at)
    print("ms of step per ms of each latency (around 1 ms each, 0.5 for the last stage's):")
    for name, v in sens.items():
        print(f"  {name:<12} {v:5.1f}")
    if a.gaps is None:
        return
    with open(a.gaps) as f:
        rows = json.load(f)
    # (`simple` runs GPipe's order, not the capped one modelled here.)
    rows = [row for row in rows if "gaps_ms_and_count" in row and row["p"] == p
            and row["schedule"] == "interleaved"]
    if not rows:
        print(f"\n{a.gaps}: no `interleaved` row of p = {p} with gaps (--p sets p)")
    for row in rows:
        m_row, tf_row = row["m"], row["theory_s"] * 1e3 / ((row["m"] + p - 1) * 3)
        print(f"\nm = {m_row} {row['schedule']} ({a.gaps}): measured mean gaps -> modelled step")
        modelled = {}
        for system in ("smshim", "torch"):
            lat = from_gaps(row["gaps_ms_and_count"][system])
            modelled[system] = step_ms(p, m_row, tf_row, 2 * tf_row, lat)
            measured = row[f"{system}_s"] * 1e3
            cells = ", ".join(f"{k} {v:.2f}" for k, v in dataclasses.asdict(lat).items())
            print(f"  {system:<6} {cells}: modelled {modelled[system]:.1f} ms, "
                  f"measured {measured:.1f}")
        print(f"  smshim / torch: modelled {modelled['smshim'] / modelled['torch']:.4f}, "
              f"measured {row['smshim_vs_torch']:.4f}")


if __name__ == "__main__":
    main()
