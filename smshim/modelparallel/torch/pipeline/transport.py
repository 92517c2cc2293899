"""Messages between the ranks of one pipeline (PP) group.

Shape (ENGINE.md, "Messages between ranks"): for each ordered pair of ranks there is one receiver
(a role that threads take in turn, one at a time: a receiver that gets work from a frame runs it
itself and hands the receiving on, see `_recv_session`), and each rank has one sender thread
(sender.py), on process groups used by nothing else: messages from one rank to another arrive in
the order they were sent, and gloo's (peer, tag) matching can never pair a buffer with the wrong
message. There are two groups, one per direction (messages to a higher pp rank on the first, to a
lower one on the second), so that each TCP connection carries frames one way: when two ranks posted
frames to each other on one connection at the same moment, gloo stalled one or both by up to 4-9 ms
(over 1.5 ms in 12-40 % of such moments, against 1 % with a group per direction:
`benchmarks/gloo_latency.py --both-ways`), and under 1F1B the stages of a pipeline send to each
other at the same moment once per microbatch. The thread that sends a message posts it itself, with
whatever was queued for the peer before it, as one frame: a small header (two int64 lengths, then
each `Message` as a tuple of its fields, pickled, with its tensors' shapes and dtypes in place of
the tensors) and the tensors' bytes, in a single gloo isend when it fits in FRAME_BYTES (see
`_post_frame`). An isend never waits for the peer's receive, so no compute, glue or receiver thread
waits on a transfer, a busy peer or one not yet in the step, and no thread hand-off lies between a
result and its transfer. The sender thread only waits for posted frames to complete (their buffers
live until then) and keeps the deadline of held messages, for all the rank's peers. A sender may
hold a message back to leave with the next ones (`send(hold=True)`, then `flush`): pp_rank 0 sends
a stage's calls of one microbatch as one frame (a chain of them as one request: `extend_last`). CPU
tensors travel inside the frame; with a device channel (channels.py: CUDA tensors on NCCL groups of
their own), CUDA tensors leave right after their frame, in header order, never through host memory.

Receivers only sit in a gloo receive during a step: each rank opens a session when it enters a
step and, when it leaves, sends CLOSE to every peer; a receiver ends its session on the peer's
CLOSE. So no receive is pending while a rank is idle between steps (where it could time out). A
rank does not wait for its peers' CLOSEs when it leaves a step (that wait was a round trip through
every peer at the end of each step): a receiver whose peer closes late goes straight on into the
next session, the next step waits for the step before it to be closed everywhere (a stuck peer is
still an error, one step later), and `shutdown` waits for the last one.

Every failure (a peer gone, a send or receive timing out) is turned into an error stored on the
transport; every waiter wakes up and raises it, naming the peer.
"""

from __future__ import annotations

import collections
import logging
import pickle
import threading
import time
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from smshim.modelparallel.torch.pipeline.channels import APART, ENV as _CHANNEL_ENV, DeviceChannel
from smshim.modelparallel.torch.pipeline.frames import (_DTYPE_CODE, _DTYPE_OF, _PREFIX, FRAME_BYTES,
                                                       _as_bytes, _frame_buffer, _from_bytes,
                                                       _prefix, _read_prefix)
from smshim.modelparallel.torch.pipeline.messages import (CLOSE, ERROR, Message,
                                                         PipelineError, _nbytes)
from smshim.modelparallel.torch.pipeline.outbox import Outbox
from smshim.modelparallel.torch.pipeline.sender import SenderThread
from smshim.modelparallel.torch.pipeline.workers import Workers

logger = logging.getLogger(__name__)


