"""Pipeline schedules and the per-rank compute lock that enforces them.

A schedule is a small policy object answering five questions: how many microbatches may a rank
hold activations for at once (`limit(rank)`: pp_rank 0 admits microbatches by it, every other
rank holds back the first forward of a new microbatch by it), may a microbatch whose forward is
done start its backward, do the backwards begin in microbatch order, in which order does a rank
run the work that is ready, and does a rank keep that order even when it must idle for it
(`strict_order`). Adding a schedule is adding a policy class to `SCHEDULES`.

The order of module calls is not known in advance (pp_rank 0 runs arbitrary forward code and
discovers the calls as it goes), so the schedule cannot be a precomputed list of actions per rank
as in torch.distributed.pipelining; these three answers are what such a list would encode.

Every rank runs one module forward or backward at a time ("one request at a time", as a device
runs one stream). `ComputeLock` is that rule: a lock granted by priority, (backward before forward,
then lowest microbatch) under `interleaved`; held only while computing, and given up while a
thread waits on the network.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from typing import Callable, ContextManager, Dict, Optional, Tuple

from smshim.modelparallel.torch.pipeline.wakeup import Wakeup

FORWARD, BACKWARD = "forward", "backward"


class Schedule:
    """A policy; subclasses decide admission and priority."""

    name = "base"
    # A rank computes in priority order even when it must idle for it: a forward request pp_rank
    # 0 sent keeps its place in the compute lock's queue from its arrival (work of a larger
    # priority waits for it while its inputs are on the way), and requests made ready together
    # keep theirs until their threads get there. Otherwise (greedy) the lock goes to the
    # first-priority work among what is waiting for it when it comes free.
    strict_order = False
    # pp_rank 0 begins microbatch i's backward only once every earlier microbatch's has made its
    # first call (or ended without one): the requests then reach every stage in microbatch order.
    backwards_begin_in_order = False

    def __init__(self, microbatches: int, active_microbatches: int, stages: int = 1) -> None:
        self.microbatches = microbatches
        self.active_microbatches = active_microbatches
        self.stages = stages

    def limit(self, rank: int) -> int:
        """How many microbatches pp rank `rank` may hold activations for at once."""
        raise NotImplementedError

    def may_start_forward(self, started: int, finished: int) -> bool:
        """May microbatch number `started` begin on pp_rank 0? (`finished` have completed.)"""
        return started < self.microbatches and started - finished < self.limit(0)

    def may_start_backward(self, forwards_done: int) -> bool:
        """May a microbatch whose forward is done begin its backward?"""
        raise NotImplementedError

    def priority(self, kind: str, microbatch: int) -> Tuple[int, int]:
        """Smaller runs first among work that is ready on a rank."""
        raise NotImplementedError


class SimpleSchedule(Schedule):
    """GPipe: on every rank, every microbatch's forward before any backward, and the backwards
    in microbatch order. pp_rank 0 starts the backward once all forward code is over; the other
    ranks may then still have forwards to run whose inputs have not come, and a backward that
    is ready must not go first (it would delay the forwards behind it by a whole backward). All
    microbatches' backwards become ready on pp_rank 0 at once; begun in any order, they reach
    the last stage in any order, and a later microbatch's backward run first there delays the
    first one's, which every earlier stage waits for, by a whole backward."""

    name = "simple"
    strict_order = True
    backwards_begin_in_order = True

    def limit(self, rank: int) -> int:
        return self.microbatches

    def may_start_backward(self, forwards_done: int) -> bool:
        return forwards_done == self.microbatches

    def priority(self, kind: str, microbatch: int) -> Tuple[int, int]:
        return (0 if kind == FORWARD else 1, microbatch)


