"""Admission: how many microbatches a rank holds at once (`interleaved`: 1F1B's p - r), which
microbatch may start its forward next, and when a microbatch's values and graphs may go."""

from __future__ import annotations

import logging
import time

from smshim.modelparallel.torch.pipeline.context import ctx
from smshim.modelparallel.torch.pipeline.messages import (FWD_REQ, Message, PipelineError)
from smshim.modelparallel.torch.pipeline.value_store import _nested_key

logger = logging.getLogger(__name__)


class Admission:
    """A part of `ModuleServer` (server.py), which holds the state these methods share."""


    def _more_regions(self, kind: str, mb: int) -> bool:
        """Count a module run here for microbatch `mb` in direction `kind`; does this rank
        expect more for it? (As many as the microbatch that needed the most, learned as the
        steps go: a stage's share of a microbatch's calls is the same every time.) Called by
        the compute lock's holder only, as it gives the lock up: no other lock needed."""
        n = self._regions_done[(kind, mb)] = self._regions_done[(kind, mb)] + 1
        per_mb = self._regions_per_mb
        if n > per_mb[kind]:
            per_mb[kind] = n
        return n < per_mb[kind]


    def _priority(self, kind: str, mb: int):
        return self.schedule.priority(kind, mb) if self.schedule else (0, mb)


    def _note_backward_begun(self, mb: int) -> None:
        if ctx.driver and not self.turns.has_begun(mb):
            self.turns.backward_begun(mb)


    # Admission (interleaved: bounded activations per rank) ---------------------------------
    def _admit(self, mb: int, step: int) -> None:
        """Hold back the first forward of a new microbatch while this rank holds as many as the
        schedule allows. New microbatches are taken in order (a lower one first, unless its
        forward is over and none of its forward requests came here), so no microbatch can be
        overtaken by one that then waits for it. (The run queue starts no forward that would
        wait here; a thread that took one before another was admitted waits.)"""
        if mb in self._admitted:  # (every forward of a microbatch after its first: it stays so)
            return
        deadline = time.monotonic() + self.timeout_s
        with self._cond_lock:
            while not self._admissible_locked(mb):
                self._runq.step_down()  # (what it waits for may be queued behind it)
                self.transport.check()
                if time.monotonic() > deadline:
                    raise PipelineError(
                        f"pp rank {self.me} waited {self.timeout_s:.0f} s to start the forward of "
                        f"microbatch {mb} (step {step}): it holds microbatches "
                        f"{sorted(self._live)} whose backward has not come (admitted "
                        f"{sorted(self._admitted)}, forward over {sorted(self._fwd_done)}, graphs "
                        f"kept {dict(self._graphs)}, forwards queued {dict(self._forwards)})")
                self._cond.wait(timeout=1.0)
            if mb not in self._admitted:
                self._admitted.add(mb)
                self._live.add(mb)


    def _admissible_locked(self, mb: int) -> bool:
        """(Under _cond.) May microbatch `mb`'s forward start here now (see `_admit`)?"""
        admitted = self._admitted
        if mb in admitted:
            return True
        limit = self.schedule.limit(self.me) if self.schedule else 1 << 30
        if len(self._live) >= limit:
            return False
        # Microbatches stay admitted until the step's end: below the first one that is not, each
        # is (a check per earlier microbatch, each time a forward may start, cost O(m) a time).
        first = self._first_unadmitted
        while first in admitted:
            first += 1
        self._first_unadmitted = first
        return first >= mb or all(
            j in admitted or (j in self._fwd_done and self._forwards[j] <= 0)
            for j in range(first, mb))


    def _may_start(self, msg: Message) -> bool:
        """May the run queue start this request now? Not the forward of a microbatch the
        schedule does not admit yet: it stays queued (no thread waits in `_admit` for it)."""
        if msg.kind != FWD_REQ or msg.src != 0:
            return True
        with self._cond_lock:
            return self._admissible_locked(msg.microbatch)


    def _release_if_done(self, mb: int) -> None:
        # (under self._cond) A microbatch stops counting against the limit once its forward is
        # over (pp_rank 0 said so and no forward request of it is left) and no graph is kept.
        if mb in self._live and mb in self._fwd_done and self._forwards[mb] <= 0 \
                and self._graphs[mb] <= 0:
            self._live.discard(mb)


    def _drop_if_done(self, mb: int) -> None:
        # (under self._cond) pp_rank 0 has finished the microbatch and no request of it is left:
        # nothing can ask for its values any more, and a graph still kept (an output that did
        # not reach the loss, or a forward-only step with grad enabled) will get no backward.
        # Not so for nested calls (made by another rank than 0), whose caller may still be
        # running: their values and graphs stay until the step's end (finish_nested).
        if mb in self._mb_done and self._requests[mb] <= 0:
            self.store.drop_microbatch(mb, keep_nested=True)
            for key in [k for k, saved in self._saved.items()
                        if saved[2] == mb and not _nested_key(k)]:
                del self._saved[key]
            self._graphs[mb] = 0
            self._live.discard(mb)
