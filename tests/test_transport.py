"""The pipeline transport on its own (transport.py), 2-3 gloo processes: messages arrive whole and
in order, receivers that answer each other at the same moment never wait on each other, a send
never waits for its peer to receive, held messages leave together, a receiver that is given
work runs it while another thread goes on receiving, a rank leaves a step without waiting
for its peers to close it, frames travel each direction on a group of their own, and a failure
notice reaches peers whose global ranks are not their pp ranks."""

import threading

from smshim.testing import run_ranks

N = 60  # (even)


def _each(dispatch):
    """The transport dispatches a frame's messages together; these tests take them one by one."""
    def frame(msgs):
        for msg in msgs:
            dispatch(msg)

    return frame


def _rank_and_group(members=None):
    """Bring this rank's torch.distributed up (one thread); return its rank and the transport's
    two gloo groups (one per direction) of `members` (default: all ranks)."""
    import datetime

    import torch
    import torch.distributed as dist

    from smshim.runtime import launch as _runtime

    torch.set_num_threads(1)
    _runtime.init_distributed()
    members = list(range(dist.get_world_size())) if members is None else members
    groups = tuple(dist.new_group(members, backend="gloo", timeout=datetime.timedelta(seconds=20))
                   for _ in range(2))
    return dist.get_rank(), groups


def _ping_pong(n):
    import torch

    from smshim.modelparallel.torch.pipeline.messages import (VALUE, Message)
    from smshim.modelparallel.torch.pipeline.transport import Transport

    me, groups = _rank_and_group()
    other = 1 - me
    got = {"ping": [], "rally": []}
    done = threading.Event()

    def dispatch(msg):
        kind, origin, i = msg.meta[:3]
        got[kind].append((i, msg.tensors) if kind == "rally" else (i, msg.tensors, msg.meta[3]))
        if kind == "rally" and i < n:
            # Answered from the receiver thread (as the server answers FETCH and SEND_TO), while
            # the peer's receiver answers the other rally: both send at the same moments.
            transport.send(other, Message(VALUE, 0, i, meta=("rally", origin, i + 1),
                                          tensors=[torch.full((4,), float(i + 1))]))
        if len(got["ping"]) == n and len(got["rally"]) == n + 1:
            done.set()

    transport = Transport([0, 1], me, groups, _each(dispatch), 30.0, torch.device("cpu"))
    transport.open_session()
    transport.send(other, Message(VALUE, 0, 0, meta=("rally", me, 0), tensors=[torch.zeros(4)]))
    for i in range(n):
        # Small and large tensors, dtypes numpy has and has not, a 0-d tensor.
        t = [torch.full((i % 5 + 1, 3), float(i)), torch.arange(i, dtype=torch.int64),
             torch.tensor(i, dtype=torch.bfloat16), torch.ones(20000 if i % 7 == 0 else 1)]
        pad = "x" * 300_000 if i % 20 == 3 else ""  # headers larger than a frame, now and then
        transport.send(other, Message(VALUE, 0, i, meta=("ping", me, i, pad), tensors=t))
    assert done.wait(40), f"rank {me}: {len(got['ping'])} pings, {len(got['rally'])} rally shots"
    transport.close_session(0)
    transport.shutdown()
    assert [i for i, _, _ in got["ping"]] == list(range(n))  # in order
    for i, (a, b, c, d), pad in got["ping"]:
        assert len(pad) == (300_000 if i % 20 == 3 else 0)
        assert torch.equal(a, torch.full((i % 5 + 1, 3), float(i)))
        assert torch.equal(b, torch.arange(i, dtype=torch.int64))
        assert c.dtype == torch.bfloat16 and c.shape == () and c.item() == i
        assert d.numel() == (20000 if i % 7 == 0 else 1) and bool((d == 1).all())
    for i, (t,) in got["rally"]:
        assert torch.equal(t, torch.full((4,), float(i)))
    return dict(transport.sent_messages)


