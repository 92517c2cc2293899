"""The run queue: a rank's ready requests run one after another on one thread, in priority order;
a runner that must wait passes its role on, so queued work never waits for it."""

import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from smshim.modelparallel.torch.pipeline.run_queue import RunQueue
from smshim.testing import run_ranks
from tests.polling import wait_until


def _spawner(started):
    def spawn(fn):
        t = threading.Thread(target=fn, daemon=True)
        started.append(t)
        t.start()
    return spawn


def test_items_queued_while_the_runner_works_run_next_on_its_thread_in_priority_order():
    ran, started, busy = [], [], threading.Event()

    def run(item):
        ran.append((item, threading.get_ident()))
        if item == "first":
            busy.wait(5)

    q = RunQueue(run, _spawner(started))
    q.put((0, 0), "first")
    wait_until(lambda: ran)
    for priority, item in (((1, 2), "c"), ((0, 9), "b"), ((1, 1), "d")):
        q.put(priority, item)
    assert q.peek() == "b"
    busy.set()
    wait_until(lambda: len(ran) == 4)
    started[0].join(5)
    assert [item for item, _ in ran] == ["first", "b", "d", "c"]
    assert len({tid for _, tid in ran}) == 1 and len(started) == 1


def test_a_runner_that_waits_steps_down_and_the_queued_work_it_waits_for_runs():
    ran, started, produced = [], [], threading.Event()

    def run(item):
        ran.append((item, q.is_runner()))
        if item == "consumer":
            q.put((0, 1), "producer")  # queued behind the consumer, which waits for it
            q.step_down()
            assert produced.wait(5), "the producer never ran"
        else:
            produced.set()

    q = RunQueue(run, _spawner(started))
    q.put((0, 0), "consumer")
    wait_until(lambda: len(ran) == 2)
    for t in started:
        t.join(5)
        assert not t.is_alive()
    # Two threads, one runner at a time; the role is free again at the end.
    assert ran == [("consumer", True), ("producer", True)] and len(started) == 2
    assert q._owner is None and len(q) == 0


def test_a_runner_back_from_its_wait_takes_the_role_again_when_it_is_free():
    ran, started = [], []
    gate = threading.Event()

    def run(item):
        ran.append((item, threading.get_ident()))
        if item == "waits":
            q.step_down()
            gate.wait(5)  # nothing is queued: nobody takes over
            q.put((0, 5), "after", here=True)  # it runs what it queues once its item is over

    q = RunQueue(run, _spawner(started))
    q.put((0, 0), "waits")
    wait_until(lambda: ran)
    assert q._owner is None  # the role is free while the old runner waits
    gate.set()
    wait_until(lambda: len(ran) == 2)
    started[0].join(5)
    assert len(started) == 1 and ran[0][1] == ran[1][1] and q._owner is None


def test_a_runner_waiting_for_the_lock_keeps_its_role_for_work_that_goes_after_it():
    # Work after the runner's would only wait for the lock behind it, on a thread of its own;
    # work before it may be what the lock waits for, and takes the role.
    ran, started = [], []
    waiting, lock_free, better_ran = threading.Event(), threading.Event(), threading.Event()

    def run(item):
        ran.append((item, threading.get_ident()))
        if item == "mine":
            q.put((1, 9), "after")
            q.wait_at((1, 5))  # as ComputeLock.acquire does before it waits
            waiting.set()
            assert lock_free.wait(5)
            q.waited()
        elif item == "before":
            better_ran.set()

    q = RunQueue(run, _spawner(started))
    q.put((1, 5), "mine")
    assert waiting.wait(5)
    assert len(started) == 1 and q._owner == ran[0][1]  # still the runner: nothing new started
    q.put((0, 1), "before")  # goes before the waiting runner: a new thread runs it at once
    assert better_ran.wait(5)
    assert len(started) == 2 and ran[-1][1] != ran[0][1]
    lock_free.set()
    wait_until(lambda: len(ran) == 3)
    for t in started:
        t.join(5)
    assert [item for item, _ in ran] == ["mine", "before", "after"] and q._owner is None


def test_here_makes_the_caller_the_runner():
    ran, started = [], []
    q = RunQueue(lambda item: ran.append((item, threading.get_ident())), _spawner(started))
    assert q.put((0, 0), "a", here=True) is True
    assert q.put((0, 1), "b", here=True) is False  # the caller has the role already
    q.drain()
    assert [item for item, _ in ran] == ["a", "b"] and started == []
    assert {tid for _, tid in ran} == {threading.get_ident()}
    assert not q.is_runner() and q._owner is None


