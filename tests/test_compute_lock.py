"""The compute lock's order: smaller priority first, then arrival; a place kept for work that has
come (Schedule.forwards_keep_place) holds back larger priorities until that work has run."""

import threading
import time

from smshim.modelparallel.torch.pipeline.scheduler import ComputeLock


def _run(lock, priority, log, name, place=None):
    with lock.hold(priority, place=place):
        log.append(name)


def _start(lock, priority, log, name, waiters=1):
    """A thread that takes the lock at `priority`; returns once it waits in the queue."""
    t = threading.Thread(target=_run, args=(lock, priority, log, name), daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    while len(lock._waiters) < waiters and not log and time.monotonic() < deadline:
        time.sleep(0.001)
    return t


def test_a_kept_place_holds_back_larger_priorities_until_its_work_has_run():
    lock, log = ComputeLock(), []
    place = lock.keep_place((0, 5))
    backward = _start(lock, (1, 0), log, "backward")
    time.sleep(0.05)
    assert log == []  # the lock is free, but the forward that kept its place goes first
    _run(lock, (0, 5), log, "forward", place)
    backward.join(5)
    assert log == ["forward", "backward"]


def test_a_kept_place_does_not_hold_back_smaller_or_equal_priorities():
    lock, log = ComputeLock(), []
    lock.keep_place((0, 5))
    for name, priority in (("earlier microbatch", (0, 3)), ("same microbatch", (0, 5))):
        t = _start(lock, priority, log, name)
        t.join(5)
        assert log[-1] == name


def test_work_that_kept_a_place_goes_before_equals_that_came_after_it():
    lock, log = ComputeLock(), []
    lock.acquire((0, 0))  # busy
    place = lock.keep_place((0, 5))
    later = _start(lock, (0, 5), log, "came later")
    kept = threading.Thread(target=_run, args=(lock, (0, 5), log, "kept a place", place))
    kept.start()
    while len(lock._waiters) < 2:
        time.sleep(0.001)
    lock.release()
    kept.join(5)
    later.join(5)
    assert log == ["kept a place", "came later"]


def test_giving_up_or_clearing_places_lets_the_others_run():
    lock, log = ComputeLock(), []
    place = lock.keep_place((0, 5))
    t = _start(lock, (1, 0), log, "after give_up")
    time.sleep(0.02)
    assert log == []
    lock.give_up(place)
    t.join(5)
    assert log == ["after give_up"]

    lock.keep_place((0, 6))
    lock.keep_place((0, 7))
    t = _start(lock, (1, 1), log, "after clear")
    time.sleep(0.02)
    assert log == ["after give_up"]
    lock.clear_places()
    t.join(5)
    assert log == ["after give_up", "after clear"]


def test_a_holder_taking_the_lock_again_gives_its_place_up():
    lock, log = ComputeLock(), []
    with lock.hold((0, 0)):
        place = lock.keep_place((0, 5))
        with lock.hold((0, 5), place=place):  # re-entrant: the place is not needed
            pass
    t = _start(lock, (1, 0), log, "backward")
    t.join(5)
    assert log == ["backward"]


def test_a_holder_tagged_anew_takes_the_lock_back_as_its_new_work():
    # pp_rank 0's step body holds the lock from its forward into its backward, and gives it up
    # while it waits for a gradient: it must take it back as a backward.
    lock, log = ComputeLock(), []
    lock.acquire((1, 5), key=("forward", 5))
    lock.tag((0, 5), ("backward", 5))
    other_may_end = threading.Event()

    def other():
        with lock.hold((0, 0)):
            log.append("other")
            other_may_end.wait(5)

    holder = threading.Thread(target=other, daemon=True)
    holder.start()
    while not lock._waiters:
        time.sleep(0.001)
    with lock.released():  # the body waits for its gradient; `other` computes meanwhile
        while log != ["other"]:
            time.sleep(0.001)
        later = _start(lock, (0, 7), log, "a later microbatch's backward")
        threading.Timer(0.1, other_may_end.set).start()
    log.append("the body's backward")  # (taken back here: before the later microbatch)
    lock.release()
    later.join(5)
    holder.join(5)
    assert log == ["other", "the body's backward", "a later microbatch's backward"]


def test_a_holder_sees_whether_work_of_its_priority_or_before_waits():
    lock, log = ComputeLock(), []
    with lock.hold((0, 3)):
        assert not lock.contested((0, 3))
        later = _start(lock, (0, 4), log, "later")
        assert not lock.contested((0, 3))  # work after it waits: it may go on
        place = lock.keep_place((0, 1))
        assert lock.contested((0, 3))  # a place kept before it
        lock.give_up(place)
        assert not lock.contested((0, 3))
        equal = _start(lock, (0, 3), log, "equal", waiters=2)
        assert lock.contested((0, 3))
    later.join(5)
    equal.join(5)
    assert log == ["equal", "later"]


def test_a_kept_hold_leaves_the_lock_held_for_its_caller_to_give_up():
    lock, counted = ComputeLock(), []
    with lock.hold((0, 0), more=lambda: counted.append(1) or False) as hold:
        assert hold.took
        hold.keep()
    assert lock.held() and counted == [1]  # counted once, as its end would have
    with lock.hold((0, 0)) as inner:  # (held: a chained request's hold takes nothing)
        assert not inner.took
    assert lock.held()
    lock.release()
    assert not lock.held()