def test_messages_arrive_in_order_and_answering_receivers_never_wait_on_each_other():
    sent = run_ranks(_ping_pong, 2, N, timeout=120)
    for rank, counts in enumerate(sent):
        # N pings, the rally's first shot and its answers to the peer's N + 1, CLOSE
        assert counts == {("value", 1 - rank): 2 * N + 1, ("close", 1 - rank): 1}


def _held(hold_s):
    """pp_rank 0's way of sending: messages held to leave together (Transport.send's `hold`)."""
    import time

    import torch
    import torch.distributed as dist

    from smshim.modelparallel.torch.pipeline.messages import (VALUE, Message)
    from smshim.modelparallel.torch.pipeline.transport import Transport

    me, groups = _rank_and_group()
    n = dist.get_world_size()
    got, acks = [], []
    cond = threading.Condition()

    def dispatch(msg):
        with cond:
            (acks if msg.meta[0] == "ack" else got).append((msg.meta, msg.tensors))
            cond.notify_all()

    def wait_for(items, count):
        with cond:
            assert cond.wait_for(lambda: len(items) >= count, timeout=30), (me, items)

    def msg(tag, i):
        return Message(VALUE, 0, i, meta=(tag, i), tensors=[torch.full((3,), float(i))])

    transport = Transport(list(range(n)), me, groups, _each(dispatch), 30.0, torch.device("cpu"),
                          hold_s=hold_s)
    transport.open_session()
    frames = []
    if me == 0:
        # (Once the peer is known to be receiving, a flush sends from this thread, at once.)
        wait_for(acks, n - 1)
        # A burst to one peer, flushed: one frame. Held, then one not held: one frame, in order.
        for i in range(5):
            transport.send(1, msg("burst", i), hold=True)
        transport.flush()
        for i in range(5, 8):
            transport.send(1, msg("burst", i), hold=True)
        transport.send(1, msg("burst", 8))
        wait_for(acks, n)
        frames.append(dict(transport.sent_frames))
        # Held and never flushed: they leave at the deadline all the same (the sender thread
        # was already awake, for the burst's run of holds) ...
        transport.send(1, msg("late", 0), hold=True)
        transport.send(1, msg("late", 1), hold=True)
        wait_for(acks, n + 1)
        frames.append(dict(transport.sent_frames))
        # ... and after a pause long enough for it to sleep until told.
        time.sleep(2 * hold_s + 0.2)
        transport.send(1, msg("later", 0), hold=True)
        wait_for(acks, n + 2)
        frames.append(dict(transport.sent_frames))
        if n == 3:
            # Calls moving on to another peer send what was held for the previous one.
            transport.send(1, msg("switch", 0), hold=True)
            transport.send(2, msg("switch", 1), hold=True)
            transport.send(1, msg("switch", 2), hold=True)
            transport.flush()
            wait_for(acks, n + 4)
            frames.append(dict(transport.sent_frames))
            # ... unless they are sent together: one frame per peer.
            with transport.together():
                transport.send(1, msg("together", 0), hold=True)
                transport.send(2, msg("together", 1), hold=True)
                transport.send(1, msg("together", 2), hold=True)
            wait_for(acks, n + 6)
            frames.append(dict(transport.sent_frames))
    else:
        expect = {1: [("burst", 9), ("late", 2), ("later", 1)]
                  + [("switch", 2), ("together", 2)] * (n == 3),
                  2: [("switch", 1), ("together", 1)]}[me]
        transport.send(0, Message(VALUE, 0, 0, meta=("ack", "hello")))
        seen = 0
        for tag, count in expect:
            seen += count
            wait_for(got, seen)
            transport.send(0, Message(VALUE, 0, 0, meta=("ack", tag)))
    transport.close_session(0)
    transport.shutdown()
    return frames, [(meta, t[0].tolist()) for meta, t in got]


def test_held_messages_leave_together_in_order_and_never_stay():
    results = run_ranks(_held, 2, 0.3, timeout=120)
    frames, _ = results[0]
    assert frames[0][1] == 2, frames  # 9 messages in 2 frames
    assert frames[1][1] == 3, frames  # the 2 held ones went at their deadline, together
    assert frames[2][1] == 4, frames
    _, got = results[1]
    assert [m for m, _ in got] == [("burst", i) for i in range(9)] + [("late", 0), ("late", 1),
                                                                      ("later", 0)]
    assert all(t == [float(m[1])] * 3 for m, t in got)