def test_the_runner_takes_the_next_item_only_if_it_is_the_one_it_would_run_and_wanted():
    ran, started = [], []
    may = {"late": False}
    q = RunQueue(lambda item: ran.append(item), _spawner(started),
                 may_start=lambda item: may.get(item, True))
    q.put((0, 0), "a", here=True)
    q.put((0, 1), "b", here=True)
    q.put((0, 2), "c", here=True)
    assert q.take_next(lambda item: item == "b") is None  # not the head
    assert q.take_next(lambda item: item in "ab") == "a"
    assert q.take_next(lambda item: True) == "b"
    q.put((0, -1), "late", here=True)  # queued first, but may not start yet
    assert q.take_next(lambda item: True) is None
    other = []
    t = threading.Thread(target=lambda: other.append(q.take_next(lambda item: True)))
    t.start()
    t.join(5)
    assert other == [None]  # only the runner takes items out
    may["late"] = True
    q.drain()
    assert ran == ["late", "c"] and started == []


def test_first_is_after_says_whether_queued_work_goes_before_or_with_a_priority():
    q = RunQueue(lambda item: None, _spawner([]))
    assert q.first_is_after((0, 3))  # nothing queued
    q.put((0, 3), "a", here=True)
    assert q.first_is_after((0, 2))
    assert not q.first_is_after((0, 3))  # an equal one goes first: it came first
    assert not q.first_is_after((1, 0))


# ---- a chain's next request: kept for `_chain`, not queued --------------------------------

def _owner():
    from smshim.modelparallel.torch.pipeline.serving import OwnerSide

    class Owner(OwnerSide):
        """The owner's side alone, over a run queue: what `_ready` and `_deliver` use."""

        deterministic = False

        def __init__(self) -> None:
            from smshim.timeline.recorder import Timeline

            self.timeline = Timeline(0, None)
            self._runq = RunQueue(lambda item: None, _spawner([]))

        def _priority(self, kind, mb):
            return (0 if kind == "forward" else 1, mb)

    return Owner()


def _request(kind, mb, src=0):
    from smshim.modelparallel.torch.pipeline.messages import Message

    msg = Message(kind, 0, mb, 7, "block")
    msg.src = src
    return msg


def test_a_request_its_predecessor_s_results_make_ready_is_kept_for_the_chain():
    from smshim.modelparallel.torch.pipeline.context import _serving
    from smshim.modelparallel.torch.pipeline.messages import FWD_REQ
    from smshim.modelparallel.torch.pipeline.scheduler import FORWARD

    owner = _owner()
    nxt, other_mb, nested = _request(FWD_REQ, 3), _request(FWD_REQ, 4), _request(FWD_REQ, 3, 2)
    _serving.here = _serving.chains = True
    try:
        owner._deliver(lambda: [owner._ready(m) for m in (other_mb, nested, nxt)], (),
                       (FORWARD, 3))
        assert _serving.candidate is nxt and _serving.chain_key is None
        assert len(owner._runq) == 2  # another microbatch's, and a nested call's: queued
        _serving.candidate = None
        owner._ready(_request(FWD_REQ, 3))  # not while a result is delivered: queued
        assert len(owner._runq) == 3 and _serving.candidate is None
        owner.deterministic = True  # (its requests keep the queue's order)
        owner._deliver(lambda: owner._ready(_request(FWD_REQ, 3)), (), (FORWARD, 3))
        assert len(owner._runq) == 4 and _serving.candidate is None
    finally:
        _serving.here = _serving.chains = False
        _serving.candidate = _serving.chain_key = None


def test_a_kept_request_goes_to_the_queue_when_its_predecessor_s_delivery_fails():
    from smshim.modelparallel.torch.pipeline.context import _serving
    from smshim.modelparallel.torch.pipeline.messages import BWD_REQ
    from smshim.modelparallel.torch.pipeline.scheduler import BACKWARD

    owner = _owner()

    def deliver() -> None:
        owner._ready(_request(BWD_REQ, 5))
        raise RuntimeError("the send failed")

    _serving.here = _serving.chains = True
    try:
        try:
            owner._deliver(deliver, (), (BACKWARD, 5))
        except RuntimeError:
            pass
        else:
            raise AssertionError("the failure did not propagate")
        assert _serving.candidate is None and _serving.chain_key is None
        assert len(owner._runq) == 1  # (no `_chain` follows: it runs from the queue)
    finally:
        _serving.here = _serving.chains = False
        _serving.candidate = _serving.chain_key = None


