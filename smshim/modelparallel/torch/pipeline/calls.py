"""The caller's side of the module server (`ModuleServer` is built from this and its siblings):
a call to a module owned by another rank becomes a request, whose outputs are handles
(`RemoteTensor`) on pp_rank 0, predicted from earlier calls with the same input shapes, and real
values for a nested call; `_RemoteCall` stands for the call in the caller's autograd graph."""

from __future__ import annotations

import logging
import pickle
import queue
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from smshim.modelparallel.torch.errors import (
    FwdExecutionNotInStepFnError,
    SMPRuntimeError,
)
from smshim.modelparallel.torch.pipeline.context import ctx
from smshim.modelparallel.torch.pipeline.remote_tensor import RemoteTensor, _Cell, _used
from smshim.modelparallel.torch.pipeline.structure import _Slot, dumps_template, fill, flatten_call
from smshim.modelparallel.torch.pipeline.messages import (BWD_REQ, FETCH, FWD_REQ, MB_DONE, PREFETCH, SEND_TO, VALUE, Message, PipelineError)
from smshim.modelparallel.torch.precision import autocast_state

logger = logging.getLogger(__name__)

# The template of a call with one tensor argument (flatten_call's, shared), and its bytes.
_ONE_ARG = flatten_call((torch.empty(0),), {})[0]
_ONE_ARG_BYTES = dumps_template(_ONE_ARG)


# SMSHIM_PREDICT=0: every remote call waits for its outputs' metadata (no prediction from earlier
# calls); for modules whose output structure or shapes depend on input values, not input shapes.
PREDICT_ENV = "SMSHIM_PREDICT"

# SMSHIM_MERGE_CHAINS=0: every remote call is a node of its own in pp_rank 0's autograd graph
# (see `_Chain`).
MERGE_CHAINS_ENV = "SMSHIM_MERGE_CHAINS"

# What a value waited for is, for errors: a text, or a function that says it (a request's
# inputs are named only if they must be waited for: an f-string per request is measurable).
_What = Union[str, Callable[[], str]]

# What a call's handles are, for errors (`_Cell.what`).
_OUTPUT_WHAT = "forward output {} of module '{}'"
_IGRAD_WHAT = "gradient of input {} of module '{}'"

# _Cell.fetching: asked for with PREFETCH (True: with FETCH).
_LATER = "later"


class _Chain:
    """Calls of one microbatch to one owner, each taking the previous one's outputs and nothing
    else that needs a gradient (a stage's modules in a `ModuleList` loop). In pp_rank 0's graph
    each of them stands on the chain's first call's inputs, so its autograd runs one node (the
    last call's) for the whole chain: its backward request has the owner backpropagate through
    every call down to the first (`through`), and returns the first one's input gradients. The
    owner runs each later call on the previous one's outputs as they are in its graph (`below`
    in the forward request): there the chain is one graph, and that backward one pass. The
    other nodes are not reached, unless glue code or another call used an output of the chain
    after the next call took it (`shared`): then the owner keeps the chain's graphs through each
    backward for the others that may come, until the microbatch is over; the gradients sum up
    as they would through separate nodes.

    `inputs`, the first call's inputs, are what a next call's node stands on; they are dropped
    when the microbatch's forward is over (no call links to the chain then), so that pp_rank 0
    holds no activation for a chain while the microbatch waits for its backward. `request`: the
    call id of the request that the chain's latest call travels in (a next call may follow it
    on in that request)."""

    __slots__ = ("shared", "inputs", "request")

    def __init__(self, inputs: Tuple[torch.Tensor, ...]) -> None:
        self.shared = False
        self.inputs: Optional[Tuple[torch.Tensor, ...]] = inputs
        self.request = -1


