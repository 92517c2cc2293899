"""The module server: calls to modules owned by another pipeline rank become requests to it.

After partitioning, every module this rank does not own gets an instance-level `forward` that
forwards the call to the owner (`nn.Module.__call__` looks `forward` up on the instance). The
caller flattens the arguments (tensors travel as tensors, everything else is pickled in the
header), sends a FWD_REQ and waits for the outputs. The owner runs the real module on the received
inputs, marked `requires_grad` where the caller's were, keeps inputs and outputs until the
backward, and answers.

Autograd spans ranks through `_RemoteCall`, an autograd.Function standing for the remote call:
its backward sends the output gradients (BWD_REQ); the owner runs `torch.autograd.backward` on the
graph it kept and answers with the inputs' gradients. Parameter gradients therefore accumulate
where the parameters live. A zero-size "anchor" input that requires grad makes the call part of
the graph even when none of its real inputs do (the first stage's inputs are data), so the
owner's parameters still get their backward.

Each rank runs one module forward or backward at a time (the ComputeLock, by schedule priority);
a thread gives the lock up while it waits on the network, so nested calls (rank 1 calling back into
rank 0 during rank 0's request) and several microbatches in flight never deadlock.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .scheduler import BACKWARD, FORWARD, ComputeLock, Schedule
from .timeline import Timeline
from .transport import (BWD_REQ, BWD_RESP, FWD_REQ, FWD_RESP, STEP_END, Message, PipelineError,
                        Transport)

logger = logging.getLogger(__name__)


# ---- the per-thread execution context ------------------------------------------------------

class _Context(threading.local):
    step: int = -1
    microbatch: int = -1
    in_step: bool = False
    tracing: bool = False
    forward_done: bool = False  # this microbatch's body reached model.backward


ctx = _Context()


# ---- flattening arguments and outputs ------------------------------------------------------

class _Slot:
    """Stands for the i-th tensor in a flattened structure."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self):
        return (_Slot, (self.index,))


def _map_leaves(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """Rebuild nested list/tuple/namedtuple/dict (subclasses too) with `fn` applied to leaves."""
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_leaves(x, fn) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_leaves(x, fn) for x in obj)
    if isinstance(obj, dict):
        # A dict subclass (e.g. Hugging Face's ModelOutput) is rebuilt without calling its
        # __init__, whose signature is its own.
        out = {} if type(obj) is dict else type(obj).__new__(type(obj))
        if type(obj) is not dict:
            dict.__init__(out)
        for k, v in obj.items():
            out[k] = _map_leaves(v, fn)
        return out
    return fn(obj)


def flatten(obj: Any) -> Tuple[Any, List[torch.Tensor]]:
    """Replace every tensor in nested containers by a slot; return (template, tensors)."""
    tensors: List[torch.Tensor] = []

    def to_slot(leaf):
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            return _Slot(len(tensors) - 1)
        return leaf

    return _map_leaves(obj, to_slot), tensors


def fill(template: Any, tensors: List[torch.Tensor]) -> Any:
    """Inverse of `flatten`."""
    return _map_leaves(template, lambda leaf: tensors[leaf.index] if isinstance(leaf, _Slot) else leaf)


# ---- caller side ---------------------------------------------------------------------------

@dataclass
class _Call:
    call_id: int
    owner: int
    module: str
    step: int
    microbatch: int
    n_inputs: int
    input_requires_grad: List[bool]
    template: Any = None
    out_template: Any = None
    out_requires_grad: List[bool] = field(default_factory=list)


class _RemoteCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx_, server: "ModuleServer", call: _Call, anchor, *inputs):
        outputs = server._remote_forward(call, list(inputs), grad_enabled=True)
        ctx_.server, ctx_.call = server, call
        ctx_.set_materialize_grads(False)
        ctx_.mark_non_differentiable(*[t for t, rg in zip(outputs, call.out_requires_grad) if not rg])
        return tuple(outputs)

    @staticmethod
    def backward(ctx_, *grads):
        in_grads = ctx_.server._remote_backward(ctx_.call, list(grads))
        return (None, None, None, *in_grads)


