"""`SenderThread`: a rank's one background thread on the sending side, for all its peers.

It does two things that the threads that send do not wait for (transport.py):
- posts held messages when they are due. A held message (`Transport.send(hold=True)`,
  `send_later`) leaves with the next frame to its peer, or at the latest `hold_s` after its
  peer's outbox began holding. Holds come in runs (pp_rank 0 during a step holds messages for
  every peer, every microbatch), so for `linger_s` after the last deadline the thread wakes every
  `hold_s` by itself, and a hold set meanwhile needs no notify (a thread switch); after that it
  sleeps until told.
- waits for posted frames to complete (their buffers live until then) once one is waited for
  (`send(wait=True)`) or many are posted: `reap(peer, box)`, called for every peer.
One thread for all peers: with one per peer, pp_rank 0's sender threads at p = 8 woke ~2,900
times in a 1.3 s step of sleep stages (7 threads, each every 5 ms), 76-88 ms of CPU and 300-345 ms
waiting for a core, on 2 cores shared by 8 processes; one thread: ~330 wakes, 36-38 ms and
42-66 ms (`benchmarks/pipeline_threads.py`). A frame that is slow to complete (a large one to a
busy peer) delays the other peers' deadlines by as long: they bound a delay that saves frames,
they do not promise a latency."""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from smshim.modelparallel.torch.pipeline.outbox import NEVER, Outbox


class SenderThread:
    """Posts each outbox's held messages (`post(peer, box)`) once its `hold_until` has come, and
    waits for posted frames (`reap(peer, box)`, every peer) when told to (`reap_wanted`)."""

    def __init__(self, boxes: Dict[int, Outbox], post: Callable[[int, Outbox], None],
                 reap: Callable[[int, Outbox], None], hold_s: float, linger_s: float,
                 name: str) -> None:
        self._boxes = list(boxes.items())
        self._post = post
        self._reap = reap
        self._hold_s = hold_s
        self._linger_s = linger_s
        self._cond = threading.Condition(threading.Lock())
        self._wakes_at = NEVER  # when this thread's wait ends by itself (NEVER: not waiting)
        self._last_deadline = -NEVER
        self._reap_wanted = False
        self._stopped = False
        self.thread = threading.Thread(target=self._loop, daemon=True, name=name)
        self.thread.start()

    def held(self, until: float) -> None:
        """An outbox began holding, until `until` (its `hold_until`, set before this call)."""
        with self._cond:
            if until > self._last_deadline:
                self._last_deadline = until
            if self._wakes_at > until:  # (else it wakes in time by itself)
                self._cond.notify()

    def reap_wanted(self) -> None:
        """A posted frame is waited for, or many are posted: wait for them."""
        with self._cond:
            self._reap_wanted = True
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _next(self) -> Optional[Tuple[List[Tuple[int, Outbox]], bool]]:
        """(Under `_cond`.) Wait until an outbox's deadline has come or frames are to be waited
        for; the outboxes that are due and whether to reap, or None once stopped. A `hold_until`
        is set before `held` takes `_cond`, so a scan here either sees it or is followed by
        `held`'s notify."""
        while not self._stopped:
            now = time.monotonic()
            wake = NEVER
            for _, box in self._boxes:
                until = box.hold_until  # (read unlocked: `_post` re-reads it under the box's lock)
                if until is not None and until < wake:
                    wake = until
            reap, self._reap_wanted = self._reap_wanted, False
            if wake <= now or reap:
                return [(peer, box) for peer, box in self._boxes
                        if box.hold_until is not None and box.hold_until <= now], reap
            if wake == NEVER and now - self._last_deadline < self._linger_s:
                wake = now + self._hold_s
            self._wakes_at = wake
            self._cond.wait(timeout=None if wake == NEVER else wake - now)
            self._wakes_at = NEVER
        return None

    def _loop(self) -> None:
        while True:
            with self._cond:
                work = self._next()
            if work is None:  # (stopped)
                return
            due, reap = work
            for peer, box in due:
                self._post(peer, box)
            if reap:
                for peer, box in self._boxes:
                    self._reap(peer, box)