def test_held_messages_leave_when_the_calls_move_on_to_another_peer():
    results = run_ranks(_held, 3, 0.3, timeout=120)
    frames = results[0][0]
    assert frames[3][1] - frames[2][1] == 2 and frames[3][2] == 1, frames
    assert frames[4][1] - frames[3][1] == 1 and frames[4][2] == 2, frames
    assert [m for m, _ in results[1][1]][-4:] == [("switch", 0), ("switch", 2),
                                                  ("together", 0), ("together", 2)]
    assert [m for m, _ in results[2][1]] == [("switch", 1), ("together", 1)]


def _early(delay):
    """Sends to a peer that is not receiving yet (it enters the step `delay` s later)."""
    import time

    import torch

    from smshim.modelparallel.torch.pipeline.messages import (VALUE, Message)
    from smshim.modelparallel.torch.pipeline.transport import Transport

    me, groups = _rank_and_group()
    got = []
    done = threading.Event()

    def dispatch(msg):
        got.append((msg.meta, msg.tensors[0].sum().item()))
        if len(got) == 4:
            done.set()

    transport = Transport([0, 1], me, groups, _each(dispatch), 30.0, torch.device("cpu"))
    took = 0.0
    if me == 0:
        transport.open_session()
        start = time.monotonic()
        for i, n in enumerate([3, 1 << 20, 5, 1 << 17]):  # small, and larger than a frame
            transport.send(1, Message(VALUE, 0, i, meta=i, tensors=[torch.ones(n)]))
        took = time.monotonic() - start
    else:
        time.sleep(delay)
        transport.open_session()
        assert done.wait(30), got
    transport.close_session(0)
    transport.shutdown()
    return took, got


def test_a_send_never_waits_for_the_peer_to_receive():
    delay = 3.0
    (took, _), (_, got) = run_ranks(_early, 2, delay, timeout=120)
    assert took < delay / 2, took  # posted, not waiting for the peer's receive
    assert got == [(0, 3.0), (1, float(1 << 20)), (2, 5.0), (3, float(1 << 17))]


def _hand_off(n):
    """Rank 0 sends "go", then n values. Rank 1's dispatch of "go" returns work that waits for
    all n values: it must run on the thread that received "go", while another thread receives
    the values."""
    import torch

    from smshim.modelparallel.torch.pipeline.messages import (VALUE, Message)
    from smshim.modelparallel.torch.pipeline.transport import Transport

    me, groups = _rank_and_group()
    got, seen = [], {}
    cond = threading.Condition()

    def work():
        seen["worker"] = threading.get_ident()
        with cond:
            seen["all"] = cond.wait_for(lambda: len(got) == n, timeout=30)

    def dispatch(msgs):
        todo = None
        for msg in msgs:
            if msg.meta == "go":
                seen["receiver"] = threading.get_ident()
                todo = work
            else:
                with cond:
                    got.append(msg.meta)
                    cond.notify_all()
        return todo

    transport = Transport([0, 1], me, groups, dispatch, 30.0, torch.device("cpu"))
    transport.open_session()
    if me == 0:
        transport.send(1, Message(VALUE, 0, 0, meta="go"), wait=True)
        for i in range(n):
            transport.send(1, Message(VALUE, 0, i, meta=i, tensors=[torch.ones(2)]), wait=True)
    transport.close_session(0)
    transport.shutdown()
    return got, seen


def test_a_receiver_runs_the_work_a_frame_made_and_another_thread_goes_on_receiving():
    _, (got, seen) = run_ranks(_hand_off, 2, 5, timeout=120)
    assert seen["all"], got  # the values came while the work waited for them
    assert got == list(range(5))
    assert seen["worker"] == seen["receiver"]


