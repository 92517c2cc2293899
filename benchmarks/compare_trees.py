"""Benchmark: this checkout against another revision on a pipeline benchmark, run for run.

Each pair runs the benchmark once with each tree, every tree's own copy of it importing its own
`smshim`; the other revision is checked out into a temporary `git worktree`, removed at the end.
`--bench tiny` (the default): `pipeline_as_written.py` on the overhead-bound model (8 blocks of
width 16, batch 128, pp = 2, m = 8, `interleaved`, ranks pinned, the systems in turns of 10
steps, 30 steps). `--bench sleep`: `pipeline_schedules.py`'s sleep stages (p = 4, m = 8,
`interleaved` against Schedule1F1B, 5 steps), a latency-bound step; `--bench sleep8`: the same
with p = 8, m = 32, tf = 10 ms, 4 steps (8 processes on the machine's cores). The order
alternates from pair to pair: the second run of a pair tends to measure higher, by more than a
small change is worth (docs/benchmarks.md). Prints each tree's median smshim / torch and
quartiles, for each order and overall, and in how many pairs this checkout was lower.

    python benchmarks/compare_trees.py REV [--bench tiny|sleep|sleep8] [--pairs 30] [--out FILE]
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
# Each benchmark: its script, its arguments, and where its JSON keeps the smshim / torch ratio.
BENCHES = {
    "tiny": ("pipeline_as_written.py",
             ["--p", "2", "--m", "8", "--d", "16", "--batch", "128", "--partitions", "manual",
              "--pin", "--schedules", "interleaved", "--steps", "30", "--block", "10"],
             lambda data: data["rows"][0]["smshim_vs_torch"]),
    "sleep": ("pipeline_schedules.py", ["--m", "8", "--schedules", "interleaved"],
              lambda data: next(r for r in data if r["schedule"] == "interleaved")
              ["smshim_vs_torch"]),
    "sleep8": ("pipeline_schedules.py", ["--p", "8", "--m", "32", "--tf-ms", "10", "--steps", "4",
                                         "--schedules", "interleaved"],
               lambda data: next(r for r in data if r["schedule"] == "interleaved")
               ["smshim_vs_torch"]),
}
# Options an older revision's copy of a benchmark may not have (it then runs its default).
_NEWER = {"--schedules": 1}


def _ratio(bench: str, tree: str, out: str) -> float:
    """One run of the tree's own benchmark; its smshim / torch."""
    script, args, ratio = BENCHES[bench]
    path = os.path.join(tree, "benchmarks", script)
    with open(path) as f:
        known = f.read()
    for option, n in _NEWER.items():
        if option in args and f'"{option}"' not in known:
            i = args.index(option)
            args = args[:i] + args[i + 1 + n:]
    env = dict(os.environ, PYTHONPATH=tree)
    subprocess.run([sys.executable, path, *args, "--out", out], cwd=tree, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    with open(out) as f:
        return ratio(json.load(f))


def _describe(values: List[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return f"median {statistics.median(values):.3f} (quartiles {q[0]:.3f} / {q[2]:.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rev", help="the revision to compare with (a commit, branch or tag)")
    ap.add_argument("--bench", choices=sorted(BENCHES), default="tiny")
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
                got = {name: _ratio(a.bench, ROOT if name == "this" else other,
                                    os.path.join(tmp, f"{i}_{k}.json"))
                       for k, name in enumerate(order)}
                pairs.append({"first": order[0], "this": got["this"], a.rev: got[a.rev]})
                print(f"pair {i + 1} ({order[0]} first): this {got['this']:.3f}, "
                      f"{a.rev} {got[a.rev]:.3f}", flush=True)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", other],
                           check=False)

    print(f"\nsmshim / torch, {a.bench}, {len(pairs)} pairs:")
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
            json.dump({"rev": a.rev, "bench": a.bench, "args": BENCHES[a.bench][1],
                       "pairs": pairs}, f, indent=1)


if __name__ == "__main__":
    main()
