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
then pushes unasked (at the microbatch's last call, once every request has left: calls.py).
Parameter gradients accumulate where the parameters live. A zero-size "anchor" input that
requires grad makes the call part of the graph even when none of its real inputs do (the first
stage's inputs are data), so the owner's parameters still get their backward.

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
sent (small ones) or queued before the lock is given up. pp_rank 0's own modules are not served
here: its step bodies call them directly, holding the compute lock (pipeline.py, turns.py).
Each rank's linear layers keep what their weight gradients need and a thread computes them when
nothing else waits for the compute lock (weight_grad.py: off the critical path, in the
pipeline's bubbles); the step's end computes what is left and hands them over as `.grad` before
any reduction.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from smshim.modelparallel.torch.pipeline import local_flush, weight_grad
from smshim.modelparallel.torch.pipeline.admission import Admission
from smshim.modelparallel.torch.pipeline.calls import (
    MERGE_CHAINS_ENV,
    PREDICT_ENV,
    CallerSide,
    _make_proxy,
    _Prediction,
)
from smshim.modelparallel.torch.pipeline.context import _serving
from smshim.modelparallel.torch.pipeline.partitioner import nested_call_edges
from smshim.modelparallel.torch.pipeline.run_queue import RunQueue
from smshim.modelparallel.torch.pipeline.scheduler import (
    BACKWARD,
    FORWARD,
    ComputeLock,
    Schedule,
)
from smshim.modelparallel.torch.pipeline.serving import OwnerSide, _needs
from smshim.modelparallel.torch.pipeline.step_end import StepEnd
from smshim.modelparallel.torch.pipeline.messages import (BWD_REQ, FETCH, FWD_DONE, FWD_REPLY, FWD_REQ, MB_DONE, NESTED_DONE, PREFETCH, SEND_TO, STEP_END, VALUE, Message, PipelineError)
from smshim.modelparallel.torch.pipeline.transport import Transport
from smshim.modelparallel.torch.pipeline.turns import Turns
from smshim.modelparallel.torch.pipeline.value_store import ValueStore
from smshim.modelparallel.torch.pipeline.workers import adopt_intra_op_threads
from smshim.timeline.recorder import Timeline

logger = logging.getLogger(__name__)


class ModuleServer(CallerSide, OwnerSide, Admission, StepEnd):
    """Serves this rank's modules to its pipeline peers and sends calls for theirs.

    Its parts live in files of their own: the caller's side (calls.py), the owner's (serving.py),
    admission (admission.py) and the step's end with nested calls (step_end.py); this class holds
    the state they share, the proxies, the dispatch of incoming messages and the weight gradients'
    thread."""

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
        self.merge_chains = os.environ.get(MERGE_CHAINS_ENV, "1") != "0"
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
        lock.on_give_up = self._runq.step_down
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
        self._flush_hooks: list = []  # pp_rank 0: local_flush.py's hooks
        # Per-microbatch bookkeeping, under one condition: requests received and not yet served,
        # forwards among them, graphs kept, and what pp_rank 0 said is over. Its lock is taken
        # as `with self._cond_lock` (Condition's own `with` is a Python call each way, and the
        # serving path enters it several times per request). The counts are defaultdicts, not
        # Counters: a Counter's missing key is a Python call (`__missing__`), a new microbatch's
        # first count on every rank.
        self._cond_lock = threading.RLock()
        self._cond = threading.Condition(self._cond_lock)
        self._requests: Dict[int, int] = collections.defaultdict(int)
        self._forwards: Dict[int, int] = collections.defaultdict(int)
        self._graphs: Dict[int, int] = collections.defaultdict(int)
        self._fwd_done: set = set()
        self._mb_done: set = set()
        self._admitted: set = set()
        self._first_unadmitted = 0  # (no microbatch below it is outside `_admitted`)
        self._live: set = set()
        self._visited: Dict[int, set] = collections.defaultdict(set)  # pp_rank 0: peers called
        # pp_rank 0: the peers that will push it an input gradient in a microbatch's backward.
        self._pushers: Dict[int, set] = collections.defaultdict(set)
        # pp_rank 0: calls of a microbatch made with grad whose backward request has not left.
        self._backwards_to_issue: Dict[int, int] = collections.defaultdict(int)
        # pp_rank 0: the chains a microbatch's calls made (calls.py, `_Chain`), until its forward
        # is over.
        self._open_chains: Dict[int, list] = collections.defaultdict(list)
        # pp_rank 0: the step bodies' turns at its own modules.
        self.turns = Turns(timeout_s, lambda: self.transport.check())
        self._expected_microbatches = 0
        self._forward_microbatches: set = set()
        self._backwards_running = 0
        self._tickets = itertools.count()
        self._turn = 0
        self._step = -1  # the step in progress
        self._regions_done: Dict[Tuple[str, int], int] = collections.defaultdict(int)
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
        """Route calls: modules owned elsewhere go to their owner. (This rank's own modules run
        where they are called: in a served request, or in pp_rank 0's step body, which holds
        the compute lock while it computes: pipeline.py.)"""
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
        if self.me == 0 and not self._flush_hooks:
            # (pp_rank 0's step bodies hold their calls: local_flush.py.)
            self._flush_hooks = local_flush.install(
                self.modules, lambda name: self.assignment.get(name, 0), self.me,
                self.transport.flush)
        for name, owner in self.assignment.items():
            module = self.modules.get(name)
            if module is None or name == "":
                continue
            if owner != self.me:
                if "forward" in module.__dict__:  # e.g. an activation-checkpointing wrapper
                    self._instance_forward[id(module)] = module.__dict__["forward"]
                module.forward = _make_proxy(self, name, owner)
                self._proxies.append(module)
                self._proxy_ids.add(id(module))

    def remove_proxies(self) -> None:
        weight_grad.uninstall(self._fused)
        self._fused = []
        for handle in self._flush_hooks:
            handle.remove()
        self._flush_hooks = []
        for module in self._proxies:
            module.__dict__.pop("forward", None)
            previous = self._instance_forward.pop(id(module), None)
            if previous is not None:
                module.forward = previous
        self._proxies.clear()
        self._proxy_ids.clear()

    def is_proxied(self, module: nn.Module) -> bool:
        """Calls of `module` on this rank go through the server (it is owned elsewhere)."""
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
            with self._cond_lock:
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
        elif kind in (SEND_TO, FETCH, PREFETCH):
            key, dst = msg.meta if kind == SEND_TO else (msg.meta, msg.src)
            later = kind == PREFETCH
            value = self.store.want(key, dst, later)
            if value is not None:  # (a send never waits: see Transport.send)
                self._send_value(dst, key, value, msg.microbatch, msg.step, later)
        elif kind == FWD_REPLY:
            with self._replies_lock:
                box = self._replies.get(msg.call_id)
            if box is None:
                self.transport.fail(PipelineError(
                    f"pp rank {self.me} got an unexpected {msg.describe()} reply from pp rank {msg.src}"))
                return
            box.put(msg)
        elif kind == FWD_DONE:
            with self._cond_lock:
                self._fwd_done.add(msg.microbatch)
                self._release_if_done(msg.microbatch)
                self._cond.notify_all()
            self._runq.poke(here=True)  # (a queued forward may now be admitted)
        elif kind == MB_DONE:
            with self._cond_lock:
                self._mb_done.add(msg.microbatch)
                self._fwd_done.add(msg.microbatch)
                self._drop_if_done(msg.microbatch)
            self._runq.poke(here=True)
        elif kind == NESTED_DONE:
            with self._cond_lock:
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
        with self._cond_lock:
            self._cond.notify_all()
        self.turns.wake_all()
        self.step_end.put(Message("error", meta=str(exc)))


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


# Behind every schedule's priorities ((0 or 1, microbatch)): work done only when none waits.
_IDLE_PRIORITY = (2, 0)


