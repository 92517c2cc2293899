"""pp_rank 0's microbatches take turns at its own modules.

pp_rank 0 runs the step body of several microbatches at once, one worker thread each. Left alone,
their calls into pp_rank 0's own modules would interleave module by module and delay every later
stage. Instead a microbatch's module waits until every earlier microbatch has finished that
direction here: stage 0 runs one microbatch's forward (backward) through all its modules before
the next one's, as a pipeline stage should. A microbatch finishes a direction when its code for it
is over, or as soon as it has run as many of pp_rank 0's modules as a microbatch runs (learned from
the microbatches before): its remaining glue code only sends calls to the other stages, and the
next microbatch computes meanwhile. Schedules whose backwards begin in microbatch order also wait
here until the earlier microbatches' backwards have begun.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Dict, List, Union

from smshim.modelparallel.torch.pipeline.scheduler import BACKWARD, FORWARD
from smshim.modelparallel.torch.pipeline.messages import PipelineError


class Turns:
    """`check()` raises if the pipeline has failed (a waiter then stops waiting)."""

    def __init__(self, timeout_s: float, check: Callable[[], None]) -> None:
        self._timeout_s = timeout_s
        self._check = check
        self._lock = threading.Lock()
        self._done: Dict[str, _Done] = {FORWARD: _Done(), BACKWARD: _Done()}
        self._begun = _Done()  # microbatches whose backward made its first call
        # Bodies waiting, (set, microbatch, event): an entry added to a set wakes only the body
        # whose turn it completes (a condition's notify_all would wake every body waiting, each
        # costing a thread switch and a turn at the GIL).
        self._waiters: List[tuple] = []
        # Own modules a microbatch ran, by (direction, microbatch), and how many a microbatch
        # runs in all (learned from microbatches whose code for it was over; kept across steps).
        self._runs: collections.Counter = collections.Counter()
        self._per_mb = {FORWARD: 0, BACKWARD: 0}

    def reset(self) -> None:
        """A new step."""
        with self._lock:
            for s in (*self._done.values(), self._begun):
                s.clear()
                s.prefix = 0
            self._runs.clear()

    def wait(self, direction: str, mb: int, what: Union[str, Callable[[], str]]) -> None:
        """Microbatch `mb` is about to run the `what` of one of pp_rank 0's modules (a string,
        or a function making it, called only for an error): wait until every earlier
        microbatch has finished `direction` here."""
        done = self._done[direction]
        if done.prefix >= mb:  # (read without the lock: within a step, it only grows)
            return
        self._wait(done, mb, what, "finish")

    def wait_backward_begun(self, mb: int, what: str) -> None:
        """Microbatch `mb`'s backward (`what`) waits until every earlier one's has begun."""
        self._wait(self._begun, mb, what, "begin")

    def has_begun(self, mb: int) -> bool:
        return mb in self._begun

    def backward_begun(self, mb: int) -> None:
        """Microbatch `mb`'s backward has made its first call (queued its first request:
        messages to a peer leave in the order they were queued), or will make none."""
        with self._lock:
            self._begun.add(mb)
            self._added_locked(self._begun)

    def ran(self, direction: str, mb: int) -> None:
        """Microbatch `mb` ran one of pp_rank 0's modules in `direction`."""
        with self._lock:
            self._runs[(direction, mb)] += 1
            if 0 < self._per_mb[direction] <= self._runs[(direction, mb)]:
                self._finished_locked(direction, mb)

    def done(self, direction: str, mb: int) -> None:
        """Microbatch `mb`'s code for `direction` is over."""
        with self._lock:
            self._per_mb[direction] = max(self._per_mb[direction], self._runs[(direction, mb)])
            self._finished_locked(direction, mb)

    def wake_all(self) -> None:
        """The pipeline failed: every waiter looks at `check()`."""
        with self._lock:
            for _, _, event in self._waiters:
                event.set()

    def _finished_locked(self, direction: str, mb: int) -> None:
        done = self._done[direction]
        done.add(mb)
        self._added_locked(done)

    def _added_locked(self, done: "_Done") -> None:
        """An entry was added to `done`: wake the bodies whose turn it was."""
        while done.prefix in done:
            done.prefix += 1
        for waiting_on, mb, event in self._waiters:
            if waiting_on is done and _turn_come(done, mb):
                event.set()

    def _wait(self, done: "_Done", mb: int, what: Union[str, Callable[[], str]],
              their: str) -> None:
        deadline = time.monotonic() + self._timeout_s
        with self._lock:
            if _turn_come(done, mb):
                return
            event = threading.Event()
            waiter = (done, mb, event)
            self._waiters.append(waiter)
        try:
            while True:
                event.wait(timeout=1.0)
                with self._lock:
                    if _turn_come(done, mb):
                        return
                    event.clear()  # (an entry added after this check sets it again)
                self._check()
                if time.monotonic() > deadline:
                    if callable(what):
                        what = what()
                    raise PipelineError(
                        f"pp rank 0 waited {self._timeout_s:.0f} s to run the {what}: earlier "
                        f"microbatches {sorted(set(range(mb)) - done)} did not {their} theirs")
        finally:
            with self._lock:
                self._waiters.remove(waiter)


class _Done(set):
    """Microbatches that reached a point, and how many from 0 on did so without a gap."""

    prefix = 0


def _turn_come(done: _Done, mb: int) -> bool:
    """Has every microbatch before `mb` reached `done`?"""
    return done.prefix >= mb