class InterleavedSchedule(Schedule):
    """1F1B: a ready backward first (lowest microbatch), else the next forward while the rank
    holds fewer than min(stages - rank, active_microbatches) microbatches: stage r needs no more
    in flight than the p - r microbatches it takes a forward to reach the last stage and its
    backward to come back (1F1B's bound), so memory is bounded at no cost in step time."""

    name = "interleaved"

    def limit(self, rank: int) -> int:
        return max(1, min(self.stages - rank, self.active_microbatches, self.microbatches))

    def may_start_backward(self, forwards_done: int) -> bool:
        return True

    def priority(self, kind: str, microbatch: int) -> Tuple[int, int]:
        return (0 if kind == BACKWARD else 1, microbatch)


SCHEDULES: Dict[str, type] = {"simple": SimpleSchedule, "interleaved": InterleavedSchedule}


def make_schedule(name: str, microbatches: int, active_microbatches: int,
                  stages: int = 1) -> Schedule:
    try:
        cls = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"pipeline={name!r} is not a schedule; choose one of {sorted(SCHEDULES)}") from None
    return cls(microbatches, active_microbatches, stages)


class ComputeLock:
    """A lock handed to the waiting thread with the smallest priority (FIFO among equals).

    A piece of work that releases the lock may reserve it for `GRACE_S` for more work of the same
    microbatch and direction: a stage's forward (or backward) of one microbatch is several module
    calls, each taking the lock in turn, and between two of them the next one is not yet waiting
    (its thread is running glue code, or waiting for the input the previous call just produced).
    Without the reservation, other work slips into each gap and the microbatch reaches the next
    stage late, idling it; 1F1B means one microbatch's whole forward, then one whole backward."""

    GRACE_S = 0.002

    def __init__(self) -> None:
        # Each waiter sleeps on an event of its own, and a change wakes only the waiter that may
        # take the lock next: waking every waiter on each release (a condition's notify_all)
        # costs a thread switch and a turn at the GIL per waiter, just when the next one should
        # start computing.
        self._mutex = threading.Lock()
        self._held_by: Optional[int] = None
        self._waiters: list = []  # heap of (priority, seq, thread id, key, event)
        self._places: list = []  # (priority, seq, None, key): see keep_place
        self._seq = itertools.count()
        self._local = threading.local()
        self._reserved: Optional[tuple] = None
        self._reserved_until = 0.0
        # Called (outside the lock's mutex) by a thread about to wait for the lock at a priority,
        # and once it has it: the module server's run queue passes its role on if queued work
        # goes first (RunQueue.wait_at, waited).
        self.on_wait: Optional[Callable[[Tuple[int, int]], None]] = None
        self.on_waited: Optional[Callable[[], None]] = None
        # Called (outside the mutex) by a holder about to give the lock up to wait on the
        # network (`released`): the run queue passes its role on if work is queued, whatever the
        # wait (a tensor-parallel collective waits for its peer, which may need that work run
        # here first: the peer's own order of microbatches can differ).
        self.on_give_up: Optional[Callable[[], None]] = None

    def _next(self):
        """(under the mutex) The waiter that may take the lock now, and how long to wait
        for the reservation to expire otherwise."""
        if self._reserved is not None:
            left = self._reserved_until - time.monotonic()
            if left > 0:
                mine = [e for e in self._waiters if e[3] == self._reserved]
                return (min(mine) if mine else None), left
            self._reserved = None
        first = self._waiters[0] if self._waiters else None
        if first is not None and self._places and self._places[0][0] < first[0]:
            return None, None  # a kept place comes first
        return first, None

    def _free_for(self, priority: Tuple[int, int], key: Optional[tuple]) -> bool:
        """(under the mutex) May work of this priority and key take the lock at once, with
        nobody waiting: what `_next` would say of it as the only waiter."""
        if self._held_by is not None or self._waiters:
            return False
        if self._places and self._places[0][0] < priority:
            return False
        return (self._reserved is None or self._reserved == key
                or self._reserved_until <= time.monotonic())

    def _wake_next(self) -> None:
        """(under the mutex) The lock is free, or what decides who gets it changed: wake the
        waiter that may take it, or, while a reservation runs with none of its work waiting,
        the first waiter (it sleeps until the reservation expires)."""
        if self._held_by is not None or not self._waiters:
            return
        nxt, left = self._next()
        if nxt is None and left is not None:
            nxt = self._waiters[0]
        if nxt is not None:
            nxt[4].set()

    def keep_place(self, priority: Tuple[int, int], key: Optional[tuple] = None) -> tuple:
        """Keep a place in the queue at `priority` for work that has come but cannot start yet
        (its inputs are on the way): no waiter of a larger priority takes the lock before that
        work has. Waiters of an equal priority do not wait for it (work of the same microbatch
        may be what produces its inputs). The work takes its place with `acquire(place=...)`;
        `give_up` drops it (the work failed, or will not run)."""
        with self._mutex:
            place = (priority, next(self._seq), None, key)
            heapq.heappush(self._places, place)
            return place

    def give_up(self, place: tuple) -> None:
        with self._mutex:
            if self._drop_place(place):
                self._wake_next()

    def clear_places(self) -> None:
        """Drop every kept place (a failed step: the work they were kept for will not come)."""
        with self._mutex:
            self._places.clear()
            self._wake_next()

    def _drop_place(self, place: tuple) -> bool:
        try:
            self._places.remove(place)
        except ValueError:
            return False  # taken already, or cleared
        heapq.heapify(self._places)
        return True

    def acquire(self, priority: Tuple[int, int], key: Optional[tuple] = None,
                place: Optional[tuple] = None,
                trace: Optional[Callable[[], ContextManager]] = None) -> None:
        """Take the lock at `priority` (see the class). `trace`: a timeline span to open for
        each stretch this thread holds the lock (closed when it gives the lock up, reopened
        when `released` takes it back)."""
        me = threading.get_ident()
        with self._mutex:
            # Work that kept a place waits from there (first among its equals that came later).
            seq = place[1] if place is not None and self._drop_place(place) else next(self._seq)
            # (The usual case on a busy rank: the lock is free and nobody queues for it.)
            told = False if self._free_for(priority, key) else self._wait_locked(
                priority, seq, me, key)
            self._held_by = me
            self._reserved = None
        if told and self.on_waited is not None:
            self.on_waited()
        self._local.priority = priority
        self._local.key = key
        self._open_span(trace)

    def _wait_locked(self, priority: Tuple[int, int], seq: int, me: int,
                     key: Optional[tuple]) -> bool:
        """(under the mutex, which it gives up while it sleeps) Queue and wait until this
        thread may take the lock; returns whether it told `on_wait`."""
        event = getattr(self._local, "event", None)  # (a thread waits in one acquire at a time)
        if event is None:
            event = self._local.event = Wakeup()
        entry = (priority, seq, me, key, event)
        heapq.heappush(self._waiters, entry)
        told = False
        while True:
            nxt, left = self._next()
            if self._held_by is None and nxt is entry:
                break
            # A wake-up that comes between the release of the mutex and the wait is kept by the
            # event: none is lost.
            timeout = left if self._held_by is None else None
            event.clear()
            self._mutex.release()
            try:
                if not told and self.on_wait is not None:
                    told = True
                    self.on_wait(priority)
                event.wait(timeout=timeout)
            finally:
                self._mutex.acquire()
        self._waiters.remove(entry)
        heapq.heapify(self._waiters)
        return told

    def release(self, reserve: bool = False) -> None:
        self._close_span()
        with self._mutex:
            self._held_by = None
            key = getattr(self._local, "key", None)
            if reserve and key is not None:
                self._reserved, self._reserved_until = key, time.monotonic() + self.GRACE_S
            self._wake_next()

    def tag(self, priority: Tuple[int, int], key: Optional[tuple] = None,
            trace: Optional[Callable[[], ContextManager]] = None) -> None:
        """What the calling thread's work is from now: it takes the lock as such (`take`, and
        back after `released`); if it holds the lock, its span changes with it. (pp_rank 0's
        step body moving from its forward to its backward.)"""
        held = self.held()
        if held:
            self._close_span()
        self._local.priority, self._local.key, self._local.trace = priority, key, trace
        if held:
            self._open_span(trace)

    def take(self) -> None:
        """Take the lock as the calling thread's last `tag` or `acquire` said (nothing if it
        holds it)."""
        if not self.held():
            self.acquire(self._local.priority, self._local.key, trace=self._local.trace)

    def _open_span(self, trace: Optional[Callable[[], ContextManager]]) -> None:
        self._local.trace = trace
        if trace is not None:
            span = self._local.span = trace()
            span.__enter__()

    def _close_span(self) -> None:
        span = getattr(self._local, "span", None)
        if span is not None:
            self._local.span = None
            span.__exit__(None, None, None)

    def held(self) -> bool:
        return self._held_by == threading.get_ident()

    def contested(self, priority: Tuple[int, int]) -> bool:
        """Does work of `priority` or before wait for the lock, or keep a place before it?
        (Its holder then gives it up rather than go on with more work of that priority.)"""
        with self._mutex:
            return bool((self._waiters and self._waiters[0][0] <= priority)
                        or (self._places and self._places[0][0] < priority))

    def waited_for(self) -> bool:
        """Does this thread hold the lock while other work of its priority or before waits
        for it?"""
        # Nothing queued: no need for the mutex, nor for the holder. (Read without it, a waiter
        # that comes at this moment is seen at the holder's next check: a step body checks at
        # every remote call.)
        if not self._waiters and not self._places:
            return False
        return self.held() and self.contested(self._local.priority)

    def give_up_held(self) -> None:
        """(Its holder.) Give the lock up until this thread takes it again (`take`)."""
        if self.on_give_up is not None:
            self.on_give_up()
        self.release()

    def hold(self, priority: Tuple[int, int], key: Optional[tuple] = None,
             more: Optional[Callable[[], bool]] = None,
             place: Optional[tuple] = None) -> ContextManager[None]:
        """Hold the lock for a piece of compute (re-entrant: a holder keeps it); on release,
        reserve it briefly for more work under the same `key` (microbatch, direction) if
        `more()` says more is coming. `place`: the one `keep_place` kept for this work."""
        return _Hold(self, priority, key, more, place)

    def released(self, take_back: bool = True) -> ContextManager[None]:
        """Give the lock up while this thread waits on the network; take it back afterwards
        with the same priority (unless not `take_back`)."""
        return _Released(self, take_back)