def _sessions(delay, stuck):
    """Three steps (sessions). Rank 0 ends each with a last message that leaves with its CLOSE,
    and goes on without waiting for rank 1's CLOSE; rank 1 closes step 1 `delay` s late (with
    `stuck`, it never closes step 0 and rank 0's transport times out after 2 s)."""
    import time

    import torch

    from smshim.modelparallel.torch.pipeline.messages import (VALUE, Message, PipelineError)
    from smshim.modelparallel.torch.pipeline.transport import Transport

    me, groups = _rank_and_group()
    got = []
    cond = threading.Condition()

    def dispatch(msg):
        with cond:
            got.append(msg.meta)
            cond.notify_all()

    transport = Transport([0, 1], me, groups, _each(dispatch), 2.0 if stuck else 30.0,
                          torch.device("cpu"))
    seen, error = [], None
    for step in range(3):
        if me == 0:
            t0 = time.monotonic()
            try:
                transport.open_session()
            except PipelineError as e:
                error = str(e)
                break
            transport.send(1, Message(VALUE, step, 0, meta=step, tensors=[torch.ones(2)]))
            transport.close_session(step, last=Message(VALUE, step, meta=("last", step)))
            seen.append((step, transport._peer_closes[1], time.monotonic() - t0))
        else:
            transport.open_session()
            with cond:
                assert cond.wait_for(lambda: ("last", step) in got, timeout=30), got
            if stuck:
                time.sleep(4)  # (rank 0 gives up on its third step, after 2 s)
                transport.shutdown()
                return got, seen, error, dict(transport.sent_frames), 0
            if step == 1:
                time.sleep(delay)
            transport.close_session(step)
    t0 = time.monotonic()
    transport.shutdown()
    shutdown_s = time.monotonic() - t0
    seen.append(("shutdown", transport._peer_closes[1 - me], shutdown_s))
    return got, seen, error, dict(transport.sent_frames), transport._closed_sessions


def test_a_rank_leaves_a_step_without_waiting_for_its_peers_to_close_it():
    delay = 3.0
    (_, seen, error, frames, closed), (got, *_) = run_ranks(_sessions, 2, delay, False,
                                                             timeout=120)
    assert error is None
    # Each step: the value, then the last message and the CLOSE in one frame.
    assert frames == {1: 6}, frames
    assert got == [0, ("last", 0), 1, ("last", 1), 2, ("last", 2)]
    step1, step2, shutdown = seen[1], seen[2], seen[3]
    # Rank 0 went through step 2 while rank 1 held on to step 1 ...
    assert step1[1] <= 1 and step2[1] <= 1, seen
    assert step2[2] < delay / 2, seen
    # ... and its shutdown waited for the last CLOSE, so no receive is left pending at exit.
    assert shutdown[1] == closed == 3, seen


def test_a_peer_that_never_closes_a_step_is_an_error_one_step_later():
    (_, seen, error, _, _), _ = run_ranks(_sessions, 2, 0.0, True, timeout=120)
    assert [s[0] for s in seen[:2]] == [0, 1], seen  # steps 0 and 1 went on
    assert error is not None and "waited 2 s for pp ranks [1]" in error, error
    assert "to finish step 0" in error, error


class _Recording:
    """A process group's send / recv, noting (call, peer) in `log` under `name`."""

    def __init__(self, group, name, log):
        self._group, self._name, self._log = group, name, log

    def send(self, tensors, dst, tag):
        self._log.append((self._name, "send", dst))
        return self._group.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        self._log.append((self._name, "recv", src))
        return self._group.recv(tensors, src, tag)


def _directions():
    """Three ranks; each sends one value to each other one."""
    import torch

    from smshim.modelparallel.torch.pipeline.messages import (VALUE, Message)
    from smshim.modelparallel.torch.pipeline.transport import Transport

    me, groups = _rank_and_group()
    got, cond, log = [], threading.Condition(), []

    def dispatch(msg):
        with cond:
            got.append((msg.src, msg.meta))
            cond.notify_all()

    transport = Transport([0, 1, 2], me, groups, _each(dispatch), 30.0, torch.device("cpu"))
    # (The receivers only touch the groups once a session opens.)
    transport._groups = (_Recording(groups[0], "up", log), _Recording(groups[1], "down", log))
    transport.open_session()
    for peer in transport.peers:
        transport.send(peer, Message(VALUE, 0, 0, meta=me, tensors=[torch.ones(2)]))
    with cond:
        assert cond.wait_for(lambda: len(got) == 2, timeout=30), got
    transport.close_session(0)
    transport.shutdown()
    return sorted(got), sorted(set(log))


