"""A rank's ready requests, run one after another by one thread at a time.

A request whose inputs have all come goes into this queue, ordered by the schedule's priority.
One thread at a time, the runner, takes them out and runs them. So the next request starts on the
thread that finished the last one, as a device stream runs its next kernel. Handing it to another
thread (wake it, let it take the GIL) costs 0.1-0.5 ms on a busy core, and a stage runs tens of
requests per step.

A runner that must wait steps down first, so that no request waits behind one that waits for it:
- for the network or the schedule's admission (`step_down`): if work is queued, a new thread
  becomes the runner;
- for the compute lock at priority p (`wait_at`): only for queued work that goes before p (it
  may be what the lock waits for). Work after p would wait for the lock behind it anyway, on a
  thread of its own: the runner keeps its role and runs that work once it has run its own.
  Work that goes before p and is queued later takes the role from the waiting runner.
A thread that stepped down finishes its request, then takes the role back if nobody has it;
otherwise it ends.

Work that may not start yet (`may_start`: the forward of a microbatch the schedule does not admit
yet) stays queued while the runner runs what may, instead of taking a thread to wait on. Once it
may start (`poke`), the runner takes it: the thread whose backward freed the microbatch's place
runs the next forward, with no hand-off.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from typing import Any, Callable, List, Optional


class RunQueue:
    """Items `run(item)` one at a time on the runner's thread; `spawn(fn)` starts a thread
    running `fn` when the role must pass to a new one. `may_start(item)`: whether an item may
    start now (called without the queue's lock held); whoever changes the answer calls `poke`."""

    def __init__(self, run: Callable[[Any], None], spawn: Callable[[Callable[[], None]], Any],
                 may_start: Optional[Callable[[Any], bool]] = None) -> None:
        self._run = run
        self._spawn = spawn
        self._may_start = may_start
        self._changes = 0  # puts and pokes: a runner that found nothing to start looks again
        self._heap: List[tuple] = []  # (priority, seq, item)
        self._seq = itertools.count()
        self._lock = threading.Lock()
        # The runner: a thread id, an object for a thread being started with the role, or None.
        self._owner: Any = None
        self._waiting: Any = None  # the priority at which the runner waits for the lock

    def put(self, priority: Any, item: Any, here: bool = False) -> bool:
        """Queue `item`. The role goes to the calling thread (with `here`; it must then call
        `drain()` when it can, and True is returned) or to a new one, if nobody has it, or if
        the runner waits for the lock at a priority `item` goes before."""
        me = threading.get_ident()
        with self._lock:
            heapq.heappush(self._heap, (priority, next(self._seq), item))
            self._changes += 1
            if self._owner is not None and (self._owner == me or self._waiting is None
                                            or not priority < self._waiting):
                return False
            self._waiting = None
            self._owner = token = me if here else object()
        if here:
            return True
        self._spawn(lambda: self._drain_new(token))
        return False

    def is_runner(self) -> bool:
        return self._owner == threading.get_ident()

    def poke(self, here: bool = False) -> bool:
        """What `may_start` says may have changed: if nobody has the role and work is queued,
        the calling thread (`here`: True is returned, as by `put`) or a new one looks at it."""
        me = threading.get_ident()
        with self._lock:
            self._changes += 1
            if self._owner is not None or not self._heap:
                return False
            self._owner = token = me if here else object()
        if here:
            return True
        self._spawn(lambda: self._drain_new(token))
        return False

    def peek(self) -> Optional[Any]:
        """The item the runner takes next (None if none is queued or may start)."""
        entry, _ = self._first()
        return None if entry is None else entry[2]

    def _first(self):
        """The first queued entry that may start (or None), and the count of changes seen."""
        with self._lock:
            changes = self._changes
            head = self._heap[0] if self._heap else None
            if head is None or self._may_start is None:
                return head, changes
        if self._may_start(head[2]):  # (the usual case: no sort)
            return head, changes
        with self._lock:
            entries = sorted(self._heap)
        return next((e for e in entries if self._may_start(e[2])), None), changes

    def take_next(self, wanted: Callable[[Any], bool]) -> Optional[Any]:
        """(The runner.) Take the item the runner would run next, if `wanted(item)` and it may
        start: its caller runs it at once (a chain of requests, without leaving the item it
        runs)."""
        with self._lock:
            if self._owner != threading.get_ident() or not self._heap:
                return None
            item = self._heap[0][2]
        if not wanted(item) or (self._may_start is not None and not self._may_start(item)):
            return None
        with self._lock:
            if not self._heap or self._heap[0][2] is not item:
                return None  # (something of a higher priority came meanwhile)
            heapq.heappop(self._heap)
            return item

    def first_is_after(self, priority: Any) -> bool:
        """Does nothing queued go before or with `priority` (the runner may run work of that
        priority it holds, as `take_next` would have taken it had it been queued)?"""
        with self._lock:
            return not self._heap or priority < self._heap[0][0]

    def step_down(self) -> None:
        """The calling thread is about to wait for something queued work may produce: if it
        is the runner, the role passes to a new thread when work is queued, else it is free."""
        with self._lock:
            if self._owner != threading.get_ident():
                return
            self._waiting = None
            if not self._heap:
                self._owner = None
                return
            self._owner = token = object()
        self._spawn(lambda: self._drain_new(token))

    def wait_at(self, priority: Any) -> None:
        """The calling thread is about to wait for the compute lock at `priority`: if it is the
        runner, the role passes to a new thread only for queued work that goes before it."""
        with self._lock:
            if self._owner != threading.get_ident():
                return
            if not (self._heap and self._heap[0][0] < priority):
                self._waiting = priority
                return
            self._waiting = None
            self._owner = token = object()
        self._spawn(lambda: self._drain_new(token))

    def waited(self) -> None:
        """The calling thread got the lock it waited for."""
        with self._lock:
            if self._owner == threading.get_ident():
                self._waiting = None

    def _drain_new(self, token: object) -> None:
        with self._lock:
            if self._owner is not token:
                return  # (not reached: only the runner gives the role away)
            self._owner = threading.get_ident()
        self.drain()

    def drain(self) -> None:
        """Run queued items until none is left. A thread that is not the runner (it stepped
        down during an item) takes the role back if it is free, else returns."""
        me = threading.get_ident()
        try:
            while True:
                with self._lock:
                    if self._owner != me:
                        if self._owner is not None:
                            return
                        self._owner = me
                entry, changes = self._first()
                with self._lock:
                    if entry is None:
                        if self._changes == changes:  # (else: look again)
                            self._owner = self._waiting = None
                            return
                        continue
                    # (Only the runner takes entries out.)
                    if self._heap[0] is entry:
                        heapq.heappop(self._heap)
                    else:
                        self._heap.remove(entry)
                        heapq.heapify(self._heap)
                item = entry[2]
                del entry
                self._run(item)
                del item  # hold nothing while idle
        except BaseException:
            self.step_down()  # (`run` reports its own errors: this is a bug; keep the queue going)
            raise

    def __len__(self) -> int:
        with self._lock:
            return len(self._heap)