# Posted frames the sender thread lets accumulate before it waits for them (see `_reap`).
_MAX_POSTED = 8
# The longest a held message waits for the ones after it (see `Transport.send`). A thread that
# holds a request flushes it before it waits for anything, and the next call to another rank or
# to a module of pp_rank 0's own beside another rank's (local_flush.py) does, so the deadline
# bounds what nothing flushes: a notice waiting for the next frame to its peer (`send_later`:
# pp_rank 0's MB_DONE, but in a step's drain, step_end.py), and a request held while glue code
# outside any module computes without reading its result (on a GPU, kernel launches: short).
# At 5 ms the sender thread woke every 5 ms all step long (the linger below) and the notices
# mostly left in frames of their own: sleep stages at p = 4 (`benchmarks/pipeline_threads.py
# --p 4 --m 8 --tf-ms 20`), 133 wakes and 5.9 ms of its CPU a 0.69 s step, pp_rank 0 posting 73
# frames; at 50 ms, 26 wakes, 2.7 ms and 57 frames (p = 8, m = 32: 349 wakes and 30 ms against
# 86 and 6).
HOLD_S = 0.05
# For this long after the last deadline, the sender thread wakes every `hold_s` instead of
# sleeping until notified (see sender.py).
_LINGER_S = 0.05


def _waited_for(posted: "collections.deque") -> bool:
    """Is a posted frame waited for (`send(wait=True)`: its entry has done events)?"""
    for entry in posted:
        if entry[2]:
            return True
    return False


class _Holding(threading.local):
    """Per thread: the peers it holds messages for (`Transport.send`'s `hold`), and whether it
    is inside `Transport.together`."""

    def __init__(self) -> None:
        self.peers: List[int] = []
        self.together = False


class _Together:
    """`Transport.together`'s context (a class: a generator's costs more, once a microbatch)."""

    __slots__ = ("_transport",)

    def __init__(self, transport: "Transport") -> None:
        self._transport = transport

    def __enter__(self) -> None:
        self._transport._holding.together = True

    def __exit__(self, *exc) -> None:
        self._transport._holding.together = False
        self._transport.flush()


