"""pp_rank 0's microbatches take turns at its forward.

pp_rank 0 runs the step body of several microbatches at once, one worker thread each, and a body
computes (pp_rank 0's own modules) under the compute lock, which goes by priority to the threads
waiting for it. A body that starts its forward while the one before has not started yet must not
overtake it: stage 0 runs the microbatches' forwards in order, as a pipeline stage should. So a
body waits here, before it takes the lock, until every earlier microbatch has had its turn. A
microbatch's turn is over when its forward code is, or as soon as that code first waits for a
peer (a value from a later stage: its own modules have run, and the next microbatch computes
meanwhile). Schedules whose backwards begin in microbatch order also wait here until the earlier
microbatches' backwards have begun.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, ContextManager, List, Union

from smshim.modelparallel.torch.pipeline.messages import PipelineError
from smshim.modelparallel.torch.pipeline.wakeup import Wakeup


class Turns:
    """`check()` raises if the pipeline has failed (a waiter then stops waiting)."""

    def __init__(self, timeout_s: float, check: Callable[[], None]) -> None:
        self._timeout_s = timeout_s
        self._check = check
        self._lock = threading.Lock()
        self._forward = _Done()  # microbatches whose forward turn is over
        self._begun = _Done()  # microbatches whose backward made its first call
        # Bodies waiting, (set, microbatch, event): an entry added to a set wakes only the body
        # whose turn it completes (a condition's notify_all would wake every body waiting, each
        # costing a thread switch and a turn at the GIL).
        self._waiters: List[tuple] = []

    def reset(self) -> None:
        """A new step."""
        with self._lock:
            for s in (self._forward, self._begun):
                s.clear()
                s.prefix = 0

    def wait_forward(self, mb: int, what: Union[str, Callable[[], str]]) -> None:
        """Microbatch `mb`'s body is about to run its forward (`what`: a string, or a function
        making it, called only for an error): wait until every earlier microbatch has had its
        turn."""
        if self._forward.prefix >= mb:  # (read without the lock: within a step, it only grows)
            return
        self._wait(self._forward, mb, what, "finish")

    def forward_over(self, mb: int) -> None:
        """Microbatch `mb`'s forward turn is over."""
        with self._lock:
            self._forward.add(mb)
            self._added_locked(self._forward)

    def wait_backward_begun(self, mb: int, what: str,
                            waiting: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
        """Microbatch `mb`'s backward (`what`) waits until every earlier one's has begun, inside
        `waiting()` if it must wait (the compute lock given up, say)."""
        if self._begun.prefix >= mb:
            return
        with waiting():
            self._wait(self._begun, mb, what, "begin")

    def has_begun(self, mb: int) -> bool:
        return mb in self._begun

    def backward_begun(self, mb: int) -> None:
        """Microbatch `mb`'s backward has made its first call (queued its first request:
        messages to a peer leave in the order they were queued), or will make none."""
        with self._lock:
            self._begun.add(mb)
            self._added_locked(self._begun)

    def wake_all(self) -> None:
        """The pipeline failed: every waiter looks at `check()`."""
        with self._lock:
            for _, _, event in self._waiters:
                event.set()

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
            event = Wakeup()
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
