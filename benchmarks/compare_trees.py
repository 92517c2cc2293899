"""Benchmark: this checkout against another revision on the tiny-block pipeline, run for run.

Each pair runs `benchmarks/pipeline_as_written.py` on the overhead-bound model (8 blocks of
width 16, batch 128, pp = 2, m = 8, `interleaved`, ranks pinned, the systems in turns of 10
steps, 30 steps) once with each tree, every tree's own copy of the benchmark importing its own
`smshim`; the other revision is checked out into a temporary `git worktree`, removed at the end.
The order alternates from pair to pair: the second run of a pair tends to measure higher, by
more than a small change is worth (docs/benchmarks.md). Prints each tree's median smshim /
torch and quartiles, for each order and overall, and in how many pairs this checkout was lower.

    python benchmarks/compare_trees.py REV [--pairs 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ARGS = ["--p", "2", "--m", "8", "--d", "16", "--batch", "128", "--partitions", "manual",
        "--pin", "--schedules", "interleaved", "--steps", "30", "--block", "10"]


def _ratio(tree: str, out: str) -> float:
    """One run of the tree's own benchmark; its smshim / torch."""
    env = dict(os.environ, PYTHONPATH=tree)
    subprocess.run([sys.executable, os.path.join(tree, "benchmarks", "pipeline_as_written.py"),
                    *ARGS, "--out", out], cwd=tree, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)["rows"][0]["smshim_vs_torch"]


def _describe(values: List[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return f"median {statistics.median(values):.3f} (quartiles {q[0]:.3f} / {q[2]:.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rev", help="the revision to compare with (a commit, branch or tag)")
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--out", default=None, help="JSON of every pair (default: none)")
    a = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        other = os.path.join(tmp, "tree")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", other, a.rev],
                       check=True)
        try:
            pairs: List[Dict[str, object]] = []
            for i in range(a.pairs):
                order = ["this", a.rev] if i % 2 else [a.rev, "this"]
                got = {name: _ratio(ROOT if name == "this" else other,
                                    os.path.join(tmp, f"{i}_{k}.json"))
                       for k, name in enumerate(order)}
                pairs.append({"first": order[0], "this": got["this"], a.rev: got[a.rev]})
                print(f"pair {i + 1} ({order[0]} first): this {got['this']:.3f}, "
                      f"{a.rev} {got[a.rev]:.3f}", flush=True)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", other],
                           check=False)

    print(f"\nsmshim / torch, tiny blocks, {len(pairs)} pairs:")
    for first in ("this", a.rev, None):
        chosen = [p for p in pairs if first is None or p["first"] == first]
        if not chosen:
            continue
        lower = sum(p["this"] < p[a.rev] for p in chosen)
        print(f"  {'all pairs' if first is None else f'{first} first'} ({len(chosen)}): this "
              f"{_describe([p['this'] for p in chosen])}; {a.rev} "
              f"{_describe([p[a.rev] for p in chosen])}; this lower in {lower}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rev": a.rev, "args": ARGS, "pairs": pairs}, f, indent=1)


if __name__ == "__main__":
    main()
