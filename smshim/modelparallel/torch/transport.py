"""Messages between the ranks of one pipeline (PP) group.

Shape (ENGINE.md, "Messages between ranks"): for each ordered pair of ranks there is one sender
thread and one receiver thread, on a process group used by nothing else: messages from one rank
to another arrive in the order they were queued, and gloo's (peer, tag) matching can never pair a
buffer with the wrong message. Callers only queue (`send`), so no compute or glue thread waits on
the network to send; the sender takes everything queued for its peer and sends it as one frame:
a small header (two int64 lengths, then the pickled `Message`s without their tensors, which carry
their shapes and dtypes) and the tensors' bytes, in a single send when it fits in FRAME_BYTES (see
`_send_frame`). Tensors travel through CPU memory on a gloo group, whatever the compute device.

Receivers only sit in a gloo receive during a step: each rank opens a session when it enters a
step and, when it leaves, sends CLOSE to every peer; a receiver ends its session on the peer's
CLOSE. So no receive is pending while a rank is idle between steps (where it could time out), and
a step ends only after every peer has said it is done.

Every failure (a peer gone, a send or receive timing out) is turned into an error stored on the
transport; every waiter wakes up and raises it, naming the peer.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import pickle
import queue
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Message kinds. Requests (server.py): run a module's forward / backward; a forward's output
# metadata or values when the caller waits for them; a value (activation or gradient) travelling
# from the rank that holds it to the rank that needs it; asking a rank to send a value it holds to
# another rank or to the asker; pp_rank 0 saying a microbatch's forward / whole step is done.
FWD_REQ, FWD_REPLY, BWD_REQ = "fwd_req", "fwd_reply", "bwd_req"
VALUE, SEND_TO, FETCH = "value", "send_to", "fetch"
FWD_DONE, MB_DONE = "fwd_done", "mb_done"
STEP_END, CLOSE, ERROR = "step_end", "close", "error"


class PipelineError(RuntimeError):
    """A pipeline peer failed, stopped taking part, or a wait timed out."""


@dataclasses.dataclass
class Message:
    kind: str
    step: int = 0
    microbatch: int = -1
    call_id: int = -1
    module: str = ""
    meta: Any = None  # pickled with the header: structure specs, non-tensor leaves, flags
    tensors: List[torch.Tensor] = dataclasses.field(default_factory=list)
    src: int = -1  # filled in on receipt (pp rank of the sender)

    def describe(self) -> str:
        what = {FWD_REQ: "forward", FWD_REPLY: "forward", BWD_REQ: "backward",
                VALUE: "value", SEND_TO: "send request", FETCH: "fetch"}.get(self.kind, self.kind)
        mod = f" of module '{self.module}'" if self.module else ""
        mb = f", microbatch {self.microbatch}" if self.microbatch >= 0 else ""
        return f"{what}{mod}{mb} (step {self.step})"


FRAME_BYTES = 1 << 18  # a message up to 256 KiB travels in one send
_PREFIX = 16  # two int64 lengths


class Transport:
    """Point-to-point messages among `ranks` (global ranks of one PP group, in pp-rank order)."""

    def __init__(self, ranks: List[int], my_pp_rank: int, group: dist.ProcessGroup,
                 dispatch: Callable[[Message], None], timeout_s: float,
                 device: torch.device, timeline=None) -> None:
        self.ranks = ranks
        self.timeline = timeline
        # What this rank sent, by (kind, peer pp rank): messages, and tensor bytes. The
        # benchmarks and tests read these to show which rank sent what to whom.
        self.sent_messages: collections.Counter = collections.Counter()
        self.sent_bytes: collections.Counter = collections.Counter()
        self.me = my_pp_rank
        self.group = group
        self.timeout_s = timeout_s
        self.device = device
        self._dispatch = dispatch
        self._error: Optional[BaseException] = None
        self._error_lock = threading.Lock()
        self._error_listeners: List[Callable[[BaseException], None]] = []
        self._send_locks: Dict[int, threading.Lock] = {}
        self._session_starts: Dict[int, threading.Semaphore] = {}
        self._closed_peers: "queue.Queue[int]" = queue.Queue()
        self._shutdown = False
        self._threads: List[threading.Thread] = []
        self._frames: Dict[int, torch.Tensor] = {}  # one receive buffer per peer (one thread each)
        self.peers = [p for p in range(len(ranks)) if p != self.me]
        self._outbox: Dict[int, _Outbox] = {}
        for peer in self.peers:
            self._send_locks[peer] = threading.Lock()
            self._outbox[peer] = _Outbox()
            t = threading.Thread(target=self._send_loop, args=(peer,), daemon=True,
                                 name=f"smp-send-{self.me}-{peer}")
            t.start()
            self._threads.append(t)
            self._session_starts[peer] = threading.Semaphore(0)
            t = threading.Thread(target=self._recv_loop, args=(peer,), daemon=True,
                                 name=f"smp-recv-{self.me}-{peer}")
            t.start()
            self._threads.append(t)

    # ---- errors -----------------------------------------------------------------------------
    @property
    def error(self) -> Optional[BaseException]:
        return self._error

    def on_error(self, fn: Callable[[BaseException], None]) -> None:
        self._error_listeners.append(fn)

    def fail(self, exc: BaseException, tell_peers: bool = True) -> None:
        """Record the first failure, wake every waiter, and tell the peers (best effort)."""
        with self._error_lock:
            if self._error is not None:
                return
            self._error = exc
        logger.error("pipeline rank %d: %s", self.me, exc)
        for fn in self._error_listeners:
            fn(exc)
        if tell_peers:
            # From a daemon thread: a peer that stopped receiving must not block the raise here.
            notice = Message(ERROR, meta=f"pp rank {self.me} (global rank {self.ranks[self.me]}) "
                                         f"failed: {exc}")
            t = threading.Thread(target=self._tell_peers, args=(notice,), daemon=True,
                                 name=f"smp-error-{self.me}")
            t.start()
            self._threads.append(t)

    def _tell_peers(self, notice: Message) -> None:
        for peer in self.peers:
            try:
                with self._send_locks[peer]:
                    self._send_frame(self.ranks[peer], [notice])
            except Exception:  # noqa: BLE001  (best effort: the peer may be gone)
                pass

    def check(self) -> None:
        if self._error is not None:
            raise PipelineError(str(self._error)) from self._error

    # ---- sessions ---------------------------------------------------------------------------
    def open_session(self) -> None:
        self.check()
        while not self._closed_peers.empty():
            self._closed_peers.get_nowait()
        for sem in self._session_starts.values():
            sem.release()

    def close_session(self, step: int) -> None:
        """Tell every peer we are done with this step; wait until every peer has said the same
        and our own CLOSEs have left (a rank may exit right after its last step)."""
        for peer in self.peers:
            self.send(peer, Message(CLOSE, step=step), wait=True)
        waiting = set(self.peers)
        while waiting:
            self.check()
            try:
                peer = self._closed_peers.get(timeout=self.timeout_s)
            except queue.Empty:
                raise PipelineError(
                    f"pp rank {self.me} waited {self.timeout_s:.0f} s for pp ranks "
                    f"{sorted(waiting)} (global {[self.ranks[p] for p in sorted(waiting)]}) to "
                    f"finish step {step}: they may have stopped calling the step function"
                ) from None
            waiting.discard(peer)
        self.check()

    # ---- sending ----------------------------------------------------------------------------
    def send(self, peer: int, msg: Message, wait: bool = False) -> None:
        """Queue `msg` for `peer`; with `wait`, return once it has left. One sender thread per
        peer is the ordering rule (messages to a peer arrive in the order they were queued), and
        it sends everything queued meanwhile as one frame: a caller never waits on the network
        to send, and a burst of requests (one per module of a stage) costs one gloo send."""
        self.check()
        nbytes = sum(t.numel() * t.element_size() for t in msg.tensors)
        self.sent_messages[(msg.kind, peer)] += 1
        self.sent_bytes[(msg.kind, peer)] += nbytes
        done = threading.Event() if wait else None
        box = self._outbox[peer]
        with box.cond:
            box.items.append((msg, done))
            box.cond.notify()
        if done is not None:
            while not done.wait(timeout=1.0):
                self.check()
            self.check()

    def _send_loop(self, peer: int) -> None:
        box = self._outbox[peer]
        dst = self.ranks[peer]
        while True:
            with box.cond:
                while not box.items and not self._shutdown:
                    box.cond.wait()
                if not box.items:
                    return
                batch, box.items = box.items, []
            msgs = [m for m, _ in batch]
            nbytes = sum(t.numel() * t.element_size() for m in msgs for t in m.tensors)
            span = (self.timeline.span(f"send {'+'.join(sorted({m.kind for m in msgs}))} to {peer}",
                                       "transfer", peer=peer, bytes=nbytes, messages=len(msgs),
                                       microbatch=msgs[0].microbatch, step=msgs[0].step,
                                       module=msgs[0].module)
                    if self.timeline is not None and self.timeline.enabled
                    and msgs[0].kind != CLOSE else contextlib.nullcontext())
            try:
                with self._send_locks[peer], span:
                    self._send_frame(dst, msgs)
            except Exception as e:  # noqa: BLE001
                self.fail(PipelineError(f"pp rank {self.me} could not send {msgs[0].describe()} "
                                        f"to pp rank {peer} (global rank {dst}): {e}"))
            for _, done in batch:
                if done is not None:
                    done.set()
            del batch, msgs  # hold no tensors while idle (nor when the thread ends at exit)

    def _send_frame(self, dst: int, msgs: List[Message]) -> None:
        # One frame: [header length][body length][pickled headers][tensor bytes]. The receiver
        # posts a fixed-size buffer (gloo accepts a shorter message), so small messages cost a
        # single send; a body too large for the frame follows as one more send.
        headers, body = [], []
        for msg in msgs:
            tensors = [t.detach().to("cpu").contiguous() for t in msg.tensors]
            metas = [(tuple(t.shape), t.dtype, t.numel() * t.element_size()) for t in tensors]
            headers.append(Message(msg.kind, msg.step, msg.microbatch, msg.call_id, msg.module,
                                   msg.meta, metas))
            body += [t.reshape(-1).view(torch.uint8) for t in tensors if t.numel()]
        header = pickle.dumps(headers, protocol=pickle.HIGHEST_PROTOCOL)
        body_len = sum(b.numel() for b in body)
        inline = _PREFIX + len(header) + body_len <= FRAME_BYTES
        lengths = torch.tensor([len(header), body_len], dtype=torch.int64).view(torch.uint8)
        parts = [lengths, torch.frombuffer(bytearray(header), dtype=torch.uint8)]
        if inline:
            parts += body
        dist.send(torch.cat(parts), dst, group=self.group)
        if not inline and body_len:
            dist.send(torch.cat(body), dst, group=self.group)

    # ---- receiving --------------------------------------------------------------------------
    def _recv_loop(self, peer: int) -> None:
        src = self.ranks[peer]
        while True:
            self._session_starts[peer].acquire()
            if self._shutdown:
                return
            try:
                if not self._recv_session(peer, src):
                    return
            except Exception as e:  # noqa: BLE001
                if not self._shutdown:
                    self.fail(PipelineError(f"pp rank {self.me} lost pp rank {peer} (global rank "
                                            f"{src}) while receiving: {e}"), tell_peers=True)
                return

    def _recv_session(self, peer: int, src: int) -> bool:
        """Receive and dispatch `peer`'s messages until its CLOSE (True) or ERROR (False). A
        function of its own so that no received tensor stays referenced between sessions."""
        while True:
            frame = self._recv_frame(src)
            if self.timeline is not None and self.timeline.enabled:
                self.timeline.instant(
                    f"recv {'+'.join(sorted({m.kind for m in frame}))} from {peer}",
                    "transfer", peer=peer, microbatch=frame[0].microbatch, step=frame[0].step)
            for msg in frame:
                msg.src = peer
                if msg.kind == CLOSE:
                    self._closed_peers.put(peer)
                    return True  # CLOSE is the last message of a peer's step
                if msg.kind == ERROR:
                    self.fail(PipelineError(str(msg.meta)), tell_peers=True)
                    return False
                self._dispatch(msg)

    def _recv_frame(self, src: int) -> List[Message]:
        frame = self._frames.setdefault(src, torch.empty(FRAME_BYTES, dtype=torch.uint8))
        dist.recv(frame, src, group=self.group)
        header_len, body_len = frame[:_PREFIX].view(torch.int64).tolist()
        msgs: List[Message] = pickle.loads(frame[_PREFIX:_PREFIX + header_len].numpy().tobytes())
        if _PREFIX + header_len + body_len <= FRAME_BYTES:
            # No copy here: each tensor is cloned out of the frame below, before the next receive.
            body = frame[_PREFIX + header_len:_PREFIX + header_len + body_len]
        else:
            body = torch.empty(body_len, dtype=torch.uint8)
            dist.recv(body, src, group=self.group)
        offset = 0
        for msg in msgs:
            tensors = []
            for shape, dtype, nbytes in msg.tensors:
                # clone(): a fresh, aligned storage per tensor, so view(dtype) is legal.
                t = body[offset:offset + nbytes].clone().view(dtype).reshape(shape)
                offset += nbytes
                tensors.append(t.to(self.device) if self.device.type != "cpu" else t)
            msg.tensors = tensors
        return msgs

    def shutdown(self, join_timeout_s: float = 5.0) -> None:
        """Stop the sender and receiver threads and wait for them (bounded). They are daemon
        threads: one still running when the interpreter finalizes (e.g. freeing the tensors of
        its last frame) is killed by pthread_exit while inside torch's C++ code, which aborts
        the process ("terminate called without an active exception") after the script is done."""
        self._shutdown = True
        for sem in self._session_starts.values():
            sem.release()
        for box in self._outbox.values():
            with box.cond:
                box.cond.notify_all()
        deadline = time.monotonic() + join_timeout_s
        for t in self._threads:
            if t is not threading.current_thread():
                # A receiver inside a gloo receive (a step abandoned midway) cannot be woken;
                # it is left to the process group's destruction.
                t.join(timeout=max(0.0, deadline - time.monotonic()))


class _Outbox:
    """Messages queued for one peer, taken by its sender thread."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.items: List[tuple] = []