@dataclass(init=False)
class _Call:
    owner: int
    module: str
    step: int
    microbatch: int
    template: Any
    in_meta: List[Tuple[torch.Size, torch.dtype]]
    requires: List[bool]         # input i needs a gradient
    # pp_rank 0, a call that is not a chain's later call (only these are read: `_input_kinds`):
    remote_in: Sequence[bool] = ()  # input i is a handle (its gradient may stay remote)
    leaf_in: Sequence[bool] = ()    # input i is a leaf (its gradient must be real)
    call_id: int = -1
    # The call id of the request this call travels in: its own, or its chain's predecessor's
    # request's when it follows on in it (`_follow_on`). The owner marks a request's forward
    # done under that id (serving.py, `_serve_forward`), which the call's backward waits for.
    request: int = -1
    out_template: Any = None
    out_requires_grad: Sequence[bool] = ()
    # pp_rank 0, a chain's call (see `_Chain`): the chain's first call, whose inputs its node
    # stands on (None: this one), the calls below it, nearest first ((call id, module)), the
    # chain, and whether its own node may be reached.
    first: Optional["_Call"] = None
    through: Tuple[Tuple[int, str], ...] = ()
    chain: Optional[_Chain] = None
    reached: bool = False
    tensors: Optional[List[torch.Tensor]] = None  # the call's inputs, until its request leaves
    # A chain's later call found by `_next_in_chain`: (template bytes, autocast state,
    # prediction, input encodings), what `_forward` would otherwise work out.
    planned: Optional[tuple] = None

    def __init__(self, owner: int, module: str, step: int, microbatch: int, template: Any,
                 in_meta: List[Tuple[torch.Size, torch.dtype]], requires: List[bool]) -> None:
        # (The other fields keep their class defaults until set: one remote call makes one.)
        self.owner, self.module, self.step, self.microbatch = owner, module, step, microbatch
        self.template, self.in_meta, self.requires = template, in_meta, requires

    def what(self, direction: str) -> str:
        return (f"{direction} of module '{self.module}' (microbatch {self.microbatch}, "
                f"step {self.step})")


def _input_kinds(call: _Call, tensors: List[torch.Tensor]) -> None:
    """Which of `call`'s inputs are handles, and which leaves (pp_rank 0; not for a chain's
    later call, whose first call's are the ones read)."""
    remote_in, leaf_in = [], []
    for t in tensors:
        remote_in.append(isinstance(t, RemoteTensor))
        leaf_in.append(t.grad_fn is None)
    call.remote_in, call.leaf_in = remote_in, leaf_in


@dataclass
class _Prediction:
    out_template: Any
    metas: List[Tuple[Tuple[int, ...], torch.dtype, bool]]
    expect: bytes  # what the owner must find, pickled as it pickles what it found
    requires_grad: Tuple[bool, ...] = ()  # of each output (from `metas`)

    def __post_init__(self) -> None:
        self.requires_grad = tuple(rg for _, _, rg in self.metas)


class _RemoteCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx_, server: "CallerSide", call: _Call, anchor, *inputs):
        # `inputs` are the chain's first call's (the node's inputs); the request takes the call's.
        tensors, call.tensors = call.tensors, None
        outputs = server._forward(call, tensors, grad_enabled=True)
        ctx_.server, ctx_.call = server, call
        ctx_.set_materialize_grads(False)
        if not all(call.out_requires_grad):
            ctx_.mark_non_differentiable(
                *[t for t, rg in zip(outputs, call.out_requires_grad) if not rg])
        return tuple(outputs)

    @staticmethod
    def backward(ctx_, *grads):
        in_grads = ctx_.server._backward(ctx_.call, list(grads))
        return (None, None, None, *in_grads)


# `_RemoteCall.apply` without `Function.apply`'s Python wrapper (its checks for `setup_context`
# and functorch's wrappers cost a tenth of a small module call), which calls this after its
# checks (torch/autograd/function.py); unless functorch transforms are active, which need it.
_C_APPLY = super(torch.autograd.Function, _RemoteCall).apply


# A module with one tensor output (most): its expectation, pickled once per output shape. The
# owner checks each forward's outputs against the caller's prediction by these bytes.
_ONE_OUTPUT: Dict[tuple, bytes] = {}