def test_a_kept_request_that_cannot_run_next_is_queued_once():
    """`_chain` queues the kept request when queued work goes before it; when that work is not
    the chain's either, the request stays queued, once (it was queued twice, and served twice:
    a module's forward ran twice and its second reply was unexpected)."""
    from smshim.modelparallel.torch.pipeline.context import _serving
    from smshim.modelparallel.torch.pipeline.messages import BWD_REQ, FWD_REQ
    from smshim.modelparallel.torch.pipeline.scheduler import FORWARD

    class Lock:
        def contested(self, priority):
            return False

        def keep_place(self, priority, key):
            return ("place", priority)

    class Hold:
        took = True

        def keep(self):
            raise AssertionError("no chain: the lock is not kept")

    owner = _owner()
    owner.lock = Lock()
    kept, first = _request(FWD_REQ, 3), _request(BWD_REQ, 1)
    owner._runq.put((0, 1), first, here=True)  # (goes first; this thread is the runner)
    _serving.chains, _serving.candidate = True, kept
    try:
        owner._chain(Hold(), FORWARD, 3, 0)
        assert _serving.next is None and _serving.candidate is None
        queued = [entry[2] for entry in owner._runq._heap]
        assert queued.count(kept) == 1 and queued.count(first) == 1, queued
    finally:
        _serving.chains, _serving.candidate, _serving.next = False, None, None


# ---- in a pipeline ------------------------------------------------------------------------

class Slow(nn.Module):
    """A stage slower than its caller: the next microbatches' requests queue up behind it."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.threads = []

    def forward(self, x):
        self.threads.append(threading.get_ident())
        time.sleep(0.04)
        return torch.tanh(self.lin(x))


class SlowNet(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.inp, self.slow, self.head = nn.Linear(d, d), Slow(d), nn.Linear(d, 3)

    def forward(self, x):
        return self.head(self.slow(F.relu(self.inp(x))))


def _slow_stage(m, steps):
    import smdistributed.modelparallel.torch as smp

    torch.set_num_threads(1)
    smp.init({"pipeline_parallel_degree": 2, "microbatches": m, "pipeline": "simple",
              "active_microbatches": m, "auto_partition": False, "default_partition": 0})
    torch.manual_seed(0)
    module = SlowNet()
    model = smp.DistributedModel(module)
    smp.set_partition(module.slow, 1)
    smp.set_partition(module.head, 1)

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(1)
    threads = []
    for _ in range(steps):
        module.slow.threads.clear()
        x, y = torch.randn(4 * m, 8, generator=g), torch.randint(0, 3, (4 * m,), generator=g)
        train_step(model, x, y)
        threads.append(list(module.slow.threads))
    return smp.pp_rank(), threads


def test_a_busy_stage_runs_the_next_microbatches_requests_on_the_same_thread():
    # Every microbatch's forward reaches pp rank 1 while it computes the one before. Each then
    # starts on the thread that finished the last: the step's forwards run on one thread. (A
    # thread per request would run them on m threads. pp_rank 0's bodies sometimes send two
    # microbatches out of order, and the later one then waits on a thread of its own for the
    # earlier: so not every step, but most.)
    m, steps = 4, 6
    for pp_rank, threads in run_ranks(_slow_stage, 2, m, steps, timeout=180):
        if pp_rank != 1:
            continue
        measured = threads[1:]  # (the first step waits for each output's shapes)
        assert all(len(step) == m for step in measured), threads
        assert sum(len(set(step)) == 1 for step in measured) >= 1, threads


def test_a_runner_that_gives_the_compute_lock_up_to_wait_passes_its_role_on():
    # A tensor-parallel collective gives the lock up while it waits for its peer, whose own
    # order of microbatches may need the request queued here to run first: it must run.
    from smshim.modelparallel.torch.pipeline.scheduler import ComputeLock

    lock, started, peer_came, ran = ComputeLock(), [], threading.Event(), []

    def run(item):
        with lock.hold((0, 0)):
            if item == "waits for its peer":
                with lock.released():
                    ran.append(item if peer_came.wait(5) else "timed out")
            else:
                ran.append(item)
                peer_came.set()

    q = RunQueue(run, _spawner(started))
    lock.on_give_up = q.step_down
    q.put((0, 0), "waits for its peer")
    wait_until(lambda: started)
    q.put((0, 1), "what the peer needs first")
    wait_until(lambda: len(ran) == 2)
    assert ran == ["what the peer needs first", "waits for its peer"]
