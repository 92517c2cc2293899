"""benchmarks/pipeline_schedules.py --gaps: each sleep's gap is named after what it waited for
last, and the critical path of pp_rank 0's step adds up to the step's time."""

import pytest

from benchmarks.pipeline_schedules import _critical_path, _step_gaps, _steps


def _results(sleeps_by_rank, span):
    """One recorded step: each rank's sleeps (kind, microbatch, start, end), in seconds; rank 0's
    step from span[0] to span[1]."""
    return [{"sleeps": [sleeps], "spans": [span] if r == 0 else None}
            for r, sleeps in enumerate(sleeps_by_rank)]


# p = 2, m = 1 (seconds): F on stage 0, the hop, F then B on stage 1, the hop back, B on stage 0.
_ONE_MICROBATCH = _results([
    [("F", 0, 0.000, 0.020), ("B", 0, 0.083, 0.123)],
    [("F", 0, 0.021, 0.041), ("B", 0, 0.0415, 0.0815)],
], (-0.001, 0.124))


def test_one_microbatch_names_each_gap_after_its_input():
    gaps = {(name, r): round(s * 1e3, 6) for name, r, s in _step_gaps(*_steps(_ONE_MICROBATCH, 2)[0])}
    assert gaps == {("hop F", 1): 1.0, ("last F to B", 1): 0.5, ("hop B", 0): 1.5,
                    ("step head", 0): 1.0, ("step tail", 0): 1.0}


def test_the_critical_path_adds_up_to_the_step():
    path = _critical_path(_steps(_ONE_MICROBATCH, 2))
    assert path == pytest.approx({"hop B, stage 0": 1.5, "hop F, stage 1": 1.0,
                                  "last F to B, stage 1": 0.5, "step head, stage 0": 1.0,
                                  "step tail, stage 0": 1.0, "work": 120.0})
    assert sum(path.values()) == pytest.approx(125.0)


def test_a_turn_binds_when_the_stage_itself_came_last():
    """One stage, m = 2: F1 waits only for the stage's own B0 (a turn), and B1 for F1 (the last
    stage's forward to backward); the path goes through every sleep."""
    results = _results([[("F", 0, 0.000, 0.020), ("B", 0, 0.0205, 0.0605),
                         ("F", 1, 0.0615, 0.0815), ("B", 1, 0.0820, 0.1220)]], (0.0, 0.1225))
    gaps = sorted((name, r, round(s * 1e3, 6)) for name, r, s in _step_gaps(*_steps(results, 1)[0]))
    assert gaps == [("last F to B", 0, 0.5), ("last F to B", 0, 0.5), ("step head", 0, 0.0),
                    ("step tail", 0, 0.5), ("turn to F", 0, 1.0)]
    path = _critical_path(_steps(results, 1))
    assert path == pytest.approx({"last F to B, stage 0": 1.0, "turn to F, stage 0": 1.0,
                                  "step head, stage 0": 0.0, "step tail, stage 0": 0.5,
                                  "work": 120.0})
    assert sum(path.values()) == pytest.approx(122.5)