class ModuleServer:
    """Serves this rank's modules to its pipeline peers and sends calls for theirs."""

    def __init__(self, root: nn.Module, assignment: Dict[str, int], pp_rank: int,
                 lock: ComputeLock, timeline: Timeline, timeout_s: float) -> None:
        self.root = root
        self.assignment = assignment
        self.me = pp_rank
        self.lock = lock
        self.timeline = timeline
        self.timeout_s = timeout_s
        self.transport: Optional[Transport] = None
        self.schedule: Optional[Schedule] = None
        self.modules = dict(root.named_modules(remove_duplicate=False))
        self._ids = itertools.count()
        self._pending: Dict[int, "queue.Queue[Message]"] = {}
        self._pending_lock = threading.Lock()
        self._saved: Dict[Tuple[int, int], tuple] = {}  # (caller, call id) -> (inputs, outputs, mb)
        self.peak_live_microbatches = 0
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix=f"smp-serve-{pp_rank}")
        self.step_end: "queue.Queue[Message]" = queue.Queue()
        self._anchor = torch.zeros((), requires_grad=True)
        self._proxies: List[nn.Module] = []
        # "This rank's backward work for the step is done" (every microbatch ran forward here and
        # no graph is left): lets data parallelism start reducing early.
        self.on_local_backward_done: Optional[Callable[[], None]] = None
        self._expected_microbatches = 0
        self._forward_microbatches: set = set()
        self._backwards_running = 0
        self._progress_lock = threading.Lock()
        self._real_forward: Dict[str, Callable[..., Any]] = {}

    # Proxies -------------------------------------------------------------------------------
    def install_proxies(self) -> None:
        """Route calls: modules owned elsewhere go to their owner; on pp_rank 0, the modules the
        root's glue code calls directly become local regions, so that glue (which runs in the
        microbatch threads) never holds the compute lock and relays replies without waiting."""
        for name, module in self.modules.items():
            self._real_forward.setdefault(name, module.forward)
        regions = set(_glue_callees(self.root, self.assignment)) if self.me == 0 else set()
        for name, owner in self.assignment.items():
            module = self.modules.get(name)
            if module is None or name == "":
                continue
            if owner != self.me or name in regions:
                module.forward = _make_proxy(self, name, owner)
                self._proxies.append(module)

    def remove_proxies(self) -> None:
        for module in self._proxies:
            module.__dict__.pop("forward", None)
        self._proxies.clear()

    # Messages ------------------------------------------------------------------------------
    def dispatch(self, msg: Message) -> None:
        """Called on a transport receiver thread for every message of the step."""
        if msg.kind in (FWD_RESP, BWD_RESP):
            with self._pending_lock:
                box = self._pending.get(msg.call_id)
            if box is None:
                self.transport.fail(PipelineError(
                    f"pp rank {self.me} got an unexpected {msg.describe()} reply from pp rank {msg.src}"))
                return
            box.put(msg)
        elif msg.kind in (FWD_REQ, BWD_REQ):
            self._pool.submit(self._serve, msg)
        elif msg.kind == STEP_END:
            self.step_end.put(msg)
        else:
            self.transport.fail(PipelineError(f"pp rank {self.me}: unknown message {msg.kind!r}"))

    def wake_all(self, exc: BaseException) -> None:
        """Transport failure: wake every thread waiting for a reply so it raises."""
        with self._pending_lock:
            boxes = list(self._pending.values())
        for box in boxes:
            box.put(Message("error", meta=str(exc)))
        self.step_end.put(Message("error", meta=str(exc)))

    def _wait(self, box: "queue.Queue[Message]", peer: int, what: str) -> Message:
        """Wait for a reply with the compute lock given up; bounded by SMSHIM_TIMEOUT."""
        with self.lock.released(), self.timeline.span(f"wait {what}", "wait", peer=peer):
            try:
                msg = box.get(timeout=self.timeout_s)
            except queue.Empty:
                err = PipelineError(
                    f"pp rank {self.me} waited {self.timeout_s:.0f} s for pp rank {peer} "
                    f"(global rank {self.transport.ranks[peer]}): {what}. Rank {peer} may have "
                    "stopped calling the step function, or died (SMSHIM_TIMEOUT sets this limit)")
                self.transport.fail(err)
                raise err from None
        if msg.kind == "error":
            raise PipelineError(f"pp rank {self.me}, waiting for {what}: {msg.meta}")
        return msg

    def _new_box(self) -> Tuple[int, "queue.Queue[Message]"]:
        call_id = next(self._ids)
        box: "queue.Queue[Message]" = queue.Queue()
        with self._pending_lock:
            self._pending[call_id] = box
        return call_id, box

    def _drop_box(self, call_id: int) -> None:
        with self._pending_lock:
            self._pending.pop(call_id, None)

    # Caller side ---------------------------------------------------------------------------
    def call(self, name: str, owner: int, args: tuple, kwargs: dict) -> Any:
        if not ctx.in_step:
            from .errors import FwdExecutionNotInStepFnError

            raise FwdExecutionNotInStepFnError(
                f"module '{name}' lives on pipeline rank {owner}: it can only run inside an "
                "@smp.step function")
        template, tensors = flatten((args, kwargs))
        call = _Call(-1, owner, name, ctx.step, ctx.microbatch, len(tensors),
                     [t.requires_grad for t in tensors])
        call.template = template
        if torch.is_grad_enabled():
            outputs = list(_RemoteCall.apply(self, call, self._anchor, *tensors))
        else:
            outputs = self._remote_forward(call, tensors, grad_enabled=False)
        return fill(call.out_template, outputs)

    def _remote_forward(self, call: _Call, tensors: List[torch.Tensor], grad_enabled: bool):
        if call.owner == self.me:  # a local region: the same path, without the network
            call.call_id = next(self._ids)
            out_template, outs, out_rg = self._execute_forward(
                self.me, call.call_id, call.module, call.step, call.microbatch, call.template,
                list(tensors), call.input_requires_grad, grad_enabled)
            call.out_template, call.out_requires_grad = out_template, out_rg
            return [t.detach() for t in outs]
        call_id, box = self._new_box()
        call.call_id = call_id
        try:
            self.transport.send(call.owner, Message(
                FWD_REQ, call.step, call.microbatch, call_id, call.module,
                meta=(call.template, call.input_requires_grad, grad_enabled), tensors=tensors))
            reply = self._wait(box, call.owner, f"forward of module '{call.module}' "
                                                f"(microbatch {call.microbatch}, step {call.step})")
        finally:
            self._drop_box(call_id)
        call.out_template, call.out_requires_grad = reply.meta
        return reply.tensors

    def _remote_backward(self, call: _Call, grads: List[Optional[torch.Tensor]]):
        if call.owner == self.me:
            in_grads = self._execute_backward(self.me, call.call_id, call.module, call.step,
                                              call.microbatch, grads)
            return in_grads + [None] * (call.n_inputs - len(in_grads))
        call_id, box = self._new_box()
        present = [g is not None for g in grads]
        try:
            self.transport.send(call.owner, Message(
                BWD_REQ, call.step, call.microbatch, call_id, call.module,
                meta=(call.call_id, present), tensors=[g for g in grads if g is not None]))
            reply = self._wait(box, call.owner, f"backward of module '{call.module}' "
                                                f"(microbatch {call.microbatch}, step {call.step})")
        finally:
            self._drop_box(call_id)
        it = iter(reply.tensors)
        in_grads = [next(it) if has else None for has in reply.meta]
        return in_grads + [None] * (call.n_inputs - len(in_grads))  # graph was gone: no grads

    # Owner side ----------------------------------------------------------------------------
    def _serve(self, msg: Message) -> None:
        ctx.step, ctx.microbatch, ctx.in_step = msg.step, msg.microbatch, True
        from .state import state

        state.microbatch = msg.microbatch
        try:
            if msg.kind == FWD_REQ:
                self._serve_forward(msg)
            else:
                self._serve_backward(msg)
        except BaseException as e:  # noqa: BLE001
            err = PipelineError(f"pp rank {self.me} failed running the {msg.describe()} "
                                f"requested by pp rank {msg.src}: {type(e).__name__}: {e}")
            logger.exception("%s", err)
            self.transport.fail(err)

    def _priority(self, kind: str, mb: int):
        return self.schedule.priority(kind, mb) if self.schedule else (0, mb)

    def _serve_forward(self, msg: Message) -> None:
        template, requires, grad_enabled = msg.meta
        out_template, outs, out_rg = self._execute_forward(
            msg.src, msg.call_id, msg.module, msg.step, msg.microbatch, template, msg.tensors,
            requires, grad_enabled)
        self.transport.send(msg.src, Message(FWD_RESP, msg.step, msg.microbatch, msg.call_id,
                                             msg.module, meta=(out_template, out_rg),
                                             tensors=[t.detach() for t in outs]))

    def _serve_backward(self, msg: Message) -> None:
        fwd_call_id, present = msg.meta
        it = iter(msg.tensors)
        grads = [next(it) if has else None for has in present]
        in_grads = self._execute_backward(msg.src, fwd_call_id, msg.module, msg.step,
                                          msg.microbatch, grads)
        self.transport.send(msg.src, Message(
            BWD_RESP, msg.step, msg.microbatch, msg.call_id, msg.module,
            meta=[g is not None for g in in_grads], tensors=[g for g in in_grads if g is not None]))

    def _execute_forward(self, caller: int, call_id: int, name: str, step: int, mb: int,
                         template: Any, tensors: List[torch.Tensor], requires: List[bool],
                         grad_enabled: bool):
        """Run module `name` on inputs cut from the caller's graph; keep the graph for backward."""
        inputs = [t.detach().requires_grad_(rg and grad_enabled)
                  if (t.is_floating_point() or t.is_complex()) else t
                  for t, rg in zip(tensors, requires)]
        with self.lock.hold(self._priority(FORWARD, mb)), \
                self.timeline.span(name or "<root>", "forward", microbatch=mb, step=step,
                                   caller=caller), \
                torch.set_grad_enabled(grad_enabled):
            args, kwargs = fill(template, inputs)
            out = self._real_forward[name](*args, **kwargs)
        out_template, outs = flatten(out)
        out_rg = [grad_enabled and t.requires_grad for t in outs]
        if any(out_rg):
            with self._progress_lock:
                self._forward_microbatches.add(mb)
                self._saved[(caller, call_id)] = (inputs, outs, mb)
            # Microbatches whose activations this rank holds right now (for the memory benchmark).
            live = len({saved[2] for saved in list(self._saved.values())})
            self.peak_live_microbatches = max(self.peak_live_microbatches, live)
        return out_template, outs, out_rg

    def _execute_backward(self, caller: int, call_id: int, name: str, step: int, mb: int,
                          grads: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
        """Backward through the graph kept for (caller, call_id); returns the inputs' gradients."""
        with self._progress_lock:
            saved = self._saved.pop((caller, call_id), None)
            if saved is None:
                return []
            self._backwards_running += 1
        try:
            inputs, outs, _ = saved
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            if pairs:
                with self.lock.hold(self._priority(BACKWARD, mb)), \
                        self.timeline.span(name or "<root>", "backward", microbatch=mb, step=step,
                                           caller=caller):
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            in_grads = [t.grad if t.requires_grad else None for t in inputs]
        finally:
            with self._progress_lock:
                self._backwards_running -= 1
                done = (not self._saved and self._backwards_running == 0
                        and len(self._forward_microbatches) >= self._expected_microbatches)
        if done and self.on_local_backward_done is not None:
            self.on_local_backward_done()
        return in_grads

    def begin_step(self, microbatches: int) -> None:
        self._expected_microbatches = microbatches
        self._forward_microbatches = set()

    def end_step(self) -> None:
        """Drop graphs whose backward never came (outputs unused, or an eval step)."""
        self._saved.clear()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


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
