"""benchmarks/schedule_model.py: the model of the sleep stages' schedule gives the closed forms."""

import pytest

from benchmarks.schedule_model import Latencies, from_gaps, step_ms


@pytest.mark.parametrize("p,m", [(1, 4), (2, 2), (2, 8), (4, 8), (8, 32)])
def test_without_latencies_the_step_is_the_theory(p, m):
    """(m + p - 1)(tf + tb): what pipeline_schedules.py calls theory."""
    assert step_ms(p, m, 20.0, 40.0, Latencies()) == pytest.approx((m + p - 1) * 60.0)


def test_one_microbatch_crosses_every_transition_once():
    """p = 2, m = 1: forward, hop, forward, the last stage's turn, backward, hop, backward."""
    lat = Latencies(hop_f=1.0, hop_b=2.0, turn_f=5.0, turn_b=7.0, last_f_to_b=0.5)
    assert step_ms(2, 1, 20.0, 40.0, lat) == pytest.approx(20 + 1 + 20 + 0.5 + 40 + 2 + 40)


def test_a_stage_turns_between_its_own_pieces_of_work():
    """One stage, m = 2 (its cap of p - r = 1 holds it to F0 B0 F1 B1): a backward follows its
    own forward after the last stage's turn alone; the next forward, after a turn to it."""
    lat = Latencies(turn_f=1.0, turn_b=3.0, last_f_to_b=0.5)
    assert step_ms(1, 2, 20.0, 40.0, lat) == pytest.approx(20 + 0.5 + 40 + 1 + 20 + 0.5 + 40)


def test_hops_lie_on_the_critical_path_sixteen_times_at_p4_m8():
    """Each ms of a hop, both ways, adds 16 ms to the step of p = 4, m = 8 (no turns)."""
    for h in (0.5, 1.0, 1.5):
        assert step_ms(4, 8, 20.0, 40.0, Latencies(hop_f=h, hop_b=h)) == pytest.approx(660 + 16 * h)


def test_latencies_from_the_gaps_json_are_means():
    gaps = {"hop F": [19.0, 19], "hop B": [15.0, 10], "turn to F": [12.0, 12],
            "turn to B": [7.0, 14], "last F to B": [4.0, 8]}
    assert from_gaps(gaps) == Latencies(1.0, 1.5, 1.0, 0.5, 0.5)
    assert from_gaps({}) == Latencies()
