"""The module server: calls to modules owned by another pipeline rank become requests to it.

After partitioning, every module this rank does not own gets an instance-level `forward` that
forwards the call to the owner (`nn.Module.__call__` looks `forward` up on the instance). The owner
runs the real module on the received inputs, marked `requires_grad` where the caller's were, and
keeps inputs and outputs until the backward.

**Results stay where they were computed.** On pp_rank 0, which runs the step body and the root
module's forward, a remote call does not wait: it sends the request and returns `RemoteTensor`
handles (remote_tensor.py) shaped like the outputs the module gave for the same input shapes
before (the owner checks that the prediction holds; the first call with new shapes waits for the
output metadata). Passing a handle to another module of its owner costs nothing; passing it to a
module on rank k makes the owner send it straight to k (SEND_TO); reading it in the glue code
fetches it (FETCH). So a chain of stages sends each activation once, from stage to stage, while
rank 0's code runs ahead like a host queueing kernels on a device stream.

**Autograd spans ranks** through `_RemoteCall`, an autograd.Function standing for the call in the
caller's graph. Its backward sends the output gradients (real, or handles to gradients held by
other ranks) in a BWD_REQ and returns handles to the input gradients the owner will compute, so
rank 0's autograd engine walks the whole pipeline's graph without waiting, while the gradients
travel owner to owner; rank 0 waits only where its own modules need a gradient, which the owner
then pushes unasked. Parameter gradients accumulate where the parameters live. A zero-size
"anchor" input that requires grad makes the call part of the graph even when none of its real
inputs do (the first stage's inputs are data), so the owner's parameters still get their backward.

Calls made from inside a module on another rank (nested calls) wait for real values, as a plain
synchronous request: handles only live on pp_rank 0, which knows when a microbatch is over
(MB_DONE) and so when every rank may drop the values it kept for it. A nested call may run after
pp_rank 0 has ended the step (its backward, when pp_rank 0 needs no gradient back; its forward,
when nobody reads its result), so the values and graphs of nested calls stay until the step's
end, and a rank whose modules a module elsewhere may call so (a descendant placed here) ends its
step only once that rank has said it is done (NESTED_DONE, `finish_nested`).

Each rank runs one module forward or backward at a time (the ComputeLock, by schedule priority);
a request first waits (without the lock) for its inputs, and a thread gives the lock up while it
waits on the network, so nested calls and several microbatches in flight never deadlock. Under
`interleaved`, a rank other than 0 starts the forward of a new microbatch only while it holds
fewer than the schedule's limit (1F1B's p - r), taking new microbatches in order. Requests whose
inputs are here wait in a run queue (run_queue.py) that one thread at a time runs in priority
order: the next request, of this microbatch or the next one, starts on the thread that finished
the last (no hand-off between threads), and keeps its place in the compute lock meanwhile; a
forward the schedule does not admit yet stays queued until it is. Results for other ranks are
sent (small ones) or queued before the lock is given up. On pp_rank 0 the next microbatch's turn
at its own modules comes as soon as this one has run as many of them as a microbatch does, not
when its glue code (which sends the calls to the other stages) is over (turns.py).
Each rank's linear layers keep what their weight gradients need and a thread computes them when
nothing else waits for the compute lock (weight_grad.py: off the critical path, in the
pipeline's bubbles); the step's end computes what is left and hands them over as `.grad` before
any reduction.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import math
import os
import pickle
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from . import autocast_state, weight_grad
from .errors import FwdExecutionNotInStepFnError, SMPRuntimeError
from .partitioner import nested_call_edges
from .remote_tensor import RemoteTensor, _Cell
from .run_queue import RunQueue
from .scheduler import BACKWARD, FORWARD, ComputeLock, Schedule
from .state import state
from .structure import fill, flatten
from .timeline import Timeline
from .transport import (BWD_REQ, FETCH, FWD_DONE, FWD_REPLY, FWD_REQ, MB_DONE, NESTED_DONE,
                        SEND_TO, STEP_END, VALUE, Message, PipelineError, Transport)
from .turns import Turns
from .value_store import ValueStore
from .workers import adopt_intra_op_threads

logger = logging.getLogger(__name__)

# SMSHIM_PREDICT=0: every remote call waits for its outputs' metadata (no prediction from earlier
# calls); for modules whose output structure or shapes depend on input values, not input shapes.
PREDICT_ENV = "SMSHIM_PREDICT"


# ---- the per-thread execution context ------------------------------------------------------

class _Context(threading.local):
    step: int = -1
    microbatch: int = -1
    in_step: bool = False
    tracing: bool = False
    forward_done: bool = False  # this microbatch's body reached model.backward
    driver: bool = False  # a pp_rank 0 worker running the step body (not a served request)


ctx = _Context()
# .here: this thread may take the run queue's role (it dispatches a frame, or serves a request)
_serving = threading.local()


# ---- caller side ---------------------------------------------------------------------------

@dataclass
class _Call:
    owner: int
    module: str
    step: int
    microbatch: int
    template: Any
    in_meta: List[Tuple[torch.Size, torch.dtype]]
    requires: List[bool]         # input i needs a gradient
    remote_in: List[bool]        # input i is a handle (its gradient may stay remote)
    leaf_in: List[bool]          # input i is a leaf (its gradient must be real)
    call_id: int = -1
    out_template: Any = None
    out_requires_grad: List[bool] = field(default_factory=list)

    def what(self, direction: str) -> str:
        return (f"{direction} of module '{self.module}' (microbatch {self.microbatch}, "
                f"step {self.step})")


@dataclass
class _Prediction:
    out_template: Any
    metas: List[Tuple[Tuple[int, ...], torch.dtype, bool]]
    expect: bytes  # what the owner must find, pickled as it pickles what it found


class _RemoteCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx_, server: "ModuleServer", call: _Call, anchor, *inputs):
        outputs = server._forward(call, list(inputs), grad_enabled=True)
        ctx_.server, ctx_.call = server, call
        ctx_.set_materialize_grads(False)
        ctx_.mark_non_differentiable(*[t for t, rg in zip(outputs, call.out_requires_grad) if not rg])
        return tuple(outputs)

    @staticmethod
    def backward(ctx_, *grads):
        in_grads = ctx_.server._backward(ctx_.call, list(grads))
        return (None, None, None, *in_grads)


class ModuleServer:
    """Serves this rank's modules to its pipeline peers and sends calls for theirs."""

    def __init__(self, root: nn.Module, assignment: Dict[str, int], pp_rank: int,
                 lock: ComputeLock, timeline: Timeline, timeout_s: float,
                 device: torch.device, deterministic: bool = False) -> None:
        self.root = root
        self.assignment = assignment
        self.me = pp_rank
        self.lock = lock
        self.timeline = timeline
        self.timeout_s = timeout_s
        self.device = device
        self.deterministic = deterministic
        self.predict = os.environ.get(PREDICT_ENV, "1") != "0"
        self.transport: Optional[Transport] = None
        self.schedule: Optional[Schedule] = None
        self.modules = dict(root.named_modules(remove_duplicate=False))
        self.store = ValueStore(timeout_s)
        self._ids = itertools.count()
        self._replies: Dict[int, "queue.Queue[Message]"] = {}
        self._replies_lock = threading.Lock()
        self._predictions: Dict[Any, _Prediction] = {}
        self._saved: Dict[Tuple[int, int], tuple] = {}  # (caller, call id) -> (inputs, outputs, mb)
        self.peak_live_microbatches = 0
        self._pool = ThreadPoolExecutor(max_workers=256, thread_name_prefix=f"smp-serve-{pp_rank}",
                                        initializer=adopt_intra_op_threads)
        self._runq = RunQueue(self._serve, self._pool.submit, self._may_start)
        lock.on_wait, lock.on_waited = self._runq.wait_at, self._runq.waited
        self.step_end: "queue.Queue[Message]" = queue.Queue()
        self._anchor = torch.zeros((), requires_grad=True)
        self._proxies: List[nn.Module] = []
        self._proxy_ids: set = set()
        # "This rank's backward work for the step is done" (every microbatch ran forward here and
        # no graph is left): lets data parallelism start reducing early.
        self.on_local_backward_done: Optional[Callable[[], None]] = None
        self._real_forward: Dict[str, Callable[..., Any]] = {}
        # This rank's linear layers accumulate their weight gradients in one buffer per weight
        # across microbatches (weight_grad.py), computed when the rank has nothing else to run
        # by a thread taking the compute lock behind every forward and backward
        # (deterministic_server: in each backward, so the sums group the same way every run).
        self.weight_grads = weight_grad.WeightGradAccumulator(
            weight_grad.deferred_by_env() and not deterministic)
        self._fused: list = []
        self._wgrad_thread: Optional[threading.Thread] = None
        self._closing = False
        # Functions served under names that are not modules (activation checkpointing's
        # "<module>#ckpt..." units): name -> callable, built on first use by this factory.
        self.function_factory: Optional[Callable[[str], Optional[Callable[..., Any]]]] = None
        self._instance_forward: Dict[int, Callable[..., Any]] = {}
        # Per-microbatch bookkeeping, under one condition: requests received and not yet served,
        # forwards among them, graphs kept, and what pp_rank 0 said is over.
        self._cond = threading.Condition()
        self._requests: collections.Counter = collections.Counter()
        self._forwards: collections.Counter = collections.Counter()
        self._graphs: collections.Counter = collections.Counter()
        self._fwd_done: set = set()
        self._mb_done: set = set()
        self._admitted: set = set()
        self._live: set = set()
        self._visited: Dict[int, set] = collections.defaultdict(set)  # pp_rank 0: peers called
        # pp_rank 0: the step bodies' turns at its own modules.
        self.turns = Turns(timeout_s, lambda: self.transport.check())
        self._expected_microbatches = 0
        self._forward_microbatches: set = set()
        self._backwards_running = 0
        self._tickets = itertools.count()
        self._turn = 0
        self._step = -1  # the step in progress
        self._regions_done: collections.Counter = collections.Counter()
        self._regions_per_mb = {FORWARD: 0, BACKWARD: 0}
        # Nested calls: the ranks whose modules this rank's may call from inside (a module of
        # this rank with a descendant elsewhere), the ranks that may call this one's so, and
        # those of them that said they are done with the step (NESTED_DONE; under _cond).
        edges = nested_call_edges(assignment)
        self._nested_callees = {b for a, b in edges if a == pp_rank}
        self._nested_callers = {a for a, b in edges if b == pp_rank}
        self._nested_done: set = set()

    # Proxies -------------------------------------------------------------------------------
    def install_proxies(self) -> None:
        """Route calls: modules owned elsewhere go to their owner; on pp_rank 0, the modules the
        root's glue code calls directly become local regions, so that glue (which runs in the
        microbatch threads) never holds the compute lock."""
        if not self._fused:
            self._fused = weight_grad.install(
                self.modules, lambda name: self.assignment.get(name, 0) == self.me,
                self.weight_grads)
        if self._fused and self.weight_grads.deferred and self._wgrad_thread is None:
            self._wgrad_thread = threading.Thread(target=self._compute_weight_grads, daemon=True,
                                                  name=f"smp-wgrad-{self.me}")
            self._wgrad_thread.start()
        for name, module in self.modules.items():
            self._real_forward.setdefault(name, module.forward)
        regions = set(_glue_callees(self.root, self.assignment)) if self.me == 0 else set()
        for name, owner in self.assignment.items():
            module = self.modules.get(name)
            if module is None or name == "":
                continue
            if owner != self.me or name in regions:
                if "forward" in module.__dict__:  # e.g. an activation-checkpointing wrapper
                    self._instance_forward[id(module)] = module.__dict__["forward"]
                module.forward = _make_proxy(self, name, owner)
                self._proxies.append(module)
                self._proxy_ids.add(id(module))

    def remove_proxies(self) -> None:
        weight_grad.uninstall(self._fused)
        self._fused = []
        for module in self._proxies:
            module.__dict__.pop("forward", None)
            previous = self._instance_forward.pop(id(module), None)
            if previous is not None:
                module.forward = previous
        self._proxies.clear()
        self._proxy_ids.clear()

    def is_proxied(self, module: nn.Module) -> bool:
        """Calls of `module` on this rank go through the server (owned elsewhere, or a region)."""
        return id(module) in self._proxy_ids

    def real_forward(self, name: str) -> Callable[..., Any]:
        """What runs when module (or served function) `name` executes on this rank."""
        fn = self._real_forward.get(name)
        if fn is None and self.function_factory is not None:
            fn = self.function_factory(name)
            if fn is not None:
                self._real_forward[name] = fn
        if fn is None:
            raise KeyError(f"pp rank {self.me} has no module or function named {name!r}")
        return fn

    # Messages (on a transport receiver thread: never waits; a send returns at once) -------
    def dispatch(self, msgs: List[Message]) -> Optional[Callable[[], None]]:
        """A frame's messages. If they made a request ready while no thread ran the run queue,
        returns the queue's running, for this thread to do once another has taken over
        receiving (Transport._recv_session)."""
        _serving.here = True
        try:
            for msg in msgs:
                self._dispatch(msg)
        finally:
            _serving.here = False
        return self._runq.drain if self._runq.is_runner() else None

    def _dispatch(self, msg: Message) -> None:
        kind = msg.kind
        if kind == VALUE:
            self.store.put(msg.meta, msg.tensors[0], msg.microbatch)
        elif kind in (FWD_REQ, BWD_REQ):
            with self._cond:
                self._requests[msg.microbatch] += 1
                if kind == FWD_REQ:
                    self._forwards[msg.microbatch] += 1
                    if msg.src == 0 and self.schedule is not None \
                            and self.schedule.strict_order:
                        # (simple) It goes before any backward here, inputs come or not.
                        msg.place = self.lock.keep_place(self._request_priority(msg),
                                                         self._request_key(msg))
                else:
                    if msg.src == 0:
                        # pp_rank 0 asks for a backward only once the microbatch's forward code
                        # is over: this says what FWD_DONE would.
                        self._fwd_done.add(msg.microbatch)
                        if self.deterministic:
                            # Backwards run in the order they came. (Not a nested call's: it is
                            # part of a backward running on its caller, which may be what an
                            # earlier ticket here waits for.)
                            msg.ticket = next(self._tickets)
            # A request takes a thread only once what it needs is here (its forward, for a
            # backward, and every value sent by reference), so requests queued far ahead of
            # their inputs never exhaust the pool.
            self.store.when_ready(_needs(msg), lambda: self._ready(msg))
        elif kind in (SEND_TO, FETCH):
            key, dst = (msg.meta, msg.src) if kind == FETCH else msg.meta
            value = self.store.want(key, dst)
            if value is not None:  # (a send never waits: see Transport.send)
                self._send_value(dst, key, value, msg.microbatch, msg.step)
        elif kind == FWD_REPLY:
            with self._replies_lock:
                box = self._replies.get(msg.call_id)
            if box is None:
                self.transport.fail(PipelineError(
                    f"pp rank {self.me} got an unexpected {msg.describe()} reply from pp rank {msg.src}"))
                return
            box.put(msg)
        elif kind == FWD_DONE:
            with self._cond:
                self._fwd_done.add(msg.microbatch)
                self._release_if_done(msg.microbatch)
                self._cond.notify_all()
            self._runq.poke(here=True)  # (a queued forward may now be admitted)
        elif kind == MB_DONE:
            with self._cond:
                self._mb_done.add(msg.microbatch)
                self._fwd_done.add(msg.microbatch)
                self._drop_if_done(msg.microbatch)
            self._runq.poke(here=True)
        elif kind == NESTED_DONE:
            with self._cond:
                self._nested_done.add(msg.src)
                self._cond.notify_all()
        elif kind == STEP_END:
            self.step_end.put(msg)
        else:
            self.transport.fail(PipelineError(f"pp rank {self.me}: unknown message {msg.kind!r}"))

    def wake_all(self, exc: BaseException) -> None:
        """Transport failure: wake every thread waiting for a reply or a value so it raises."""
        with self._replies_lock:
            boxes = list(self._replies.values())
        for box in boxes:
            box.put(Message("error", meta=str(exc)))
        self.store.fail(exc)
        self.lock.clear_places()
        with self._cond:
            self._cond.notify_all()
        self.turns.wake_all()
        self.step_end.put(Message("error", meta=str(exc)))

    def _send_value(self, dst: int, key, value: torch.Tensor, mb: int, step: int) -> None:
        try:
            self.transport.send(dst, Message(VALUE, step, mb, meta=key, tensors=[value]))
        except BaseException as e:  # noqa: BLE001  (already recorded by the transport)
            logger.debug("sending %s to pp rank %d failed: %s", key, dst, e)

    def _wait_reply(self, box: "queue.Queue[Message]", peer: int, what: str) -> Message:
        """Wait for a reply with the compute lock given up; bounded by SMSHIM_TIMEOUT."""
        self.transport.flush()  # what this thread held may be what the reply waits for
        self._runq.step_down()
        with self.lock.released(), self.timeline.span(f"wait {what}", "wait", peer=peer):
            try:
                msg = box.get(timeout=self.timeout_s)
            except queue.Empty:
                err = self._timeout_error(peer, what)
                self.transport.fail(err)
                raise err from None
        if msg.kind == "error":
            raise PipelineError(f"pp rank {self.me}, waiting for {what}: {msg.meta}")
        return msg

    def _timeout_error(self, peer: int, what: str) -> PipelineError:
        return PipelineError(
            f"pp rank {self.me} waited {self.timeout_s:.0f} s for pp rank {peer} (global rank "
            f"{self.transport.ranks[peer]}): {what}. Rank {peer} may have stopped calling the step "
            "function, or died (SMSHIM_TIMEOUT sets this limit)")

    def _get_value(self, key, owner: int, what: str) -> torch.Tensor:
        """A value this rank holds or is sent, waiting for it (lock given up)."""
        value = self.store.peek(key)
        if value is not None:
            return value
        self.transport.flush()
        self._runq.step_down()
        with self.lock.released(), self.timeline.span(f"wait {what}", "wait", peer=owner):
            try:
                return self.store.get(key, lambda: (
                    f"pp rank {self.me} waiting for pp rank {owner} (global rank "
                    f"{self.transport.ranks[owner]}): {what}"))
            except PipelineError as e:
                if self.transport.error is None:
                    err = self._timeout_error(owner, what)
                    self.transport.fail(err)
                    raise err from e
                raise

    # Caller side ---------------------------------------------------------------------------
    def call(self, name: str, owner: int, args: tuple, kwargs: dict) -> Any:
        if not ctx.in_step:
            raise FwdExecutionNotInStepFnError(
                f"module '{name}' lives on pipeline rank {owner}: it can only run inside an "
                "@smp.step function")
        template, tensors = flatten((args, kwargs))
        grad = torch.is_grad_enabled()
        requires = [grad and t.requires_grad and (t.is_floating_point() or t.is_complex())
                    for t in tensors]
        call = _Call(owner, name, ctx.step, ctx.microbatch, template,
                     [(t.shape, t.dtype) for t in tensors], requires,
                     [isinstance(t, RemoteTensor) for t in tensors],
                     [t.grad_fn is None for t in tensors])
        if grad:
            outputs = list(_RemoteCall.apply(self, call, self._anchor, *tensors))
        else:
            outputs = self._forward(call, tensors, grad_enabled=False)
        return fill(call.out_template, outputs)

    def _forward(self, call: _Call, tensors: List[torch.Tensor], grad_enabled: bool):
        if call.owner == self.me:  # a local region: the same path, without the network
            self.transport.flush()  # held calls to other stages go before this one computes
            values = [self._real(t) for t in tensors]
            if ctx.driver:
                self.turns.wait(FORWARD, call.microbatch, call.what("forward"))
            call.call_id = next(self._ids)
            out_template, outs, out_rg = self._execute_forward(
                self.me, call.call_id, call.module, call.step, call.microbatch, call.template,
                values, call.requires, grad_enabled)
            self.turns.ran(FORWARD, call.microbatch)
            call.out_template, call.out_requires_grad = out_template, out_rg
            return [t.detach() for t in outs]
        # Only pp_rank 0 keeps handles (it says when a microbatch is over); a nested call, made
        # from inside a module on another rank, waits for the values.
        sync = self.me != 0
        template_bytes = pickle.dumps(call.template, protocol=pickle.HIGHEST_PROTOCOL)
        amp = autocast_state.capture()  # the module runs under the caller's autocast
        pkey = (call.module, template_bytes, grad_enabled, amp,
                tuple((tuple(s), d, r) for (s, d), r in zip(call.in_meta, call.requires)))
        pred = None if (sync or not self.predict) else self._predictions.get(pkey)
        call.call_id = call_id = next(self._ids)
        # pp_rank 0's requests that need no reply are held to leave with the next ones to the
        # same rank (a stage's calls of one microbatch: one frame; Transport.send, `hold`).
        reply = "data" if sync else ("meta" if pred is None else None)
        enc, inline = self._encode(tensors, call.owner, call.microbatch, hold=not sync)
        if not sync:
            with self._cond:
                self._visited[call.microbatch].add(call.owner)
        box = self._new_box(call_id) if reply else None
        try:
            self.transport.send(call.owner, Message(
                FWD_REQ, call.step, call.microbatch, call_id, call.module,
                meta=(template_bytes, enc, call.requires, grad_enabled, reply,
                      pred.expect if pred is not None else None, amp),
                tensors=inline), hold=reply is None)
            if box is not None:
                msg = self._wait_reply(box, call.owner, call.what("forward"))
        finally:
            if box is not None:
                self._drop_box(call_id)
        if reply == "data":
            call.out_template, metas = msg.meta
            call.out_requires_grad = [rg for _, _, rg in metas]
            return msg.tensors
        if reply == "meta":
            out_template, metas = msg.meta
            pred = _Prediction(out_template, metas, _expectation(out_template, metas))
            self._predictions[pkey] = pred
        call.out_template = pred.out_template
        call.out_requires_grad = [rg for _, _, rg in pred.metas]
        return [RemoteTensor(_Cell(call.owner, (self.me, call_id, "out", i),
                                   f"forward output {i} of module '{call.module}'",
                                   call.microbatch, self._fetch, step=call.step),
                             shape, dtype, self.device)
                for i, (shape, dtype, _) in enumerate(pred.metas)]

    def _backward(self, call: _Call, grads: List[Optional[torch.Tensor]]):
        n = len(call.requires)
        if call.owner == self.me:
            self._note_backward_begun(call.microbatch)
            self.transport.flush()
            values = [None if g is None else self._real(g) for g in grads]
            if ctx.driver:
                self.turns.wait(BACKWARD, call.microbatch, call.what("backward"))
            in_grads = self._execute_backward(self.me, call.call_id, call.module, call.step,
                                              call.microbatch, values)
            self.turns.ran(BACKWARD, call.microbatch)
            return in_grads + [None] * (n - len(in_grads))
        sync = self.me != 0
        enc, inline = self._encode(grads, call.owner, call.microbatch, hold=not sync)
        # Gradients this rank will need as values come unasked; the others stay with the owner
        # until the next call up the chain asks for them to be sent where it runs.
        push = [i for i in range(n) if call.requires[i] and (sync or not call.remote_in[i])]
        self.transport.send(call.owner, Message(
            BWD_REQ, call.step, call.microbatch, call.call_id, call.module, meta=(enc, push),
            tensors=inline), hold=not sync)
        self._note_backward_begun(call.microbatch)  # (once its request is queued: see there)
        in_grads: List[Optional[torch.Tensor]] = []
        for i in range(n):
            if not call.requires[i]:
                in_grads.append(None)
                continue
            cell = _Cell(call.owner, (self.me, call.call_id, "igrad", i),
                         f"gradient of input {i} of module '{call.module}'", call.microbatch,
                         self._fetch, pushed=i in push, step=call.step)
            if sync or call.leaf_in[i]:
                # autograd would store a handle in a leaf's .grad: give it the value.
                in_grads.append(cell.resolve())
            else:
                shape, dtype = call.in_meta[i]
                in_grads.append(RemoteTensor(cell, shape, dtype, self.device))
        return in_grads

    def _encode(self, tensors: List[Optional[torch.Tensor]], dst: int, mb: int,
                hold: bool = False):
        """How `dst` finds each tensor: sent inline ("t", i), held by dst or sent to it by its
        owner ("r", key, owner), or a lazy sum of such ("s", [...]); None stays None."""
        inline: List[torch.Tensor] = []

        def one(t):
            if t is None:
                return None
            if isinstance(t, _Cell) or isinstance(t, RemoteTensor):
                cell = t if isinstance(t, _Cell) else t._cell
                if cell.value is None and cell.terms is not None:
                    return ("s", [one(term) for term in cell.terms])
                if cell.value is None:
                    if cell.owner != dst:
                        with cell.lock:
                            ask = dst not in cell.sent_to
                            cell.sent_to.add(dst)
                        if ask:
                            self.transport.send(cell.owner, Message(
                                SEND_TO, ctx.step, mb, meta=(cell.key, dst)), hold=hold)
                    return ("r", cell.key, cell.owner)
                t = cell.value
            inline.append(t)
            return ("t", len(inline) - 1)

        return [one(t) for t in tensors], inline

    def _decode(self, enc, tensors: List[torch.Tensor], src: int, what: str):
        if enc is None:
            return None
        kind = enc[0]
        if kind == "t":
            return tensors[enc[1]]
        if kind == "r":
            return self._get_value(enc[1], enc[2], what)
        total = None
        for term in enc[1]:
            v = self._decode(term, tensors, src, what)
            total = v if total is None else total + v
        return total

    def _fetch(self, cell: _Cell) -> torch.Tensor:
        """A handle's data: pushed by its owner, or asked for once."""
        if cell.step != self._step:
            raise SMPRuntimeError(
                f"the {cell.what} (microbatch {cell.microbatch}, step {cell.step}) stayed on pp rank "
                f"{cell.owner} and was dropped when its step ended: read it inside the @smp.step "
                "function, or return it from the step function to get its value")
        key = cell.key
        if cell.owner == self.me:
            return self._get_value(key, self.me, cell.what)
        self._ask(cell)
        return self._get_value(key, cell.owner, f"{cell.what} (microbatch {cell.microbatch}, "
                                                f"step {ctx.step})")

    def _ask(self, cell: _Cell, hold: bool = False) -> None:
        """Ask a handle's owner for its value (the terms' owners, for a lazy sum), once, unless
        it comes anyway (pushed, or here already)."""
        if cell.value is not None:
            return
        if cell.terms is not None:
            for term in cell.terms:
                if isinstance(term, _Cell):
                    self._ask(term, hold)
            return
        if cell.owner == self.me or cell.step != self._step:  # (the latter: _fetch says why)
            return
        with cell.lock:
            ask = not cell.pushed and not cell.fetching
            cell.fetching = True
        if ask and self.store.peek(cell.key) is None:
            self.transport.send(cell.owner, Message(FETCH, ctx.step, cell.microbatch,
                                                    meta=cell.key), hold=hold)

    def _real(self, t: torch.Tensor) -> torch.Tensor:
        return t.materialize() if isinstance(t, RemoteTensor) else t

    def _new_box(self, call_id: int) -> "queue.Queue[Message]":
        box: "queue.Queue[Message]" = queue.Queue()
        with self._replies_lock:
            self._replies[call_id] = box
        return box

    def _drop_box(self, call_id: int) -> None:
        with self._replies_lock:
            self._replies.pop(call_id, None)

    # Owner side ----------------------------------------------------------------------------
    def _ready(self, msg: Message) -> None:
        """A request's inputs are all here: into the run queue. If no thread runs it, this one
        will when it can (it dispatches a frame, or serves a request: see RunQueue.put); else a
        pool thread."""
        if self.timeline.enabled:
            self.timeline.instant(f"ready {msg.kind} {msg.module}", "ready",
                                  microbatch=msg.microbatch, step=msg.step)
        self._runq.put(self._request_priority(msg), msg, here=getattr(_serving, "here", False))

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
        """(On the run queue's thread.)"""
        _serving.here = True
        ctx.step, ctx.microbatch, ctx.in_step = msg.step, msg.microbatch, True
        state.microbatch = msg.microbatch
        try:
            if msg.kind == FWD_REQ:
                self._serve_forward(msg)
            else:
                self._serve_backward(msg)
        except BaseException as e:  # noqa: BLE001
            if isinstance(e, PipelineError) and self.transport.error is not None:
                return  # a failure elsewhere, already reported
            err = PipelineError(f"pp rank {self.me} failed running the {msg.describe()} "
                                f"requested by pp rank {msg.src}: {type(e).__name__}: {e}")
            logger.exception("%s", err)
            self.transport.fail(err)
        finally:
            if getattr(msg, "place", None) is not None:
                self.lock.give_up(msg.place)  # (if it failed before taking it)
            with self._cond:
                self._requests[msg.microbatch] -= 1
                if msg.kind == FWD_REQ:
                    self._forwards[msg.microbatch] -= 1
                    self._release_if_done(msg.microbatch)
                self._drop_if_done(msg.microbatch)
                self._cond.notify_all()
            self._runq.poke(here=True)  # (this thread runs the queue next)
            _serving.here = False

    def _what(self, msg: Message, direction: str) -> str:
        return (f"{direction} of module '{msg.module}' (microbatch {msg.microbatch}, "
                f"step {msg.step})")

    def _serve_forward(self, msg: Message) -> None:
        template_bytes, enc, requires, grad_enabled, reply, expect, amp = msg.meta
        if msg.src == 0:
            self._admit(msg.microbatch, msg.step)
        what = f"an input of the {self._what(msg, 'forward')}"
        tensors = [self._decode(e, msg.tensors, msg.src, what) for e in enc]
        template = pickle.loads(template_bytes)

        def deliver(out_template, outs, out_rg) -> None:
            metas = [(tuple(t.shape), t.dtype, rg) for t, rg in zip(outs, out_rg)]
            if expect is not None and _expectation(out_template, metas) != expect:
                expected = pickle.loads(expect)
                raise PipelineError(
                    f"module '{msg.module}' (microbatch {msg.microbatch}, step {msg.step}) "
                    f"returned {_describe(out_template, metas)}, but for inputs of the same "
                    f"shapes it returned {_describe(*expected)} before. smshim runs modules on "
                    "other ranks ahead of the caller, predicting their outputs' structure and "
                    "shapes from the input shapes; for a module whose outputs depend on input "
                    f"values, set {PREDICT_ENV}=0")
            outs = [t.detach() for t in outs]
            if reply is not None:
                self.transport.send(msg.src, Message(
                    FWD_REPLY, msg.step, msg.microbatch, msg.call_id, msg.module,
                    meta=(out_template, metas), tensors=outs if reply == "data" else []))
            if reply != "data":  # handles on the caller: keep the values for whoever needs them
                for i, t in enumerate(outs):
                    self._keep((msg.src, msg.call_id, "out", i), t, msg.microbatch, msg.step)

        self._execute_forward(msg.src, msg.call_id, msg.module, msg.step, msg.microbatch,
                              template, tensors, requires, grad_enabled, deliver,
                              place=getattr(msg, "place", None), amp=amp)
        self.store.put((msg.src, msg.call_id, "fwd", 0), self._anchor, msg.microbatch)

    def _serve_backward(self, msg: Message) -> None:
        enc, push = msg.meta
        what = f"a gradient for the {self._what(msg, 'backward')}"
        # The forward may still be queued here (requests do not wait for each other's replies).
        self._get_value((msg.src, msg.call_id, "fwd", 0), self.me, self._what(msg, "forward"))
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
                                   grads, deliver, place=getattr(msg, "place", None))
        finally:
            if ticket is not None:
                with self._cond:
                    self._turn += 1
                    self._cond.notify_all()

    def _keep(self, key, value: torch.Tensor, mb: int, step: int) -> None:
        """Hold a value for peers; send it to those who asked for it already."""
        for dst in self.store.put(key, value, mb):
            self.transport.send(dst, Message(VALUE, step, mb, meta=key, tensors=[value]))

    def _execute_forward(self, caller: int, call_id: int, name: str, step: int, mb: int,
                         template: Any, tensors: List[torch.Tensor], requires: List[bool],
                         grad_enabled: bool, deliver: Optional[Callable[..., None]] = None,
                         place: Optional[tuple] = None, amp: autocast_state.State = None):
        """Run module `name` on inputs cut from the caller's graph; keep the graph for backward.
        `deliver(out_template, outs, out_rg)` runs before the compute lock is given up, so that
        results on their way to another rank leave before the next module here starts. `place`:
        the one the request kept in the compute lock's queue (see Schedule.strict_order). `amp`:
        the caller's autocast state (a local region runs in the caller's thread, under its own)."""
        inputs = [t.detach().requires_grad_(rg and grad_enabled)
                  if (t.is_floating_point() or t.is_complex()) else t
                  for t, rg in zip(tensors, requires)]
        with self.lock.hold(self._priority(FORWARD, mb), (FORWARD, mb),
                            lambda: self._more_regions(FORWARD, mb), place):
            with self.timeline.span(name or "<root>", "forward", microbatch=mb, step=step,
                                    caller=caller), \
                    torch.set_grad_enabled(grad_enabled), autocast_state.applied(amp):
                args, kwargs = fill(template, inputs)
                out = self.real_forward(name)(*args, **kwargs)
            out_template, outs = flatten(out)
            if caller != self.me:
                # A region's results leave this rank as values (handles live on pp_rank 0 only).
                # A handle that is part of the graph (a lazy sum of a call's output and a value,
                # say) is read through its dispatch (`clone`), which keeps it there: its raw
                # value would cut the backward off from the module's parameters.
                outs = [t.clone() if isinstance(t, RemoteTensor) and t.requires_grad
                        else self._real(t) for t in outs]
            out_rg = [grad_enabled and t.requires_grad for t in outs]
            if any(out_rg):
                with self._cond:
                    self._forward_microbatches.add(mb)
                    self._saved[(caller, call_id)] = (inputs, outs, mb)
                    if caller == 0:  # (a nested call's graph lives until the step's end)
                        self._graphs[mb] += 1
                    # Microbatches whose activations this rank holds (for the memory benchmark):
                    # a graph counts until its backward is over, not only until one starts
                    # waiting for the compute lock.
                    live = sum(1 for n in self._graphs.values() if n > 0)
                    self.peak_live_microbatches = max(self.peak_live_microbatches, live)
            if deliver is not None:
                deliver(out_template, outs, out_rg)
            self._hold_place_for_next()
        return out_template, outs, out_rg

    def _execute_backward(self, caller: int, call_id: int, name: str, step: int, mb: int,
                          grads: List[Optional[torch.Tensor]],
                          deliver: Optional[Callable[[list], None]] = None,
                          place: Optional[tuple] = None) -> List[Optional[torch.Tensor]]:
        """Backward through the graph kept for (caller, call_id); returns the inputs' gradients
        (zeros for an input that needs one but which the outputs' gradients did not reach),
        after `deliver(in_grads)`, which runs before the compute lock is given up."""
        with self._cond:
            saved = self._saved.pop((caller, call_id), None)
            if saved is None:
                return []
            self._backwards_running += 1
        try:
            inputs, outs, _ = saved
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            with (self.lock.hold(self._priority(BACKWARD, mb), (BACKWARD, mb),
                                 lambda: self._more_regions(BACKWARD, mb), place)
                  if pairs else contextlib.nullcontext()):
                if pairs:
                    with self.timeline.span(name or "<root>", "backward", microbatch=mb,
                                            step=step, caller=caller):
                        _run_backward([o for o, _ in pairs], [g for _, g in pairs])
                in_grads = [(t.grad if t.grad is not None else torch.zeros_like(t))
                            if t.requires_grad else None for t in inputs]
                if deliver is not None:
                    deliver(in_grads)
                if pairs:
                    self._hold_place_for_next()
        finally:
            with self._cond:
                self._backwards_running -= 1
                if caller == 0:
                    self._graphs[mb] -= 1
                self._release_if_done(mb)
                self._cond.notify_all()
                # (A rank that serves nested calls learns that their backwards are over only
                # at the step's end: it reduces then.)
                done = (not self._saved and self._backwards_running == 0
                        and len(self._forward_microbatches) >= self._expected_microbatches
                        and not self._nested_callers)
            # A queued forward may now be admitted: a thread serving requests runs it next.
            self._runq.poke(here=getattr(_serving, "here", False))
        if done:
            self.weight_grads.flush()
            if self.on_local_backward_done is not None:
                self.on_local_backward_done()
        return in_grads

    def _more_regions(self, kind: str, mb: int) -> bool:
        """Count a module run here for microbatch `mb` in direction `kind`; does this rank
        expect more for it? (As many as the microbatch that needed the most, learned as the
        steps go: a stage's share of a microbatch's calls is the same every time.)"""
        with self._cond:
            self._regions_done[(kind, mb)] += 1
            n = self._regions_done[(kind, mb)]
            self._regions_per_mb[kind] = max(self._regions_per_mb[kind], n)
            return n < self._regions_per_mb[kind]

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
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
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
        if mb in self._admitted:
            return True
        limit = self.schedule.limit(self.me) if self.schedule else 1 << 30
        return len(self._live) < limit and all(
            j in self._admitted or (j in self._fwd_done and self._forwards[j] <= 0)
            for j in range(mb))

    def _may_start(self, msg: Message) -> bool:
        """May the run queue start this request now? Not the forward of a microbatch the
        schedule does not admit yet: it stays queued (no thread waits in `_admit` for it)."""
        if msg.kind != FWD_REQ or msg.src != 0:
            return True
        with self._cond:
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
            self.store.drop_microbatch(mb, keep=_nested_key)
            for key in [k for k, saved in self._saved.items()
                        if saved[2] == mb and not _nested_key(k)]:
                del self._saved[key]
            self._graphs[mb] = 0
            self._live.discard(mb)

    # Steps ---------------------------------------------------------------------------------
    def begin_step(self, microbatches: int, schedule: Schedule, step: int) -> None:
        self.schedule = schedule
        self._step = step
        self.weight_grads.active = True
        self._expected_microbatches = microbatches
        self._forward_microbatches = set()
        self.lock.clear_places()  # (none are left but after a failed step)
        with self._cond:
            for s in (self._fwd_done, self._mb_done, self._admitted, self._live, self._visited,
                      self._nested_done):
                s.clear()
            for c in (self._requests, self._forwards, self._graphs, self._regions_done):
                c.clear()
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
        with self._cond:
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
        with self._cond:
            self._saved.clear()
        self.weight_grads.flush()  # (nothing is left: the step's end flushed before reducing)
        self.weight_grads.active = False
        self.store.clear()
        self._step = -1  # handles kept past the step now say so instead of waiting

    def finish_microbatch(self, mb: int, out: Any) -> Any:
        """pp_rank 0: microbatch `mb`'s body returned `out`; returns it with every handle
        replaced by its value (every rank gets the step's results), and tells the peers that the
        microbatch is over, so its values can go, there and here. The fetches and the notice
        leave together: a peer answers a fetch before it sees the notice that follows it, and
        drops nothing that a request still running there will make. A notice that need not go
        with a fetch leaves with the next frame to its peer (the next microbatch's requests, or
        the step's end), or `Transport.hold_s` later: it only lets the peer free memory, and a
        frame of its own cost both ranks' CPU once per microbatch."""
        template, tensors = flatten(out)
        handles = [t for t in tensors if isinstance(t, RemoteTensor)]
        with self.transport.together():
            for t in handles:
                self._ask(t._cell, hold=True)
            for peer in self.transport.peers:
                self.transport.send_later(peer, Message(MB_DONE, ctx.step, mb))
        if handles:
            out = fill(template, [self._real(t) for t in tensors])
        self.store.drop_microbatch(mb, keep=_nested_key)
        return out

    def prefetch(self, tensors: List[torch.Tensor]) -> None:
        """pp_rank 0: ask now for the values of the small handles a microbatch runs backward
        from (its loss): the step function usually returns them, and fetched only when the
        microbatch ends they would cost the last one a round trip at the step's end."""
        for t in tensors:
            if isinstance(t, RemoteTensor) and math.prod(t.shape) <= _PREFETCH_NUMEL:
                self._ask(t._cell, hold=True)

    def forward_done(self, mb: int) -> None:
        """pp_rank 0: microbatch `mb` will make no more forward calls. The peers it called learn
        it from its first backward request (or MB_DONE); the others are told now, so they can
        take the next microbatch."""
        with self._cond:
            visited = self._visited.pop(mb, set())
        for peer in self.transport.peers:
            if peer not in visited:
                self.transport.send(peer, Message(FWD_DONE, ctx.step, mb))

    def _compute_weight_grads(self) -> None:
        """Compute kept weight gradients whenever no forward or backward waits to run here
        (the lowest priority: a request arriving meanwhile waits for one product at most)."""
        adopt_intra_op_threads()
        acc = self.weight_grads
        while not self._closing:
            if not acc.wait_for_work(timeout=0.5):
                continue
            try:
                with self.lock.hold(_IDLE_PRIORITY), \
                        self.timeline.span("weight gradients", "weight_grad", step=self._step):
                    acc.compute_one()
            except BaseException as e:  # noqa: BLE001
                err = PipelineError(f"pp rank {self.me} failed computing weight gradients: "
                                    f"{type(e).__name__}: {e}")
                logger.exception("%s", err)
                self.transport.fail(err)
                return

    def close(self) -> None:
        self._closing = True
        if self._wgrad_thread is not None:
            self._wgrad_thread.join(timeout=5.0)
            self._wgrad_thread = None
        self._pool.shutdown(wait=False, cancel_futures=True)


