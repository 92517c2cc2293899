"""Random models and set-ups (tests/random_models.py), trained under smp and in one process.

Each seed is one case: a model program with glue between remote modules, placed by hand or
auto-partitioned, under a random schedule, microbatch count, data parallelism, optimizer,
accumulation, evaluation steps, activation checkpointing and engine switches. The seeds below
are the first few plus, for every feature the generator can produce that those miss, the first
seed that has it. `SMSHIM_RANDOM_MODELS=LO:HI` runs seeds LO..HI-1 as well (a longer sweep:
`python -m tests.random_models LO HI` prints one line per seed).
"""

import os

import pytest

from tests.random_models import covering_seeds, features, make_case, run_case

FIRST = 20
SEEDS = covering_seeds(FIRST)
EXTRA = os.environ.get("SMSHIM_RANDOM_MODELS", "")
if EXTRA:
    lo, hi = (int(v) for v in EXTRA.split(":"))
    SEEDS = sorted(set(SEEDS) | set(range(lo, hi)))


@pytest.mark.parametrize("seed", SEEDS)
def test_random_model_matches_single_process(seed):
    case = make_case(seed)
    problems = run_case(case, timeout=120)
    assert not problems, f"seed {seed}:\n  " + "\n  ".join(problems) + "\n" + case.describe()


def test_the_seeds_cover_the_features_that_matter():
    covered = set().union(*(features(make_case(s)) for s in SEEDS))
    wanted = {"dp2:cluster", "dp2:spread", "adam", "accumulate", "evaluate", "checkpointed",
              "auto", "manual", "pp3", "pp4", "m1", "m4", "simple", "interleaved",
              "smaller_last", "called_twice", "no_grad_call", "loss:glue", "loss:module",
              "loss:step", "return_hidden", "return_int", "deterministic", "glue:item_if",
              "glue:bool_if", "glue:inplace", "fuse:dict", "kind:outer", "kind:gather",
              "kind:frozen", "kind:aux", "kind:listin", "env:SMSHIM_PREDICT",
              "env:SMSHIM_FUSED_WGRAD", "nested_call", "nested_call:dp2",
              "nested_call_through_pp_rank_0", "kind:deep"}
    assert wanted <= covered, sorted(wanted - covered)