class Transport:
    """Point-to-point messages among `ranks` (global ranks of one PP group, in pp-rank order)."""

    def __init__(self, ranks: List[int], my_pp_rank: int,
                 groups: Tuple[dist.ProcessGroup, dist.ProcessGroup],
                 dispatch: Callable[[List[Message]], Optional[Callable[[], None]]],
                 timeout_s: float,
                 device: torch.device, timeline=None, hold_s: float = HOLD_S,
                 device_channel: Optional[DeviceChannel] = None) -> None:
        self.ranks = ranks
        # Tensors it takes travel apart from their frames (channels.py); None: all inside them.
        self._apart = device_channel
        self.sent_apart: collections.Counter = collections.Counter()  # tensors, by peer pp rank
        self.hold_s = hold_s
        self.timeline = timeline
        # What this rank sent, by (kind, peer pp rank): messages, and tensor bytes. The
        # benchmarks and tests read these to show which rank sent what to whom.
        self.sent_messages: collections.Counter = collections.Counter()
        self.sent_bytes: collections.Counter = collections.Counter()
        self.sent_frames: collections.Counter = collections.Counter()  # by peer pp rank
        self.me = my_pp_rank
        # Frames to a higher pp rank travel on groups[0], to a lower one on groups[1] (the same
        # ranks, in the same order). They go straight to the group's send / recv:
        # torch.distributed's isend and recv add argument checks, rank translation and an
        # exception logger around the same calls, ~30-50 us of CPU per frame on a busy core (a
        # frame costs ~250 us in all).
        self._groups = groups
        self._group_rank = {peer: dist.get_group_rank(groups[0], r) for peer, r in enumerate(ranks)}
        self.timeout_s = timeout_s
        self.device = device
        self._dispatch = dispatch
        self._error: Optional[BaseException] = None
        self._error_lock = threading.Lock()
        self._error_listeners: List[Callable[[BaseException], None]] = []
        self._session_starts: Dict[int, threading.Semaphore] = {}
        # Sessions: how many this rank has closed, how many each peer has (its CLOSEs received),
        # and this rank's CLOSEs of the last one (events set once they have left).
        self._closed_sessions = 0
        self._closed_steps: collections.deque = collections.deque([-1, -1], maxlen=2)
        self._peer_closes: collections.Counter = collections.Counter()
        self._closes_cond = threading.Condition()
        self._closes_sent: List[threading.Event] = []
        self._shutdown = False
        self._threads: List[threading.Thread] = []
        # One receive buffer per peer (its receiver thread uses it).
        self._frames: Dict[int, tuple] = {}
        self.peers = [p for p in range(len(ranks)) if p != self.me]
        self._outbox: Dict[int, Outbox] = {}
        self._holding = _Holding()
        for peer in self.peers:
            self._outbox[peer] = Outbox()
            self._session_starts[peer] = threading.Semaphore(0)
        self._sender = SenderThread(self._outbox, self._post, self._reap, hold_s, _LINGER_S,
                                    name=f"smp-send-{self.me}")
        self._threads.append(self._sender.thread)
        # Receiving from a peer is a role that threads take in turn (see `_recv_session`).
        self._receivers = Workers(f"smp-recv-{self.me}")
        for peer in self.peers:
            self._receivers.run(self._receive, peer)

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
                with self._outbox[peer].posting:
                    works, _ = self._post_frame(peer, [notice])
                for work in works:
                    work.wait()
            except Exception:  # noqa: BLE001  (best effort: the peer may be gone)
                pass

    def check(self) -> None:
        if self._error is not None:
            raise PipelineError(str(self._error)) from self._error

    # ---- sessions ---------------------------------------------------------------------------
    def open_session(self) -> None:
        """Enter a step. The one before the last must be closed by every peer by now (the last
        one's CLOSEs, theirs and ours, may still be on their way: see `close_session`)."""
        self.check()
        self._await_closes(self._closed_sessions - 1, self._closed_steps[0])
        for sem in self._session_starts.values():
            sem.release()

    def close_session(self, step: int, last: Optional[Message] = None) -> None:
        """Tell every peer this rank is done with `step`, without waiting for theirs: a peer's
        CLOSE ends only this rank's receiving from it, and this rank's work for the step is
        done. The next `open_session` and `shutdown` wait for them. `last`: a message for every
        peer that leaves in the same frame, just before the CLOSE (pp_rank 0's STEP_END)."""
        self._closes_sent = [
            self._send(peer, ([] if last is None else [last]) + [Message(CLOSE, step=step)],
                       threading.Event())
            for peer in self.peers]
        self._closed_sessions += 1
        self._closed_steps.append(step)

    def _await_closes(self, sessions: int, step: int) -> None:
        """Wait until every peer has closed `sessions` sessions (the last of them `step`),
        bounded by the timeout. A peer that never closes fails the transport."""
        deadline = time.monotonic() + self.timeout_s
        with self._closes_cond:
            while True:
                self.check()
                waiting = [p for p in self.peers if self._peer_closes[p] < sessions]
                left = deadline - time.monotonic()
                if not waiting or left <= 0:
                    break
                self._closes_cond.wait(timeout=min(left, 1.0))
        if waiting:
            err = PipelineError(
                f"pp rank {self.me} waited {self.timeout_s:.0f} s for pp ranks {waiting} (global "
                f"{[self.ranks[p] for p in waiting]}) to finish step {step}: they may have "
                "stopped calling the step function")
            self.fail(err)  # (the peers, and this rank's shutdown, wait no longer)
            raise err

    def _peer_closed(self, peer: int) -> None:
        with self._closes_cond:
            self._peer_closes[peer] += 1
            self._closes_cond.notify_all()

    # ---- sending ----------------------------------------------------------------------------
    def send(self, peer: int, msg: Message, wait: bool = False, hold: bool = False) -> None:
        """Send `msg` to `peer`; with `wait`, return once it has left. Messages to a
        peer arrive in the order they were sent. The calling thread posts the frame itself (a
        gloo isend: it never waits for the peer, so neither a compute thread nor a receiver
        thread can block on a peer that is busy, stuck or not yet in the step, and no thread
        hand-off lies between a result and its transfer), with whatever was queued for the
        peer before it.

        `hold`: the message may wait for the ones the calling thread sends next, to leave with
        them in one frame: each frame costs both ranks' CPU (gloo's event loop and a receive,
        ~1 ms in all on a busy 2-core machine), and pp_rank 0 issues a stage's calls one after
        another (one request per module). Held messages leave when this thread calls `flush`
        (before it computes or waits for anything), when a message that is not held is sent to
        the same peer, or at the latest `hold_s` after the first of them (the rank's sender
        thread keeps it: a thread that forgets to flush delays, never loses, what it held)."""
        if wait or not hold:
            done = self._send(peer, [msg], threading.Event() if wait else None)
            if done is not None:
                self._wait_sent(done)
            return
        self.check()
        held = self._holding.peers
        if held and peer not in held and not self._holding.together:
            # The calls moved on to another stage: the previous one's have all been issued.
            self.flush()
        self._queue(peer, msg)
        if peer not in held:
            held.append(peer)

    def send_later(self, peer: int, msg: Message, deadline: bool = True) -> None:
        """Queue `msg` to leave with the next frame posted to `peer`, by whichever thread, or
        at the latest `hold_s` from now (without `deadline`, with the next frame however late:
        `close_session` posts one to every peer); unlike `send(hold=True)`, the calling
        thread's `flush` does not post it (pp_rank 0's last MB_DONE leaves with the step's
        end)."""
        self.check()
        self._queue(peer, msg, deadline)

    def _queue(self, peer: int, msg: Message, deadline: bool = True) -> None:
        """`send_later` without its check (the caller has made it)."""
        box = self._outbox[peer]
        with box.lock:
            box.items.append((msg, None))
            if deadline and box.hold_until is None:
                box.hold_until = until = time.monotonic() + self.hold_s
                self._sender.held(until)

    def extend_last(self, peer: int, extend: Callable[[Message], bool],
                    past: Tuple[str, ...] = ()) -> bool:
        """`extend(msg)` on the last message queued for `peer` if it has not left yet, under
        the lock that posting takes: it may add to the message (returning True) knowing that
        nothing was queued after it but messages of the kinds `past`, and that it leaves as
        extended. False if there is none."""
        box = self._outbox[peer]
        with box.lock:
            items = box.items
            i = len(items) - 1
            while i >= 0 and items[i][0].kind in past and items[i][1] is None:
                i -= 1
            if i < 0 or items[i][1] is not None:  # (none, or one waited for)
                return False
            return extend(items[i][0])

    def together(self) -> ContextManager[None]:
        """What this thread holds inside leaves at the end, one frame per peer (the calls
        moving on to another peer do not flush it)."""
        return _Together(self)

    def _send(self, peer: int, msgs: List[Message],
              done: Optional[threading.Event]) -> Optional[threading.Event]:
        """Post `msgs`, in one frame with what is queued before them; `done` is set once they
        have left."""
        self.check()
        box = self._outbox[peer]
        with box.lock:
            if len(msgs) > 1:
                box.items.extend((msg, None) for msg in msgs[:-1])
            box.items.append((msgs[-1], done))
        self._post(peer, box)
        return done

    def _wait_sent(self, done: threading.Event) -> None:
        while not done.wait(timeout=1.0):
            self.check()
        self.check()

    def flush(self) -> bool:
        """Send what this thread held (`send(hold=True)`) now, as one frame per peer. Returns
        whether it held anything."""
        held = self._holding.peers
        if not held:
            return False
        while held:
            peer = held.pop()
            self._post(peer, self._outbox[peer])
        return True

    def _post(self, peer: int, box: "Outbox") -> None:
        """Post everything queued for `peer` as one frame (nothing if another thread has taken
        it already). Frames to a peer are posted one at a time, each with what was queued
        before it, so they leave in the order their messages were queued."""
        with box.posting:
            with box.lock:
                batch, box.items, box.hold_until = box.items, [], None
            if not batch:
                return
            # (Loops, not comprehensions: each of those is a Python call, on every frame.)
            msgs, dones = [], []
            for m, d in batch:
                msgs.append(m)
                if d is not None:
                    dones.append(d)
            self.sent_frames[peer] += 1
            first = msgs[0]  # (named only if the frame fails; its tensors are not kept)
            what = (first.kind, first.step, first.microbatch, first.module)
            try:
                if self.timeline is not None and self.timeline.enabled and first.kind != CLOSE:
                    works, keep = self._post_traced(peer, msgs)
                else:
                    works, keep = self._post_frame(peer, msgs)
            except Exception as e:  # noqa: BLE001
                self._send_failed(peer, what, e)
                for d in dones:
                    d.set()
                return
            with box.lock:
                box.posted.append((works, keep, dones, what))
                if dones or len(box.posted) > _MAX_POSTED:
                    self._sender.reap_wanted()  # the sender thread waits for them (`_reap`)

    def _post_traced(self, peer: int, msgs: List[Message]) -> tuple:
        """`_post_frame` inside a span of the timeline."""
        with self.timeline.span(f"send {'+'.join(sorted({m.kind for m in msgs}))} to {peer}",
                                "transfer", peer=peer, messages=len(msgs),
                                bytes=sum(_nbytes(m) for m in msgs),
                                microbatch=msgs[0].microbatch, step=msgs[0].step,
                                module=msgs[0].module) as traced:
            cpu0 = time.thread_time()
            posted = self._post_frame(peer, msgs)
            # A span far longer than its CPU time waited for a core (more processes than
            # cores), not for the network: an isend does not wait for the peer.
            traced.note(cpu_ms=round((time.thread_time() - cpu0) * 1e3, 3))
        return posted

    def _send_failed(self, peer: int, first: tuple, exc: BaseException) -> None:
        """`first`: the frame's first message's (kind, step, microbatch, module)."""
        kind, step, microbatch, module = first
        what = Message(kind, step, microbatch, module=module).describe()
        self.fail(PipelineError(f"pp rank {self.me} could not send {what} to pp rank {peer} "
                                f"(global rank {self.ranks[peer]}): {exc}"))

    def _reap(self, peer: int, box: Outbox) -> None:
        """(The sender thread, sender.py.) Wait for the frames posted to `peer` to complete (a
        frame's buffers live until then; `send(wait=True)` returns then) once one is waited for
        or many are posted: waiting for a completed send costs nothing, and the threads that
        send wait only when they ask to (`wait`)."""
        with box.lock:
            if not (box.posted and (len(box.posted) > _MAX_POSTED or _waited_for(box.posted))):
                return
            posted = list(box.posted)
        for works, _, dones, what in posted:
            try:
                for work in works:
                    work.wait()
            except Exception as e:  # noqa: BLE001
                self._send_failed(peer, what, e)
            with box.lock:
                box.posted.popleft()
            for d in dones:
                d.set()

    def _post_frame(self, peer: int, msgs: List[Message]) -> tuple:
        """Post `msgs` to pp rank `peer` as one frame: [header length]
        [body length][pickled headers][tensor bytes]. The receiver posts a fixed-size buffer
        (gloo accepts a shorter message), so small messages cost a single send; what does not
        fit follows in one more each: the headers (rare: a huge non-tensor payload), then the
        body. Assembled with numpy and a bytearray (a handful of torch ops per message cost more
        than the transfer of a small one). Returns the sends' works and the buffers they read,
        which must live until they complete."""
        headers, body, apart = [], [], []
        body_len = 0
        channel = self._apart
        counts, nbytes = self.sent_messages, self.sent_bytes  # (counted here: no call per message)
        code = _DTYPE_CODE.get
        for msg in msgs:
            key = (msg.kind, peer)
            counts[key] += 1
            metas = []
            for t in msg.tensors:
                dtype = t.dtype
                if channel is not None and channel.takes(t):
                    metas.append((tuple(t.shape), code(dtype, dtype), APART))
                    apart.append(t)
                    nbytes[key] += t.numel() * dtype.itemsize
                    continue
                arr = _as_bytes(t)
                metas.append((tuple(t.shape), code(dtype, dtype), arr.size))
                nbytes[key] += arr.size
                if arr.size:
                    body.append(arr)
                    body_len += arr.size
            # A plain tuple: pickled and unpickled in half the time of the dataclass.
            headers.append((msg.kind, msg.step, msg.microbatch, msg.call_id, msg.module,
                            msg.meta, metas))
        header = pickle.dumps(headers, protocol=pickle.HIGHEST_PROTOCOL)
        end = _PREFIX + len(header)
        inline = end + body_len <= FRAME_BYTES  # headers and body in one isend
        # (A bytearray grown in place: half the time of numpy's slice assignments, per frame.)
        frame = bytearray(_prefix(len(header), body_len))
        bufs = [frame]
        if end > FRAME_BYTES:  # the headers follow on their own
            bufs.append(bytearray(header))
        else:
            frame += header
            if inline:
                for arr in body:
                    frame += arr.data
        keep = [torch.frombuffer(b, dtype=torch.uint8) for b in bufs]
        if not inline and body_len:
            keep.append(torch.from_numpy(np.concatenate(body)))
        group, dst = self._groups[0 if peer > self.me else 1], self._group_rank[peer]
        works = [group.send([t], dst, 0) for t in keep]
        if apart:  # after the frame that announces them, in its order (see channels.py)
            more, sent = channel.send(peer, apart)
            works += more
            keep += sent
            self.sent_apart[peer] += len(apart)
        return works, keep

    # ---- receiving --------------------------------------------------------------------------
    def _receive(self, peer: int, in_session: bool = False) -> None:
        """The role of receiving from `peer`, held by one thread at a time: sessions, one per
        step, each until the peer's CLOSE. Returns once it has handed the role to another
        thread (see `_recv_session`), or on an error or shutdown."""
        src = self.ranks[peer]
        while True:
            if not in_session:
                self._session_starts[peer].acquire()
                if self._shutdown:
                    return
            in_session = False
            try:
                work = self._recv_session(peer)
            except Exception as e:  # noqa: BLE001
                if not self._shutdown:
                    self.fail(PipelineError(f"pp rank {self.me} lost pp rank {peer} (global rank "
                                            f"{src}) while receiving: {e}"), tell_peers=True)
                return
            if work is _ERROR:
                return
            if work is not None:
                work()
                return

    def _recv_session(self, peer: int) -> Any:
        """Receive and dispatch `peer`'s messages until its CLOSE (None), an ERROR (`_ERROR`),
        or a frame whose dispatch returns work: a request it made ready. Then another thread
        takes over receiving and this one returns the work to run: the request starts with no
        thread hand-off between its frame's arrival and its compute (waking a thread costs a
        large share of a hop between ranks), and this peer's next frame is received meanwhile.
        A function of its own so that no received tensor stays referenced between sessions."""
        while True:
            frame = self._recv_frame(peer)
            if self.timeline is not None and self.timeline.enabled:
                self.timeline.instant(
                    f"recv {'+'.join(sorted({m.kind for m in frame}))} from {peer}",
                    "transfer", peer=peer, microbatch=frame[0].microbatch, step=frame[0].step)
            last = None
            for i, msg in enumerate(frame):
                msg.src = peer
                if msg.kind in (CLOSE, ERROR):  # a peer's last message of its step, or ever
                    frame, last = frame[:i], msg
                    break
            work = self._dispatch(frame) if frame else None
            if last is not None and last.kind == ERROR:
                self.fail(PipelineError(str(last.meta)), tell_peers=True)
                return _ERROR
            if last is not None:
                self._peer_closed(peer)
                if work is not None:
                    work()
                return None
            if work is not None:
                self._receivers.run(self._receive, peer, True)
                return work

    def _recv_frame(self, peer: int) -> List[Message]:
        """The next frame from pp rank `peer`, as its messages."""
        frame, nf = _frame_buffer(self._frames, peer)
        group, src = self._groups[0 if self.me > peer else 1], self._group_rank[peer]
        group.recv([frame], src, 0).wait()
        header_len, body_len = _read_prefix(nf)
        start = _PREFIX + header_len
        if start > FRAME_BYTES:  # the headers follow on their own (see _post_frame)
            header = np.empty(header_len, dtype=np.uint8)
            group.recv([torch.from_numpy(header)], src, 0).wait()
            msgs = [Message(*h) for h in pickle.loads(header)]
        else:
            msgs = [Message(*h) for h in pickle.loads(nf[_PREFIX:start])]
        if start + body_len <= FRAME_BYTES:
            # No copy here: each tensor is copied out of the frame below, before the next receive.
            body = nf[start:start + body_len]
        else:
            body = np.empty(body_len, dtype=np.uint8)
            if body_len:
                group.recv([torch.from_numpy(body)], src, 0).wait()
        offset = 0
        apart = []  # (message's tensors, index, shape, dtype) of those on the device channel
        dtype_of = _DTYPE_OF.get
        for msg in msgs:
            tensors = []
            for shape, dtype, nbytes in msg.tensors:
                dtype = dtype_of(dtype, dtype)
                if nbytes == APART:
                    apart.append((tensors, len(tensors), shape, dtype))
                    tensors.append(None)
                    continue
                t = _from_bytes(body[offset:offset + nbytes], dtype, shape)
                offset += nbytes
                tensors.append(t.to(self.device) if self.device.type != "cpu" else t)
            msg.tensors = tensors
        if apart:
            self._recv_apart(peer, apart)
        return msgs

    def _recv_apart(self, peer: int, apart: list) -> None:
        """Receive a frame's tensors that travel on the device channel, in header order."""
        if self._apart is None:
            raise PipelineError(
                f"pp rank {peer} (global rank {self.ranks[peer]}) sent tensors on the device "
                f"channel, which pp rank {self.me} does not have: set {_CHANNEL_ENV} alike "
                "on every rank")
        got = self._apart.recv(peer, [(shape, dtype) for _, _, shape, dtype in apart])
        for (tensors, i, _, _), t in zip(apart, got):
            tensors[i] = t

    def shutdown(self, join_timeout_s: float = 5.0) -> None:
        """Stop the sender and receiver threads and wait for them (bounded). They are daemon
        threads: one still running when the interpreter finalizes (e.g. freeing the tensors of
        its last frame) is killed by pthread_exit while inside torch's C++ code, which aborts
        the process ("terminate called without an active exception") after the script is done."""
        if self._error is None and self._closed_sessions:
            # No receive may be left pending at exit: wait for the last step's CLOSEs.
            try:
                self._await_closes(self._closed_sessions, self._closed_steps[1])
                for done in self._closes_sent:  # (and this rank's own have left)
                    self._wait_sent(done)
            except PipelineError as e:
                logger.error("pipeline rank %d at shutdown: %s", self.me, e)
        self._shutdown = True
        self._sender.stop()
        for sem in self._session_starts.values():
            sem.release()
        self._receivers.stop()
        deadline = time.monotonic() + join_timeout_s
        for t in self._threads + list(self._receivers.threads):
            if t is not threading.current_thread():
                # A receiver inside a gloo receive (a step abandoned midway) cannot be woken;
                # it is left to the process group's destruction.
                t.join(timeout=max(0.0, deadline - time.monotonic()))


# `_recv_session`'s result when the peer said it failed.
_ERROR = object()