# Handles passed to backward with at most this many elements are fetched ahead (`prefetch`).
_PREFETCH_NUMEL = 64

# Behind every schedule's priorities ((0 or 1, microbatch)): work done only when none waits.
_IDLE_PRIORITY = (2, 0)


def _nested_key(key) -> bool:
    """A value of a call made by another rank than pp_rank 0 (keys start with the caller)."""
    return key[0] != 0


def _needs(msg: Message) -> List[Any]:
    """The store keys a FWD_REQ / BWD_REQ waits for."""
    keys: List[Any] = []

    def refs(enc):
        if enc is None:
            return
        if enc[0] == "r":
            keys.append(enc[1])
        elif enc[0] == "s":
            for term in enc[1]:
                refs(term)

    if msg.kind == FWD_REQ:
        for e in msg.meta[1]:
            refs(e)
    else:
        keys.append((msg.src, msg.call_id, "fwd", 0))
        for e in msg.meta[0]:
            refs(e)
    return keys


def _run_backward(outputs: List[torch.Tensor], grads: List[torch.Tensor]) -> None:
    """`torch.autograd.backward` without its argument checks, which cost a fifth of a small
    module's backward (~30 µs of ~150): the gradients come from the caller's autograd, shaped and
    typed by these outputs' metadata, and always given."""
    torch.autograd.Variable._execution_engine.run_backward(
        tuple(outputs), tuple(grads), False, False, (), allow_unreachable=True,
        accumulate_grad=True)


def _expectation(out_template: Any, metas) -> bytes:
    return pickle.dumps((out_template, metas), protocol=pickle.HIGHEST_PROTOCOL)


def _describe(out_template: Any, metas) -> str:
    shapes = ", ".join(f"{tuple(s)} {str(d).replace('torch.', '')}" for s, d, _ in metas)
    return f"{type(out_template).__name__} of tensors [{shapes}]"


def _glue_callees(root: nn.Module, assignment: Dict[str, int]):
    """Names of pp_rank 0's modules that the root's forward calls directly: its children, and the
    children of containers it indexes into (ModuleList/ModuleDict have no forward of their own)."""
    def walk(prefix: str, module: nn.Module):
        for cname, child in module.named_children():
            name = f"{prefix}.{cname}" if prefix else cname
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                yield from walk(name, child)
            elif assignment.get(name) == 0:
                yield name

    return walk("", root)


def _make_proxy(server: ModuleServer, name: str, owner: int) -> Callable[..., Any]:
    def remote_forward(*args, **kwargs):
        return server.call(name, owner, args, kwargs)

    remote_forward.__name__ = f"remote_forward[{name} on pp rank {owner}]"
    return remote_forward