def _expectation(out_template: Any, metas) -> bytes:
    if type(out_template) is not _Slot:
        return pickle.dumps((out_template, metas), protocol=pickle.HIGHEST_PROTOCOL)
    key = (out_template.index, tuple(metas))
    data = _ONE_OUTPUT.get(key)
    if data is None:
        if len(_ONE_OUTPUT) > 4096:  # (shapes that vary from call to call)
            _ONE_OUTPUT.clear()
        data = _ONE_OUTPUT[key] = pickle.dumps((out_template, metas),
                                               protocol=pickle.HIGHEST_PROTOCOL)
    return data


def _follow_on(msg: Message, below: int, call: tuple, inline: List[torch.Tensor]) -> bool:
    """Add a chain's later call to `msg`, its predecessor's request, if `msg` is that request
    (or carries its predecessor as its last follow-on) and still held: the owner then serves
    the chain's calls as one request (one dispatch, one turn of the run queue and the compute
    lock; serving.py, `_serve_forward`). `call`: (call id, module, template, input encodings,
    requires, grad enabled, expectation, autocast state, below); its inline tensors join the
    request's, and its encodings are shifted to their places there. Under the outbox's lock:
    the request cannot leave meanwhile."""
    if msg.kind != FWD_REQ or msg.meta[4] is not None:  # (a request waited for is not held)
        return False
    more = msg.meta[8]
    if (more[-1][0] if more else msg.call_id) != below:
        return False
    if inline:
        base = len(msg.tensors)
        call = call[:3] + ([_shifted(e, base) for e in call[3]],) + call[4:]
        msg.tensors.extend(inline)
    more.append(call)
    return True


def _shifted(enc, base: int):
    """An input's encoding (`CallerSide._encode`) with its inline index moved by `base`."""
    if enc is None or enc[0] == "r":
        return enc
    if enc[0] == "t":
        return ("t", enc[1] + base)
    return ("s", [_shifted(term, base) for term in enc[1]])


def _describe(out_template: Any, metas) -> str:
    shapes = ", ".join(f"{tuple(s)} {str(d).replace('torch.', '')}" for s, d, _ in metas)
    return f"{type(out_template).__name__} of tensors [{shapes}]"


def _make_proxy(server: "CallerSide", name: str, owner: int) -> Callable[..., Any]:
    def remote_forward(*args, **kwargs):
        return server.call(name, owner, args, kwargs)

    remote_forward.__name__ = f"remote_forward[{name} on pp rank {owner}]"
    return remote_forward



