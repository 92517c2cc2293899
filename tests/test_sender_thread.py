"""A rank's sender thread (pipeline/sender.py) on its own: it posts held messages at their
deadline and waits for posted frames when told, for every peer. Real outboxes; a post and a reap
that record what they were given."""

import threading
import time

import pytest

from smshim.modelparallel.torch.pipeline.outbox import Outbox
from smshim.modelparallel.torch.pipeline.sender import SenderThread

HOLD_S = 0.02
LINGER_S = 0.1
SLACK_S = 0.5  # how late a post may come on a loaded machine


class _Rank:
    """Three peers' outboxes, the sender thread over them, and what it posted and reaped."""

    def __init__(self) -> None:
        self.boxes = {peer: Outbox() for peer in (1, 2, 3)}
        self.posted, self.reaped = [], []
        self.cond = threading.Condition()
        self.thread = SenderThread(self.boxes, self._post, self._reap, HOLD_S, LINGER_S,
                                   name="test-send")

    def _post(self, peer, box):
        with box.lock:  # (as Transport._post: whatever is queued goes, the hold ends)
            items, box.items, box.hold_until = box.items, [], None
        with self.cond:
            self.posted.append((peer, [m for m, _ in items], time.monotonic()))
            self.cond.notify_all()

    def _reap(self, peer, box):
        with self.cond:
            self.reaped.append(peer)
            self.cond.notify_all()

    def hold(self, peer, msg) -> float:
        """Queue `msg` for `peer` as Transport._queue does; when the box's hold began (its
        deadline less HOLD_S: a clock read after `held` returns can be late by as long as this
        thread waited for a core, and a post on time would look early)."""
        box = self.boxes[peer]
        with box.lock:
            box.items.append((msg, None))
            if box.hold_until is None:
                box.hold_until = until = time.monotonic() + HOLD_S
                self.thread.held(until)
            return box.hold_until - HOLD_S

    def wait_for(self, items, count):
        with self.cond:
            assert self.cond.wait_for(lambda: len(items) >= count, timeout=10), items
        return items[:count]


@pytest.fixture
def rank():
    r = _Rank()
    yield r
    r.thread.stop()
    r.thread.thread.join(timeout=5)
    assert not r.thread.thread.is_alive()


def test_held_messages_leave_at_their_peers_deadline_not_before(rank):
    t1 = rank.hold(1, "a")
    rank.hold(1, "b")  # (joins the hold begun by "a": one deadline)
    time.sleep(HOLD_S / 2)
    t2 = rank.hold(2, "c")
    (p1, msgs1, at1), (p2, msgs2, at2) = rank.wait_for(rank.posted, 2)
    assert (p1, msgs1, p2, msgs2) == (1, ["a", "b"], 2, ["c"])
    assert t1 + HOLD_S * 0.99 <= at1 < t1 + HOLD_S + SLACK_S
    assert t2 + HOLD_S * 0.99 <= at2 < t2 + HOLD_S + SLACK_S
    assert rank.boxes[3].hold_until is None and len(rank.posted) == 2


def test_a_hold_after_the_thread_went_to_sleep_wakes_it(rank):
    rank.hold(3, "early")
    rank.wait_for(rank.posted, 1)
    time.sleep(LINGER_S + 3 * HOLD_S)  # past the linger: it now sleeps until told
    t = rank.hold(3, "late")
    _, msgs, at = rank.wait_for(rank.posted, 2)[1]
    assert msgs == ["late"]
    assert t + HOLD_S * 0.99 <= at < t + HOLD_S + SLACK_S


def test_a_box_flushed_before_its_deadline_is_not_posted_again(rank):
    rank.hold(1, "flushed")
    box = rank.boxes[1]
    with box.lock:  # (a flush by the thread that held it: Transport._post)
        box.items, box.hold_until = [], None
    rank.hold(2, "kept")
    assert [p for p, _, _ in rank.wait_for(rank.posted, 1)] == [2]
    time.sleep(2 * HOLD_S)
    assert len(rank.posted) == 1


def test_told_to_wait_for_posted_frames_it_looks_at_every_peer(rank):
    time.sleep(LINGER_S + 2 * HOLD_S)  # (asleep until told)
    rank.thread.reap_wanted()
    assert sorted(rank.wait_for(rank.reaped, 3)) == [1, 2, 3] and not rank.posted