def test_frames_to_a_higher_rank_and_to_a_lower_rank_travel_on_groups_of_their_own():
    """When two ranks post frames to each other at the same moment on one gloo connection (1F1B
    does once per microbatch), gloo stalls one or both for 4-7 ms now and then
    (`benchmarks/gloo_latency.py --both-ways`); on a group per direction it does not."""
    for me, (got, log) in enumerate(run_ranks(_directions, 3, timeout=120)):
        peers = [p for p in range(3) if p != me]
        assert got == [(p, p) for p in peers]
        want = {("up" if p > me else "down", "send", p) for p in peers}
        want |= {("up" if p < me else "down", "recv", p) for p in peers}
        assert log == sorted(want), (me, log)


def _failure_notice():
    """A world of 3 where the pipeline is global ranks 1 and 2 (pp ranks 0 and 1): pp rank 0
    fails; pp rank 1 must hear of it from the notice, long before its own timeout."""
    import time

    import torch
    import torch.distributed as dist

    from smshim.modelparallel.torch.pipeline.messages import PipelineError
    from smshim.modelparallel.torch.pipeline.transport import Transport

    me, groups = _rank_and_group([1, 2])
    if me == 0:
        dist.barrier()
        return None
    pp = me - 1
    transport = Transport([1, 2], pp, groups, _each(lambda msg: None), 60.0, torch.device("cpu"))
    transport.open_session()
    t0 = time.monotonic()
    if pp == 0:
        transport.fail(PipelineError("stage 0 broke"))
        time.sleep(1.0)  # (the notice leaves from a thread of its own)
    else:
        while transport.error is None and time.monotonic() - t0 < 20:
            time.sleep(0.05)
    error = None if transport.error is None else str(transport.error)
    transport.shutdown(join_timeout_s=1.0)
    dist.barrier()
    return error


def test_a_failure_notice_reaches_a_peer_whose_global_rank_is_not_its_pp_rank():
    _, _, error = run_ranks(_failure_notice, 3, timeout=120)
    assert error is not None and "stage 0 broke" in error, error
    assert "pp rank 0 (global rank 1) failed" in error, error


def test_a_request_is_extended_past_notices_queued_after_it():
    # A chain's next call follows on in its predecessor's request while it is queued (calls.py,
    # `_follow_on`); another microbatch's done notice queued after the request meanwhile must
    # not split the chain into two requests (it depends on nothing), a waited-for one may.
    from types import SimpleNamespace

    from smshim.modelparallel.torch.pipeline.messages import FWD_REQ, MB_DONE, Message
    from smshim.modelparallel.torch.pipeline.outbox import Outbox
    from smshim.modelparallel.torch.pipeline.transport import Transport

    box = Outbox()
    transport = SimpleNamespace(_outbox={1: box})  # (all that extend_last reads)
    request, notice = Message(FWD_REQ, 0, 0), Message(MB_DONE, 0, 1)
    box.items += [(request, None), (notice, None)]
    seen = []

    def extend(msg):  # (as `_follow_on`: only a request takes a follow-on)
        seen.append(msg)
        return msg.kind == FWD_REQ

    assert not Transport.extend_last(transport, 1, extend)  # the notice is last
    seen.clear()
    assert Transport.extend_last(transport, 1, extend, past=(MB_DONE,)) and seen == [request]
    box.items[1] = (notice, threading.Event())  # (one waited for is not passed over)
    assert not Transport.extend_last(transport, 1, extend, past=(MB_DONE,))
    box.items[:] = [(notice, None)]
    assert not Transport.extend_last(transport, 1, extend, past=(MB_DONE,))  # no request
    assert seen == [request]
