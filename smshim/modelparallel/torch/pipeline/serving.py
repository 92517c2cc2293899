"""The owner's side of the module server: a request whose inputs are here waits in the run
queue, then runs the real module (forward, keeping its graph) or its backward under the compute
lock, and its results leave for whoever needs them before the lock is given up."""

from __future__ import annotations

import contextlib
import logging
import pickle
from typing import Any, Callable, Dict, List, Optional

import torch

from smshim.modelparallel.torch.pipeline.calls import (
    PREDICT_ENV,
    _describe,
    _expectation,
)
from smshim.modelparallel.torch.pipeline.context import _serving, ctx
from smshim.modelparallel.torch.pipeline.remote_tensor import RemoteTensor
from smshim.modelparallel.torch.pipeline.scheduler import BACKWARD, FORWARD
from smshim.modelparallel.torch.pipeline.structure import fill, flatten, loads_template
from smshim.modelparallel.torch.pipeline.messages import (FWD_REPLY, FWD_REQ, VALUE, Message, PipelineError)
from smshim.modelparallel.torch.precision import autocast_state
from smshim.modelparallel.torch.state import state

logger = logging.getLogger(__name__)


def _needs(msg: Message) -> List[Any]:
    """The store keys a FWD_REQ / BWD_REQ waits for."""
    keys: List[Any] = []
    made: tuple = ()  # (the calls of the request whose outputs a follow-on takes)

    def refs(enc):
        if enc is None:
            return
        if enc[0] == "r":
            key = enc[1]
            if not (key[1] in made and key[0] == msg.src and key[2] == "out"):
                keys.append(key)
        elif enc[0] == "s":
            for term in enc[1]:
                refs(term)

    if msg.kind == FWD_REQ:
        for e in msg.meta[1]:
            refs(e)
        if msg.meta[8]:  # follow-ons (calls.py, `_follow_on`): their own inputs count
            made = (msg.call_id,)
            for call in msg.meta[8]:
                for e in call[3]:
                    refs(e)
                made += (call[0],)
    else:
        keys.append((msg.src, msg.meta[4], "fwd", 0))  # (the anchor of its forward's request)
        for e in msg.meta[0]:
            refs(e)
    return keys


def _run_backward(outputs: List[torch.Tensor], grads: List[torch.Tensor],
                  retain: bool = False) -> None:
    """`torch.autograd.backward` without its argument checks, which cost a fifth of a small
    module's backward (~30 µs of ~150): the gradients come from the caller's autograd, shaped and
    typed by these outputs' metadata, and always given."""
    torch.autograd.Variable._execution_engine.run_backward(
        tuple(outputs), tuple(grads), retain, False, (), allow_unreachable=True,
        accumulate_grad=True)


def _links(enc: list, src: int, me: int) -> List[tuple]:
    """(input i, call id, output j) for each input of a request from `src` that is output j of
    an earlier call of `src`'s served here: how a chain's backward passes gradients down."""
    return [(i, e[1][1], e[1][3]) for i, e in enumerate(enc)
            if e is not None and e[0] == "r" and e[2] == me and e[1][0] == src
            and e[1][2] == "out"]


def _joins(saved: Optional[tuple], links: List[tuple], below: int,
           requires: List[bool]) -> Dict[int, torch.Tensor]:
    """The inputs (by index) that are call `below`'s outputs (`links`) and need a gradient,
    each as that output is in its graph (`saved`; none without it). The call takes them as they
    are, not their values: one autograd graph then spans the two calls, as it would in one
    process. (The call runs with grad enabled: an input that needs a gradient is one that
    `requires` says needs it.)"""
    joins: Dict[int, torch.Tensor] = {}
    if saved is not None:
        outs = saved[1]
        for i, cid, j in links:
            if cid == below and requires[i] and outs[j].requires_grad:
                joins[i] = outs[j]
    return joins


# No input joined: `_forward_call`'s and `_execute_forward`'s default (never written to).
_NO_JOINS: Dict[int, torch.Tensor] = {}


def _pairs(outs: List[torch.Tensor], grads: List[Optional[torch.Tensor]]) -> List[tuple]:
    """The outputs a gradient came for, with it."""
    return [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]


