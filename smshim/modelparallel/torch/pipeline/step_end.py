"""A step's beginning and end on the module server: resetting per-step state, waiting for
requests and nested calls to finish, handing fused weight gradients over, and pp_rank 0's end of
a microbatch (fetching its results, telling the peers it is over)."""

from __future__ import annotations

import itertools
import logging
import math
import time
from typing import Any, Callable, List

import torch

from smshim.modelparallel.torch.pipeline.context import ctx
from smshim.modelparallel.torch.pipeline.remote_tensor import RemoteTensor
from smshim.modelparallel.torch.pipeline.scheduler import Schedule
from smshim.modelparallel.torch.pipeline.structure import fill, flatten
from smshim.modelparallel.torch.pipeline.messages import (FWD_DONE, MB_DONE, NESTED_DONE, Message, PipelineError)

logger = logging.getLogger(__name__)


# Handles passed to backward with at most this many elements are fetched ahead (`prefetch`).
_PREFETCH_NUMEL = 64



class StepEnd:
    """A part of `ModuleServer` (server.py), which holds the state these methods share."""


    # Steps ---------------------------------------------------------------------------------
    def begin_step(self, microbatches: int, schedule: Schedule, step: int) -> None:
        self.schedule = schedule
        self._step = step
        self.weight_grads.active = True
        self._expected_microbatches = microbatches
        self._forward_microbatches = set()
        self.lock.clear_places()  # (none are left but after a failed step)
        with self._cond_lock:
            for s in (self._fwd_done, self._mb_done, self._admitted, self._live, self._visited,
                      self._pushers, self._nested_done, self._open_chains):
                s.clear()
            for c in (self._requests, self._forwards, self._graphs, self._regions_done,
                      self._backwards_to_issue):
                c.clear()
            self._first_unadmitted = 0
            self._turn = 0
            self._tickets = itertools.count()
        self.turns.reset()
        self.store.reset_error()


    def wait_idle(self, step: int) -> None:
        """Wait until every request received for the step has been served."""
        self._wait_until(lambda: not any(n > 0 for n in self._requests.values()), lambda: (
            f"{self._waited_at_end(step)} for its requests to finish (requests left by "
            f"microbatch: { {mb: n for mb, n in self._requests.items() if n > 0} })"))


    def has_nested_callers(self) -> bool:
        """May a peer call this rank's modules from inside one of its own?"""
        return bool(self._nested_callers)


    def finish_nested(self, step: int) -> None:
        """At the step's end, once this rank's own requests are served: tell the ranks whose
        modules this rank's may call from inside that no more such calls will come; then wait
        until the ranks that may call this one so have said the same, and serve what they sent.
        (pp_rank 0 may end a step while a nested call's backward, or a forward whose result it
        does not read, still runs on the caller.)"""
        if not (self._nested_callees or self._nested_callers):
            return
        for callee in sorted(self._nested_callees):
            self.transport.send(callee, Message(NESTED_DONE, step))
        self.transport.flush()
        if not self._nested_callers:
            return
        self._wait_until(lambda: self._nested_callers <= self._nested_done, lambda: (
            f"{self._waited_at_end(step)} for pp ranks "
            f"{sorted(self._nested_callers - self._nested_done)}, whose modules call this "
            "rank's from inside, to finish the step"))
        self.wait_idle(step)


    def _waited_at_end(self, step: int) -> str:
        return f"pp rank {self.me} waited {self.timeout_s:.0f} s at the end of step {step}"


    def _wait_until(self, done: Callable[[], bool], error: Callable[[], str],
                    step_down: bool = False) -> None:
        """(Under no lock.) Wait, bounded by the timeout, until `done()` (checked under _cond);
        else fail the pipeline with `error()`. `step_down`: the thread runs a request, and what
        it waits for may be queued behind it (RunQueue.step_down)."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond_lock:
            while not done():
                if step_down:
                    self._runq.step_down()
                self.transport.check()
                if time.monotonic() > deadline:
                    err = PipelineError(error())
                    self.transport.fail(err)
                    raise err
                self._cond.wait(timeout=1.0)


    def flush_weight_grads(self) -> None:
        """The step's fused weight gradients become `.grad` (before any reduction reads them)."""
        self.weight_grads.flush()


    def end_step(self) -> None:
        """Drop graphs whose backward never came (outputs unused, or an eval step) and every
        value kept for the step."""
        with self._cond_lock:
            self._saved.clear()
        self.weight_grads.flush()  # (nothing is left: the step's end flushed before reducing)
        self.weight_grads.active = False
        self.store.clear()
        self._step = -1  # handles kept past the step now say so instead of waiting


    def finish_microbatch(self, mb: int, out: Any, drain: bool = False) -> Any:
        """pp_rank 0: microbatch `mb`'s body returned `out`; returns it with every handle
        replaced by its value (every rank gets the step's results), and tells the peers that the
        microbatch is over, so its values can go, there and here. The fetches and the notice
        leave together: a peer answers a fetch before it sees the notice that follows it, and
        drops nothing that a request still running there will make. A notice that need not go
        with a fetch leaves with the next frame to its peer (the next microbatch's requests, or
        the step's end), or `Transport.hold_s` later: it only lets the peer free memory, and a
        frame of its own cost both ranks' CPU once per microbatch. In the step's `drain` (every
        microbatch's forward is over: the pipeline counts them) the notice has no deadline: no
        forward request comes that it could let a peer admit, and what it frees there goes at
        the step's end anyway (at p = 4, m = 8, 9 frames a step that pp_rank 0's sender thread
        posted alone)."""
        template, tensors = flatten(out)
        handles = [t for t in tensors if isinstance(t, RemoteTensor)]
        with self.transport.together():
            for t in handles:
                self._ask(t._cell, hold=True)
            for peer in self.transport.peers:
                self.transport.send_later(peer, Message(MB_DONE, ctx.step, mb),
                                          deadline=not drain)
        if handles:
            out = fill(template, [self._real(t) for t in tensors])
        self.store.drop_microbatch(mb, keep_nested=True)
        return out


    def prefetch(self, tensors: List[torch.Tensor]) -> None:
        """pp_rank 0: ask now for the values of the small handles a microbatch runs backward
        from (its loss): the step function usually returns them, and fetched only when the
        microbatch ends they would cost the last one a round trip at the step's end. A value
        whose owner will push this rank a gradient of the microbatch comes with that gradient:
        a frame less each way per microbatch (on one core per rank, 13 % of a step of tiny
        modules), and this rank's backward waits for that gradient anyway."""
        with self._cond_lock:
            pushers = self._pushers.pop(ctx.microbatch, set())
        for t in tensors:
            if isinstance(t, RemoteTensor) and math.prod(t.shape) <= _PREFETCH_NUMEL:
                self._ask(t._cell, hold=True, later=t._cell.owner in pushers)


    def forward_done(self, mb: int) -> None:
        """pp_rank 0: microbatch `mb` will make no more forward calls. The peers it called learn
        it from its first backward request (or MB_DONE); the others are told now, so they can
        take the next microbatch."""
        for chain in self._open_chains.pop(mb, ()):
            chain.inputs = None  # (see `_Chain`: no call links to it now)
        with self._cond_lock:
            visited = self._visited.pop(mb, set())
        for peer in self.transport.peers:
            if peer not in visited:
                self.transport.send(peer, Message(FWD_DONE, ctx.step, mb))