class _Released:
    """`ComputeLock.released`'s context (a class: a generator's costs more, at every wait)."""

    __slots__ = ("_lock", "_take_back", "_as")

    def __init__(self, lock: ComputeLock, take_back: bool) -> None:
        self._lock, self._take_back, self._as = lock, take_back, None

    def __enter__(self) -> None:
        lock = self._lock
        if lock.held():
            local = lock._local
            self._as = (local.priority, local.key, local.trace)  # (what it takes it back as)
            lock.give_up_held()

    def __exit__(self, *exc) -> None:
        if self._as is not None and self._take_back:
            priority, key, trace = self._as
            self._lock.acquire(priority, key, trace=trace)


class _Hold:
    """`ComputeLock.hold`'s context (a class: a generator's costs more, around every module call)."""

    __slots__ = ("_lock", "_priority", "_key", "_more", "_place", "_took")

    def __init__(self, lock: ComputeLock, priority: Tuple[int, int], key: Optional[tuple],
                 more: Optional[Callable[[], bool]], place: Optional[tuple]) -> None:
        self._lock, self._priority, self._key, self._more, self._place = (
            lock, priority, key, more, place)
        self._took = False

    def __enter__(self) -> "_Hold":
        lock = self._lock
        if lock.held():
            if self._place is not None:
                lock.give_up(self._place)
            return self
        lock.acquire(self._priority, self._key, self._place)
        self._took = True
        return self

    @property
    def took(self) -> bool:
        """Did this context take the lock (it was not held already)?"""
        return self._took

    def keep(self) -> None:
        """Keep the lock past this context's end (the caller gives it up, or passes it on):
        the work counts as done for `more`."""
        if self._more is not None:
            self._more()
        self._took = False

    def __exit__(self, *exc) -> None:
        if self._took:
            more = self._more
            self._lock.release(reserve=more is not None and more())