def _grads_below(inputs: List[torch.Tensor], links: List[tuple], below: int,
                 n: int) -> List[Optional[torch.Tensor]]:
    """The gradients of call `below`'s `n` outputs, from those of the inputs that took them
    (read and cleared: a chain's graphs may be backpropagated again: calls.py, `_Chain`)."""
    grads: List[Optional[torch.Tensor]] = [None] * n
    for i, cid, j in links:
        if cid == below:
            g, inputs[i].grad = inputs[i].grad, None
            if g is not None:
                grads[j] = g if grads[j] is None else grads[j] + g
    return grads



class OwnerSide:
    """A part of `ModuleServer` (server.py), which holds the state these methods share."""


    # Owner side ----------------------------------------------------------------------------
    def _ready(self, msg: Message) -> None:
        """A request's inputs are all here: into the run queue. If no thread runs it, this one
        will when it can (it dispatches a frame, or serves a request: see RunQueue.put); else a
        pool thread."""
        if self.timeline.enabled:
            self.timeline.instant(f"ready {msg.kind} {msg.module}", "ready",
                                  microbatch=msg.microbatch, step=msg.step)
        key = _serving.chain_key
        if key is not None and _serving.candidate is None and msg.src == 0 \
                and self._request_key(msg) == key:
            # The next call of the chain this thread serves, made ready by its results: `_chain`
            # runs it next or queues it (a few µs of queue work a request, which in the
            # pipeline, cache-cold, cost many times that).
            _serving.candidate = msg
            return
        self._runq.put(self._request_priority(msg), msg, here=_serving.here)


    def _hold_place_for_next(self) -> None:
        """(The runner, holding the compute lock.) The request it runs next keeps its place in
        the lock's queue from now: work of a larger priority (the weight gradients' thread, a
        request back from a wait) does not take the lock in between."""
        if not self._runq.is_runner():
            return
        nxt = self._runq.peek()
        if nxt is not None and getattr(nxt, "place", None) is None:
            nxt.place = self.lock.keep_place(self._request_priority(nxt), self._request_key(nxt))


    def _request_key(self, msg: Message) -> tuple:
        return (FORWARD if msg.kind == FWD_REQ else BACKWARD, msg.microbatch)


    def _request_priority(self, msg: Message):
        return self._priority(*self._request_key(msg))


    def _serve(self, msg: Message) -> None:
        """(On the run queue's thread.) Serve `msg`, then the requests chained to it: the next
        ones of the same microbatch and direction from pp_rank 0, taken from the run queue as
        each one ends, with the compute lock kept from one to the next (`_chain`)."""
        _serving.here = _serving.chains = True
        try:
            while msg is not None:
                _serving.next = None
                self._serve_one(msg)
                msg = _serving.next
        finally:
            if _serving.next is not None:  # (a failure after the next one was taken)
                self._unqueue(_serving.next)
                _serving.next = None
            if _serving.kept is not None:
                more, _serving.kept = _serving.kept, None
                if self.lock.held():
                    self.lock.release(reserve=more())
            _serving.here = _serving.chains = False


    def _serve_one(self, msg: Message) -> None:
        ctx.step, ctx.microbatch, ctx.in_step = msg.step, msg.microbatch, True
        state.microbatch = msg.microbatch
        try:
            if msg.kind == FWD_REQ:
                self._serve_forward(msg)
            else:
                self._serve_backward(msg)
        except BaseException as e:  # noqa: BLE001
            if not (isinstance(e, PipelineError) and self.transport.error is not None):
                err = PipelineError(f"pp rank {self.me} failed running the {msg.describe()} "
                                    f"requested by pp rank {msg.src}: {type(e).__name__}: {e}")
                logger.exception("%s", err)
                self.transport.fail(err)
        finally:
            self._unqueue(msg)
            self._runq.poke(here=True)  # (this thread runs the queue next)


    def _unqueue(self, msg: Message) -> None:
        """A request is over (served, or failed): it counts no more."""
        if getattr(msg, "place", None) is not None:
            self.lock.give_up(msg.place)  # (if it failed before taking it)
        with self._cond_lock:
            self._requests[msg.microbatch] -= 1
            if msg.kind == FWD_REQ:
                self._forwards[msg.microbatch] -= 1
                self._release_if_done(msg.microbatch)
            self._drop_if_done(msg.microbatch)
            self._cond.notify_all()


    def _chain(self, hold, kind: str, mb: int, src: int) -> None:
        """(The runner, holding the compute lock, at the end of a module's forward or backward
        for pp_rank 0, its results delivered.) If the request it would run next is the same
        microbatch's next call in the same direction (a stage's modules, called one after
        another), and nothing else waits for the lock at that priority, take it from the run
        queue and keep the lock for it: `_serve` runs it next, without the lock's hand-over and
        the queue's round (3 % of a stage's CPU on tiny modules: docs/benchmarks.md). Else the
        next request keeps its place in the lock's queue (`_hold_place_for_next`)."""
        candidate, _serving.candidate = _serving.candidate, None
        kept = _serving.kept
        if src == 0 and not self.deterministic and _serving.chains \
                and (kept is not None or hold.took) and self._runq.is_runner() \
                and not self.lock.contested(priority := self._priority(kind, mb)):
            if candidate is not None and self._runq.first_is_after(priority):
                nxt = candidate  # (what take_next would take, had it been queued)
            else:
                if candidate is not None:  # (its priority: the same key's)
                    self._runq.put(priority, candidate, here=True)
                    candidate = None  # (queued: once)
                nxt = self._runq.take_next(lambda m: m.src == 0
                                           and self._request_key(m) == (kind, mb))
            if nxt is not None:
                _serving.next = nxt
                if kept is None:  # (the chain's first: its hold gives the lock up no more)
                    _serving.kept = lambda: self._more_regions(kind, mb)
                    hold.keep()
                else:
                    self._more_regions(kind, mb)  # (counted as the first's hold would)
                return
        if candidate is not None:
            self._runq.put(self._request_priority(candidate), candidate, here=_serving.here)
        self._hold_place_for_next()


    def _deliver(self, deliver: Callable[..., None], args: tuple,
                 chain_key: Optional[tuple]) -> None:
        """`deliver(*args)`. `chain_key`: (direction, microbatch) of pp_rank 0's request being
        served, if `_chain` runs next: a request of the same key that the results make ready is
        kept for it (`_ready`); it is the next call of the chain. (The microbatch is admitted:
        the candidate may start. Not under deterministic_server, whose requests go through the
        queue in the order they became ready.)"""
        _serving.chain_key = chain_key if _serving.chains and not self.deterministic else None
        try:
            deliver(*args)
        except BaseException:
            self._queue_candidate()
            raise
        finally:
            _serving.chain_key = None


    def _queue_candidate(self) -> None:
        """No `_chain` now (the work that made it ready failed): the request kept for it
        (`_ready`) waits in the run queue, as it would have without the chain."""
        candidate, _serving.candidate = _serving.candidate, None
        if candidate is not None:
            self._runq.put(self._request_priority(candidate), candidate, here=_serving.here)


    def _what(self, msg: Message, direction: str, module: Optional[str] = None) -> str:
        """The request's (or, `module`, one of its calls') forward or backward, for errors."""
        return (f"{direction} of module '{msg.module if module is None else module}' "
                f"(microbatch {msg.microbatch}, step {msg.step})")


    def _serve_forward(self, msg: Message) -> None:
        """Run the request's call, and the calls of its chain that came inside it (calls.py,
        `_follow_on`), one after another in one turn of the compute lock, without each one's
        dispatch, queueing and lock turn; then `_chain` looks for the next request to serve in
        this turn. The request's forward anchor, which the backward of any of its calls waits
        for (`_needs`), is put once they have all run: no backward could run sooner, for want
        of the lock."""
        template_bytes, enc, requires, grad_enabled, reply, expect, amp, below, more = msg.meta
        mb = msg.microbatch
        if msg.src == 0:
            self._admit(mb, msg.step)
        with self.lock.hold(self._priority(FORWARD, mb), (FORWARD, mb),
                            lambda: self._more_regions(FORWARD, mb),
                            getattr(msg, "place", None)) as hold:
            try:
                self._forward_call(msg, msg.call_id, msg.module, template_bytes, enc,
                                   requires, grad_enabled, reply, expect, amp, below)
                for call_id, module, template_bytes, enc, requires, grad_enabled, expect, amp, \
                        below in more:
                    # Each call counts as a module run (the hold counts the last), as when
                    # each came alone: else the lock stays reserved for more of them.
                    self._more_regions(FORWARD, mb)
                    msg.module = module  # (`_serve_one`'s error names the module that failed)
                    self._forward_call(msg, call_id, module, template_bytes, enc, requires,
                                       grad_enabled, None, expect, amp, below)
                self.store.put((msg.src, msg.call_id, "fwd", 0), self._anchor, mb)
            except BaseException:
                self._queue_candidate()
                raise
            self._chain(hold, FORWARD, mb, msg.src)


    def _forward_call(self, msg: Message, call_id: int, module: str, template_bytes: bytes,
                      enc: list, requires: List[bool], grad_enabled: bool,
                      reply: Optional[str], expect: Optional[bytes], amp,
                      below: Optional[int]) -> None:
        """One call of request `msg` (its own, or a follow-on's), the compute lock held:
        `module` runs on the inputs that `enc` names; its results are delivered, then its
        forward is marked done."""
        what = lambda: f"an input of the {self._what(msg, 'forward', module)}"  # noqa: E731
        src = msg.src
        links = _links(enc, src, self.me) if src == 0 else ()
        # A chain's later call takes the outputs of the call below as they are in its graph
        # (`_joins`): those need no decoding (nor, in `_execute_forward`, cutting from a graph).
        joins = _joins(self._saved.get((src, below)), links, below, requires) \
            if below is not None and src == 0 and grad_enabled else _NO_JOINS
        # (An inline tensor without `_decode`'s call: most inputs of a request.)
        tensors = [joins[i] if i in joins else msg.tensors[e[1]]
                   if e is not None and e[0] == "t"
                   else self._decode(e, msg.tensors, src, what) for i, e in enumerate(enc)]
        template = loads_template(template_bytes)

        def deliver(out_template, outs, out_rg) -> None:
            metas, values = [], []  # (one loop: a comprehension is a call, on every module run)
            for t, rg in zip(outs, out_rg):
                metas.append((tuple(t.shape), t.dtype, rg))
                values.append(t.detach())
            if expect is not None and _expectation(out_template, metas) != expect:
                expected = pickle.loads(expect)
                raise PipelineError(
                    f"module '{module}' (microbatch {msg.microbatch}, step {msg.step}) "
                    f"returned {_describe(out_template, metas)}, but for inputs of the same "
                    f"shapes it returned {_describe(*expected)} before. smshim runs modules on "
                    "other ranks ahead of the caller, predicting their outputs' structure and "
                    "shapes from the input shapes; for a module whose outputs depend on input "
                    f"values, set {PREDICT_ENV}=0")
            if reply is not None:
                self.transport.send(msg.src, Message(
                    FWD_REPLY, msg.step, msg.microbatch, call_id, module,
                    meta=(out_template, metas), tensors=values if reply == "data" else []))
            if reply != "data":  # handles on the caller: keep the values for whoever needs them
                for i, t in enumerate(values):
                    self._keep((msg.src, call_id, "out", i), t, msg.microbatch, msg.step)

        self._execute_forward(src, call_id, module, msg.step, msg.microbatch,
                              template, tensors, requires, grad_enabled, deliver, amp=amp,
                              links=links, below=below if joins else None, joins=joins)


    def _serve_backward(self, msg: Message) -> None:
        enc, push, through, retain, request = msg.meta
        what = lambda: f"a gradient for the {self._what(msg, 'backward')}"  # noqa: E731
        # The forward may still be queued here (requests do not wait for each other's replies).
        self._get_value((msg.src, request, "fwd", 0), self.me,
                        lambda: self._what(msg, "forward"))
        grads = [self._decode(e, msg.tensors, msg.src, what) for e in enc]
        ticket = getattr(msg, "ticket", None)
        if ticket is not None:
            self._wait_until(lambda: self._turn == ticket, lambda: (
                f"pp rank {self.me} waited {self.timeout_s:.0f} s to run the "
                f"{self._what(msg, 'backward')} in its turn (deterministic_server: backward "
                f"{ticket} of the step here, at {self._turn})"), step_down=True)

        def deliver(in_grads) -> None:
            for i, g in enumerate(in_grads):
                if g is None:
                    continue
                key = (msg.src, msg.call_id, "igrad", i)
                if i in push:
                    self.transport.send(msg.src, Message(VALUE, msg.step, msg.microbatch,
                                                         module=msg.module, meta=key, tensors=[g]))
                # Kept even when pushed: the caller's autograd may pass the gradient on unread
                # (the backward of a glue add) to another call, which then names it by key here.
                self._keep(key, g, msg.microbatch, msg.step)

        try:
            self._execute_backward(msg.src, msg.call_id, msg.module, msg.step, msg.microbatch,
                                   grads, deliver, place=getattr(msg, "place", None),
                                   through=through, retain=retain)
        finally:
            if ticket is not None:
                with self._cond_lock:
                    self._turn += 1
                    self._cond.notify_all()


    def _keep(self, key, value: torch.Tensor, mb: int, step: int) -> None:
        """Hold a value for peers; send it to those who asked for it already."""
        wanted = self.store.put(key, value, mb)
        if wanted:
            for dst, later in wanted:
                self._send_value(dst, key, value, mb, step, later)


    def _execute_forward(self, caller: int, call_id: int, name: str, step: int, mb: int,
                         template: Any, tensors: List[torch.Tensor], requires: List[bool],
                         grad_enabled: bool, deliver: Optional[Callable[..., None]] = None,
                         amp: autocast_state.State = None, links=(),
                         below: Optional[int] = None,
                         joins: Dict[int, torch.Tensor] = _NO_JOINS):
        """(The compute lock held: `_serve_forward`.) Run module `name` on inputs cut from the
        caller's graph; keep the graph for backward. `deliver(out_template, outs, out_rg)` runs
        as soon as the module has returned, before its graph is kept (a result on its way to
        the next stage is on the critical path; nothing that reads the kept graph can run
        before this thread gives the compute lock up, and a backward waits for the forward's
        anchor, put after this returns). `amp`: the caller's autocast state. `links`: which
        inputs are outputs of earlier calls here (`_links`), kept with the graph. `below`: the
        call before this one in its chain (calls.py, `_Chain`), whose outputs this one takes as
        they are in its graph (`joins`: those inputs, by index, in `tensors` already): the
        chain's graphs are one, and its backward one pass of autograd (`_execute_backward`)."""
        inputs = [t if i in joins else t.detach().requires_grad_(rg and grad_enabled)
                  if (t.is_floating_point() or t.is_complex()) else t
                  for i, (t, rg) in enumerate(zip(tensors, requires))]
        args, kwargs = fill(template, inputs)
        if amp is None and not self.timeline.enabled \
                and grad_enabled == torch.is_grad_enabled():
            # (The usual case: no context to enter, each a Python call or two.)
            out = self.real_forward(name)(*args, **kwargs)
        else:
            with self.timeline.span(name or "<root>", "forward", microbatch=mb, step=step,
                                    caller=caller), \
                    torch.set_grad_enabled(grad_enabled), autocast_state.applied(amp):
                out = self.real_forward(name)(*args, **kwargs)
        out_template, outs = flatten(out)
        # The results leave this rank as values (handles live on pp_rank 0 only, and its
        # own modules run in its step bodies, not here). A handle that is part of the graph
        # (a lazy sum of a call's output and a value, say) is read through its dispatch
        # (`clone`), which keeps it there: its raw value would cut the backward off from
        # the module's parameters.
        out_rg, any_rg = [], False
        for i, t in enumerate(outs):  # (`flatten`'s list, this call's own)
            if isinstance(t, RemoteTensor):
                outs[i] = t = t.clone() if t.requires_grad else t.materialize()
            rg = grad_enabled and t.requires_grad
            out_rg.append(rg)
            any_rg = any_rg or rg
        if deliver is not None:
            self._deliver(deliver, (out_template, outs, out_rg),
                          (FORWARD, mb) if caller == 0 else None)
        if any_rg:
            with self._cond_lock:
                self._forward_microbatches.add(mb)
                self._saved[(caller, call_id)] = (inputs, outs, mb, links, below)
                if caller == 0:  # (a nested call's graph lives until the step's end)
                    self._graphs[mb] += 1
                    if self._graphs[mb] == 1:
                        # Microbatches whose activations this rank holds (for the memory
                        # benchmark): a graph counts until its backward is over, not only
                        # until one starts waiting for the compute lock.
                        live = sum(1 for n in self._graphs.values() if n > 0)
                        self.peak_live_microbatches = max(self.peak_live_microbatches, live)
        return out_template, outs, out_rg


    def _execute_backward(self, caller: int, call_id: int, name: str, step: int, mb: int,
                          grads: List[Optional[torch.Tensor]],
                          deliver: Optional[Callable[[list], None]] = None,
                          place: Optional[tuple] = None, through=(),
                          retain: bool = False) -> List[Optional[torch.Tensor]]:
        """Backward through the graph kept for (caller, call_id), then through those of the
        calls below it in its chain (`through`: (call id, module), nearest first; calls.py,
        `_Chain`); returns the input gradients of the last of them (zeros for an input that needs
        one but which the outputs' gradients did not reach), after `deliver(in_grads)`, which
        runs before the compute lock is given up. `retain`: the graphs stay for another backward
        (until the microbatch is over)."""
        with self._cond_lock:
            saved = self._graph_locked((caller, call_id), retain)
            if saved is None:
                return []
            self._backwards_running += 1
        try:
            inputs, outs, _, links, joined = saved
            pairs = _pairs(outs, grads)
            with (self.lock.hold(self._priority(BACKWARD, mb), (BACKWARD, mb),
                                 lambda: self._more_regions(BACKWARD, mb), place)
                  if pairs else contextlib.nullcontext()) as hold:
                self._backprop(pairs, self._joined_name(name, caller, joined, through)
                               if joined is not None and self.timeline.enabled else name,
                               caller, step, mb, retain)
                for below, below_name in through:
                    inputs, links, joined = self._backward_below(
                        caller, below, below_name, step, mb, inputs, links, retain,
                        joined == below)
                in_grads = [(t.grad if t.grad is not None else torch.zeros_like(t))
                            if t.requires_grad else None for t in inputs]
                if retain:
                    for t in inputs:
                        t.grad = None
                if deliver is not None:
                    self._deliver(deliver, (in_grads,),
                                  (BACKWARD, mb) if caller == 0 and pairs else None)
                if pairs:
                    self._chain(hold, BACKWARD, mb, caller)
        finally:
            with self._cond_lock:
                self._backwards_running -= 1
                if caller == 0 and not retain:
                    self._graphs[mb] -= 1
                self._release_if_done(mb)
                self._cond.notify_all()
                # (A rank that serves nested calls learns that their backwards are over only
                # at the step's end: it reduces then.)
                done = (not self._saved and self._backwards_running == 0
                        and len(self._forward_microbatches) >= self._expected_microbatches
                        and not self._nested_callers)
            # A queued forward may now be admitted: a thread serving requests runs it next.
            self._runq.poke(here=_serving.here)
        if done:
            self.weight_grads.flush()
            if self.on_local_backward_done is not None:
                self.on_local_backward_done()
        return in_grads


    def _backward_below(self, caller: int, call_id: int, name: str, step: int, mb: int,
                        above_inputs: List[torch.Tensor], above_links: List[tuple],
                        retain: bool, joined: bool) -> tuple:
        """(In a chain's backward, the lock held.) Backward through the graph of the chain's
        call below the one whose inputs are `above_inputs`; returns its inputs, links and the
        call it is joined to. `joined`: the call above took this one's outputs into its graph
        (`_joins`), and the backward above went through it already."""
        with self._cond_lock:
            saved = self._graph_locked((caller, call_id), retain)
            if saved is not None and caller == 0 and not retain:
                self._graphs[mb] -= 1
        if saved is None:
            raise PipelineError(
                f"pp rank {self.me} has no graph for the forward of module '{name}' (microbatch "
                f"{mb}, step {step}) to backpropagate through, in the backward of the calls "
                f"that followed it")
        inputs, outs, _, links, below = saved
        if not joined:
            grads = _grads_below(above_inputs, above_links, call_id, len(outs))
            self._backprop(_pairs(outs, grads), name, caller, step, mb, retain)
        return inputs, links, below


    def _joined_name(self, name: str, caller: int, joined: int, through: tuple) -> str:
        """The timeline's name for a backward from module `name` that goes on through the
        calls below it joined to it (`_joins`): "name … the lowest of them"."""
        lowest = name
        for below, below_name in through:
            if joined != below:
                break
            lowest = below_name
            saved = self._saved.get((caller, below))
            joined = saved[4] if saved is not None else None
        return f"{name} … {lowest}"


    def _graph_locked(self, key: tuple, retain: bool) -> Optional[tuple]:
        """(Under _cond.) The graph kept for `key`: taken, or left for another backward."""
        return (self._saved.get if retain else self._saved.pop)(key, None)


    def _backprop(self, pairs: List[tuple], name: str, caller: int, step: int, mb: int,
                  retain: bool) -> None:
        """Backward from (output, gradient) `pairs` of module `name`'s graph (none: nothing)."""
        if pairs:
            with self.timeline.span(name or "<root>", "backward", microbatch=mb, step=step,
                                    caller=caller):
                _run_backward([o for o, _ in pairs], [g for _, g in pairs], retain)
