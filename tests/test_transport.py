"""The pipeline transport on its own (transport.py), two gloo processes: messages arrive whole and
in order whether they leave from the calling thread or the sender thread, and receivers that
answer each other at the same moment never wait on each other (a gloo send waits for the peer's
receive, so a receiver must not send itself)."""

import threading

from smshim.testing import run_ranks

N = 60  # (even)


def _ping_pong(n):
    import datetime

    import torch
    import torch.distributed as dist

    from smshim import _runtime
    from smshim.modelparallel.torch.transport import VALUE, Message, Transport

    torch.set_num_threads(1)
    _runtime.init_distributed()
    me = dist.get_rank()
    other = 1 - me
    group = dist.new_group([0, 1], backend="gloo", timeout=datetime.timedelta(seconds=20))
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

    transport = Transport([0, 1], me, group, dispatch, 30.0, torch.device("cpu"))
    transport.open_session()
    transport.send(other, Message(VALUE, 0, 0, meta=("rally", me, 0), tensors=[torch.zeros(4)]))
    for i in range(n):
        # Sizes on both sides of the inline limit, dtypes numpy has and has not, a 0-d tensor.
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