class CallerSide:
    """A part of `ModuleServer` (server.py), which holds the state these methods share."""


    # Caller side ---------------------------------------------------------------------------
    def call(self, name: str, owner: int, args: tuple, kwargs: dict) -> Any:
        if not ctx.in_step:
            raise FwdExecutionNotInStepFnError(
                f"module '{name}' lives on pipeline rank {owner}: it can only run inside an "
                "@smp.step function")
        if owner == self.me:
            # A function served under a name (activation checkpointing's groups of the root's
            # children) called where it lives: pp_rank 0's step body runs its own modules in
            # its own graph, under the compute lock it holds (pipeline.py).
            return self.real_forward(name)(*args, **kwargs)
        if self.me == 0 and len(args) == 1 and not kwargs and type(args[0]) is RemoteTensor:
            outputs = self._next_in_chain(name, owner, args[0])
            if outputs is not None:
                return outputs
        template, tensors = flatten_call(args, kwargs)
        grad = torch.is_grad_enabled()
        # (One pass, not a comprehension per list: this runs for every remote call.)
        in_meta, requires = [], []
        for t in tensors:
            in_meta.append((t.shape, t.dtype))
            requires.append(grad and t.requires_grad and (t.is_floating_point() or t.is_complex()))
        call = _Call(owner, name, ctx.step, ctx.microbatch, template, in_meta, requires)
        if ctx.driver and not ctx.forward_done and not self.deterministic \
                and self.lock.waited_for():
            self._step_aside()
        if grad:
            call.tensors = tensors
            apply = _RemoteCall.apply if torch._C._are_functorch_transforms_active() \
                else _C_APPLY
            if self.me == 0:
                self._link(call, tensors)
                if call.first is None:
                    _input_kinds(call, tensors)
                outputs = apply(self, call, self._anchor, *call.chain.inputs)
            else:
                outputs = apply(self, call, self._anchor, *tensors)
        else:
            if self.me == 0:
                _input_kinds(call, tensors)
            outputs = self._forward(call, tensors, grad_enabled=False)
        out_template = call.out_template
        if type(out_template) is _Slot:  # (one tensor, most modules: `fill` without its call)
            return outputs[out_template.index]
        return fill(out_template, list(outputs))


    def _next_in_chain(self, name: str, owner: int, h: RemoteTensor) -> Optional[Any]:
        """(pp_rank 0.) `call` for a chain's later call in its commonest form (a stage's
        modules in a `ModuleList` loop): with grad, its one argument `h` the output of this
        microbatch's latest call to `owner`, which nothing else used and whose value is not
        here, and its outputs predicted. What `_link` and `_forward` would work out for it
        is known from `h`, without their walks over the arguments (~3 % of pp_rank 0's
        interpreter work on tiny modules). None, having done nothing: `call` serves any other
        case."""
        cell = h._cell
        prev = cell.producer() if cell.producer is not None else None
        if prev is None or cell.used or prev.owner != owner or cell.value is not None \
                or not self.merge_chains or not self.predict:
            return None
        chain = prev.chain
        if chain.inputs is None or prev.microbatch != ctx.microbatch or prev.step != ctx.step \
                or ctx.in_backward or not h.requires_grad or not torch.is_grad_enabled() \
                or torch._C._are_functorch_transforms_active():
            return None
        in_meta = [(h.shape, h.dtype)]
        amp = autocast_state.capture()
        pred = self._predictions.get((name, _ONE_ARG_BYTES, True, amp, ((in_meta[0], True),)))
        if pred is None:
            return None
        call = _Call(owner, name, ctx.step, ctx.microbatch, _ONE_ARG, in_meta, [True])
        if ctx.driver and not ctx.forward_done and not self.deterministic \
                and self.lock.waited_for():  # (as in `call`)
            self._step_aside()
        # (`_link`'s chain link, and `_encode`'s handle held by its owner.)
        call.first = prev.first or prev
        call.chain = chain
        call.through = ((prev.call_id, prev.module),) + prev.through
        cell.used = True
        cell.on_reuse = lambda: self._reused(prev)
        call.planned = (_ONE_ARG_BYTES, amp, pred, [("r", cell.key, owner)])
        outputs = _C_APPLY(self, call, self._anchor, *chain.inputs)
        if type(pred.out_template) is _Slot:
            return outputs[pred.out_template.index]
        return fill(pred.out_template, list(outputs))

    def _link(self, call: _Call, tensors: List[torch.Tensor]) -> None:
        """(pp_rank 0, a call with grad.) Make `call` the next of its predecessor's chain if
        every input that needs a gradient is a distinct output of one earlier call of this
        microbatch to the same owner, not used so far (`_Chain`); else it starts a chain. Any
        other use of a handle counts (`_Cell.used`): one after the link marks the chain shared."""
        prev = None
        cells = []
        for t, rg in zip(tensors, call.requires):
            if not isinstance(t, RemoteTensor):
                if rg:
                    prev = False
                continue
            cell = t._cell
            if rg and prev is not False:
                producer = cell.producer() if cell.producer is not None else None
                if cell.used or producer is None or (prev is not None and producer is not prev) \
                        or producer.owner != call.owner or cell in cells:
                    prev = False
                else:
                    prev = producer
                    cells.append(cell)
                    continue
            _used(cell)
        # (`_next_in_chain` makes this link for its case without coming here: keep the two
        # rules alike.)
        if prev and self.merge_chains and not ctx.in_backward \
                and prev.microbatch == call.microbatch and prev.step == call.step \
                and prev.chain.inputs is not None:
            call.first = prev.first or prev
            call.chain = prev.chain
            call.through = ((prev.call_id, prev.module),) + prev.through
            reuse = lambda: self._reused(prev)  # noqa: E731
            for cell in cells:
                cell.used = True
                cell.on_reuse = reuse
            # (The predecessor's node is not reached now: this call's node stands for it.)
        else:
            for cell in cells:
                _used(cell)
            call.chain = _Chain(tuple(tensors))
            self._open_chains[call.microbatch].append(call.chain)
            self._backwards_to_issue[call.microbatch] += 1  # (one body per microbatch)

    def _reused(self, call: _Call) -> None:
        """An output of `call` was used after the next call of its chain took it: its node may
        be reached too (see `_Chain`)."""
        call.chain.shared = True
        if not call.reached:
            call.reached = True
            self._backwards_to_issue[call.microbatch] += 1

    def _forward(self, call: _Call, tensors: List[torch.Tensor], grad_enabled: bool):
        # Only pp_rank 0 keeps handles (it says when a microbatch is over); a nested call, made
        # from inside a module on another rank, waits for the values.
        sync = self.me != 0
        if call.planned is not None:  # (`_next_in_chain`: pp_rank 0, predicted, one handle)
            template_bytes, amp, pred, enc = call.planned
            inline: List[torch.Tensor] = []
        else:
            template_bytes = dumps_template(call.template)
            amp = autocast_state.capture()  # the module runs under the caller's autocast
            pkey = (call.module, template_bytes, grad_enabled, amp,
                    tuple(zip(call.in_meta, call.requires)))  # (torch.Size hashes as a tuple)
            pred = None if (sync or not self.predict) else self._predictions.get(pkey)
            enc, inline = self._encode(tensors, call.owner, call.microbatch, hold=not sync)
        call.call_id = call_id = next(self._ids)
        # pp_rank 0's requests that need no reply are held to leave with the next ones to the
        # same rank (a stage's calls of one microbatch: one frame; Transport.send, `hold`).
        reply = "data" if sync else ("meta" if pred is None else None)
        if not sync and call.first is None:  # (a chain's later call: its first said this)
            with self._cond_lock:
                self._visited[call.microbatch].add(call.owner)
                for r, h in zip(call.requires, call.remote_in):
                    if r and not h:
                        self._pushers[call.microbatch].add(call.owner)
                        break
        box = self._new_box(call_id) if reply else None
        # A chain's later call: the owner runs the module on the previous call's outputs as
        # they are in its graph, so that the chain's backward is one pass (`_Chain`).
        below = call.through[0][0] if call.first is not None else None
        expect = pred.expect if pred is not None else None
        try:
            # A chain's later call whose predecessor's request is still held: it travels in
            # that request (`_follow_on`), served with it as one.
            # (Past another microbatch's done notice queued meanwhile: it depends on nothing.)
            if below is None or reply is not None or not self.transport.extend_last(
                    call.owner, lambda msg: _follow_on(msg, below, (
                        call_id, call.module, template_bytes, enc, call.requires, grad_enabled,
                        expect, amp, below), inline), past=(MB_DONE,)):
                self.transport.send(call.owner, Message(
                    FWD_REQ, call.step, call.microbatch, call_id, call.module,
                    meta=(template_bytes, enc, call.requires, grad_enabled, reply, expect, amp,
                          below, []),
                    tensors=inline), hold=reply is None)
                call.request = call_id
                if call.chain is not None:
                    call.chain.request = call_id
            else:
                call.request = call.chain.request
            if box is not None:
                msg = self._wait_reply(box, call.owner, call.what("forward"))
        finally:
            if box is not None:
                self._drop_box(call_id)
        if reply == "data":
            call.out_template, metas = msg.meta
            call.out_requires_grad = tuple(rg for _, _, rg in metas)
            return msg.tensors
        if reply == "meta":
            out_template, metas = msg.meta
            pred = _Prediction(out_template, metas, _expectation(out_template, metas))
            self._predictions[pkey] = pred
        call.out_template = pred.out_template
        call.out_requires_grad = pred.requires_grad
        # (A later call of the chain may link to it; weak: a handle kept after the step does
        # not keep the call's inputs.)
        producer = weakref.ref(call) if call.chain is not None else None
        return [RemoteTensor(_Cell(call.owner, (self.me, call_id, "out", i),
                                   (_OUTPUT_WHAT, i, call.module),
                                   call.microbatch, self._fetch, step=call.step,
                                   producer=producer),
                             shape, dtype, self.device)
                for i, (shape, dtype, _) in enumerate(pred.metas)]


    def _backward(self, call: _Call, grads: List[Optional[torch.Tensor]]):
        """The node's backward: the gradients of the chain's first call's inputs (`_Chain`),
        which are the call's own unless it is a chain's later call."""
        first = call.first or call
        if call.chain is not None:
            call.chain.inputs = None  # (no call links to the chain any more)
        n = len(first.requires)
        sync = self.me != 0
        enc, inline = self._encode(grads, call.owner, call.microbatch, hold=not sync)
        # Gradients this rank will need as values come unasked; the others stay with the owner
        # until the next call up the chain asks for them to be sent where it runs.
        push = [i for i in range(n) if first.requires[i] and (sync or not first.remote_in[i])]
        self.transport.send(call.owner, Message(
            BWD_REQ, call.step, call.microbatch, call.call_id, call.module,
            meta=(enc, push, call.through, call.chain is not None and call.chain.shared,
                  call.request),
            tensors=inline), hold=not sync)
        self._note_backward_begun(call.microbatch)  # (once its request is queued: see there)
        # The microbatch's last backward request has left (no other call of it waits for its
        # backward): the input gradients this rank needs come as values, waited for here, not as
        # handles that its own backward would read through RemoteTensor's dispatch, op by op
        # (on tiny modules, 10-15 % of the step). Not before the last: the engine would wait
        # here while requests for other stages, which could compute meanwhile, wait to leave.
        last = False
        if not sync:
            left = self._backwards_to_issue[call.microbatch] - 1
            self._backwards_to_issue[call.microbatch] = left
            last = left == 0
        in_grads: List[Optional[torch.Tensor]] = []
        for i in range(n):
            if not first.requires[i]:
                in_grads.append(None)
                continue
            cell = _Cell(call.owner, (self.me, call.call_id, "igrad", i),
                         (_IGRAD_WHAT, i, first.module), call.microbatch,
                         self._fetch, pushed=i in push, step=call.step)
            if sync or first.leaf_in[i] or (last and i in push):
                # (A leaf: autograd would store a handle in its .grad.)
                in_grads.append(cell.resolve())
            else:
                shape, dtype = first.in_meta[i]
                in_grads.append(RemoteTensor(cell, shape, dtype, self.device))
        return in_grads


    def _encode(self, tensors: List[Optional[torch.Tensor]], dst: int, mb: int,
                hold: bool = False):
        """How `dst` finds each tensor: sent inline ("t", i), held by dst or sent to it by its
        owner ("r", key, owner), or a lazy sum of such ("s", [...]); None stays None."""
        for t in tensors:
            if t is None or isinstance(t, (RemoteTensor, _Cell)):
                break
        else:  # (plain tensors only, as most calls' inputs: each is sent inline)
            return [("t", i) for i in range(len(tensors))], list(tensors)
        if len(tensors) == 1 and type(tensors[0]) is RemoteTensor:
            # One handle held by dst (a chain's next call): named by its key.
            cell = tensors[0]._cell
            if cell.owner == dst and cell.value is None and cell.terms is None:
                return [("r", cell.key, dst)], []
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


    def _decode(self, enc, tensors: List[torch.Tensor], src: int, what: _What):
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
        step = ctx.step
        return self._get_value(key, cell.owner, lambda: f"{cell.what} (microbatch "
                                                        f"{cell.microbatch}, step {step})")


    def _ask(self, cell: _Cell, hold: bool = False, later: bool = False) -> None:
        """Ask a handle's owner for its value (the terms' owners, for a lazy sum), once, unless
        it comes anyway (pushed, or here already). `later`: it is not needed before the owner's
        next frame here, so it goes with that one instead of a frame of its own (asked again
        without `later`, it is sent at once)."""
        if cell.value is not None:
            return
        if cell.terms is not None:
            for term in cell.terms:
                if isinstance(term, _Cell):
                    self._ask(term, hold, later)
            return
        if cell.owner == self.me or cell.step != self._step:  # (the latter: _fetch says why)
            return
        with cell.lock:
            ask = not cell.pushed and (not cell.fetching or (cell.fetching == _LATER and not later))
            if ask:
                cell.fetching = _LATER if later else True
        if ask and self.store.peek(cell.key) is None:
            self.transport.send(cell.owner, Message(PREFETCH if later else FETCH, ctx.step,
                                                    cell.microbatch, meta=cell.key), hold=hold)


    def send_held(self) -> None:
        """Send what this thread held (`Transport.send(hold=True)`) now."""
        self.transport.flush()


    def _before_wait(self) -> bool:
        """This thread is about to wait on a peer with the compute lock given up. What it held
        leaves first (it may be what the wait is for), and queued requests get a runner of their
        own. A step body waiting in its forward gives the next microbatch's forward its turn:
        what it waits for comes from the later stages, after its own modules ran. Returns
        whether to take the lock back after the wait: not such a body's, whose forward code
        left (a loss computed from the last stage's output, say) runs as glue, without the lock,
        as the next microbatch's forward may hold it for long (a device's compute) and this
        microbatch's backward must not wait for that; its backward takes the lock again."""
        self.transport.flush()
        self._runq.step_down()
        if ctx.driver and not ctx.forward_done:
            self.turns.forward_over(ctx.microbatch)
            return False
        return True


    def _step_aside(self) -> None:
        """A step body in its forward calls a module on another rank while other work waits
        for the compute lock it holds (the backward of an earlier microbatch, whose gradient
        came). Its own modules have run: its forward turn is over and it gives the lock up, as
        when it waits for a peer, and issues the rest of its calls without it. Holding it would
        keep this rank's device idle for as long as issuing them takes, which on a rank that
        drives many stages is milliseconds per microbatch (docs/benchmarks.md)."""
        if self.timeline.enabled:
            self.timeline.instant("step aside", "lock", microbatch=ctx.microbatch, step=ctx.step)
        self.transport.flush()  # (what it held leaves before the other work computes)
        self.turns.forward_over(ctx.microbatch)
        self.lock.give_up_held()


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


    def _wait_reply(self, box: "queue.Queue[Message]", peer: int, what: str) -> Message:
        """Wait for a reply with the compute lock given up; bounded by SMSHIM_TIMEOUT."""
        take_back = self._before_wait()
        with self.lock.released(take_back), self.timeline.span(f"wait {what}", "wait", peer=peer):
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


    def _get_value(self, key, owner: int, what: _What) -> torch.Tensor:
        """A value this rank holds or is sent, waiting for it (lock given up). `what` names it
        in errors (a function: called only if the value must be waited for)."""
        value = self.store.peek(key)
        if value is not None:
            if ctx.in_backward and ctx.driver:  # (`_computing`, without its call on every value)
                self._computing()
            return value
        if callable(what):
            what = what()
        take_back = self._before_wait()
        with self.lock.released(take_back), self.timeline.span(f"wait {what}", "wait", peer=owner):
            try:
                value = self.store.get(key, lambda: (
                    f"pp rank {self.me} waiting for pp rank {owner} (global rank "
                    f"{self.transport.ranks[owner]}): {what}"))
            except PipelineError as e:
                if self.transport.error is None:
                    err = self._timeout_error(owner, what)
                    self.transport.fail(err)
                    raise err from e
                raise
        self._computing()
        return value


    def _computing(self) -> None:
        """A step body in its backward read a value (a gradient) to compute with: it holds the
        compute lock from here (see Pipeline.backward)."""
        if ctx.in_backward and ctx.driver and not self.lock.held():
            self.lock.take()


    def _send_value(self, dst: int, key, value: torch.Tensor, mb: int, step: int,
                    later: bool = False) -> None:
        msg = Message(VALUE, step, mb, meta=key, tensors=[value])
        try:
            if later:
                self.transport.send_later(dst, msg)
            else:
                self.transport.send(dst, msg)
        except BaseException as e:  # noqa: BLE001  (already recorded by the transport)
            logger.debug("sending %s to pp rank %d failed: %s", key, dst, e)
