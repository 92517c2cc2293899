"""Waits that many threads share wake only the thread whose condition came true: the compute
lock (a release wakes the waiter that takes it), the value store's `get` (pp_rank 0's bodies
waiting for gradients), pp_rank 0's turns (bodies waiting for the earlier microbatches) and
pp_rank 0's caller thread (woken when it can admit a microbatch or the step is over).
With a condition's notify_all, m waiting bodies cost m thread switches per change (m^2 per step
under `simple`)."""

import threading
import time

import pytest
import torch
import torch.nn as nn

from smshim.modelparallel.torch.pipeline.scheduler import ComputeLock
from smshim.modelparallel.torch.pipeline.server import ModuleServer
from smshim.timeline.recorder import Timeline
from smshim.modelparallel.torch.pipeline.messages import PipelineError
from smshim.modelparallel.torch.pipeline.value_store import ValueStore
from smshim.modelparallel.torch.pipeline.wakeup import Wakeup
from smshim.testing import run_ranks
from tests.polling import wait_until


@pytest.fixture
def woken(monkeypatch):
    """The wake-ups set from now on (`Wakeup.set`, counted)."""
    sets = []
    real_set = Wakeup.set

    def counted_set(self):
        sets.append(self)
        real_set(self)

    monkeypatch.setattr(Wakeup, "set", counted_set)
    return sets


def test_a_release_wakes_only_the_waiter_that_takes_the_lock(woken):
    lock, log = ComputeLock(), []
    go_on = threading.Event()

    def take(priority, name):
        with lock.hold(priority):
            log.append(name)
            go_on.wait(5)

    lock.acquire((0, 0))
    threads = []
    for i in range(1, 5):
        threads.append(threading.Thread(target=take, args=((1, i), f"mb{i}"), daemon=True))
        threads[-1].start()
        wait_until(lambda: len(lock._waiters) == i)
    woken.clear()  # (what the set-up woke)
    lock.release()
    wait_until(lambda: log)
    assert log == ["mb1"]
    assert len(woken) == 1  # mb2..mb4 slept on
    go_on.set()
    for t in threads:
        t.join(5)
    assert log == ["mb1", "mb2", "mb3", "mb4"]


def test_a_value_wakes_only_the_threads_waiting_for_it(woken):
    store, got = ValueStore(timeout_s=10), {}

    def get(key):
        got[key] = store.get(key, lambda: f"waiting for {key}")

    threads = [threading.Thread(target=get, args=(k,), daemon=True) for k in ("a", "b", "c")]
    for t in threads:
        t.start()
    wait_until(lambda: len(store._getters) == 3)
    woken.clear()  # (what the set-up woke)
    store.put("b", torch.ones(1), microbatch=0)
    threads[1].join(5)
    assert list(got) == ["b"]
    assert len(woken) == 1  # the threads waiting for "a" and "c" slept on
    assert sorted(store._getters) == ["a", "c"]
    store.put("a", torch.zeros(1), microbatch=0)
    store.put("c", torch.zeros(1), microbatch=0)
    for t in threads:
        t.join(5)
    assert sorted(got) == ["a", "b", "c"] and not store._getters


def test_a_failure_wakes_every_waiting_thread_at_once():
    store, errors = ValueStore(timeout_s=30), []

    def get(key):
        try:
            store.get(key, lambda: f"waiting for {key}")
        except PipelineError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=get, args=(k,), daemon=True) for k in ("a", "b")]
    for t in threads:
        t.start()
    wait_until(lambda: len(store._getters) == 2)
    t0 = time.monotonic()
    store.fail(RuntimeError("pp rank 2 died"))
    for t in threads:
        t.join(5)
    assert time.monotonic() - t0 < 0.5  # not the 1 s poll
    assert sorted(errors) == ["waiting for a: pp rank 2 died", "waiting for b: pp rank 2 died"]


class _Transport:
    error = None

    def check(self):
        if self.error is not None:
            raise PipelineError(str(self.error))


@pytest.fixture
def server():
    s = ModuleServer(nn.Linear(2, 2), {}, 0, ComputeLock(), Timeline(0, None), timeout_s=10,
                     device=torch.device("cpu"))
    s.transport = _Transport()
    yield s
    s.close()


def test_a_turn_wakes_only_the_body_whose_turn_it_is(server, woken):
    order = []

    def body(mb):
        server.turns.wait_forward(mb, f"forward of microbatch {mb}")
        order.append(mb)

    threads = [threading.Thread(target=body, args=(mb,), daemon=True) for mb in (1, 2, 3)]
    for t in threads:
        t.start()
    wait_until(lambda: len(server.turns._waiters) == 3)
    woken.clear()  # (what the set-up woke)
    server.turns.forward_over(0)
    threads[0].join(5)
    assert order == [1]
    assert len(woken) == 1  # microbatches 2 and 3 slept on
    assert [mb for _, mb, _ in server.turns._waiters] == [2, 3]
    server.turns.forward_over(1)
    threads[1].join(5)
    server.turns.forward_over(2)
    for t in threads:
        t.join(5)
    assert order == [1, 2, 3] and not server.turns._waiters


def test_a_transport_failure_wakes_the_bodies_waiting_for_their_turn(server):
    errors = []

    def body():
        try:
            server.turns.wait_forward(2, "forward of microbatch 2")
        except PipelineError as e:
            errors.append(str(e))

    t = threading.Thread(target=body, daemon=True)
    t.start()
    wait_until(lambda: len(server.turns._waiters) == 1)
    t0 = time.monotonic()
    server.transport.error = RuntimeError("pp rank 1 died")
    server.wake_all(server.transport.error)
    t.join(5)
    assert time.monotonic() - t0 < 0.5
    assert errors == ["pp rank 1 died"]


def _caller_notifications(m, steps):
    """How often pp_rank 0's caller thread (admitting microbatches, waiting for the step's end)
    was notified in each step of a 2-stage pipeline under `simple`."""
    import smdistributed.modelparallel.torch as smp
    from tests.pipeline_models import batches, make_model, make_train_step

    smp.init({"pipeline_parallel_degree": 2, "microbatches": m, "pipeline": "simple",
              "active_microbatches": m})
    module = make_model("net")
    model = smp.DistributedModel(module)
    train_step = make_train_step()
    counts = []
    for i, (x, y) in enumerate(batches("net", steps, 8)):
        pipeline = model._pipeline
        cond = pipeline._cond if pipeline is not None else None
        if cond is not None and "notify_all" not in vars(cond):
            def counted(_notify=cond.notify_all):
                counts[-1] += 1
                _notify()
            cond.notify_all = counted
        counts.append(0)
        train_step(model, x, y)
    return counts[1:]  # (the first step may build the pipeline)


def test_the_callers_thread_is_notified_only_when_it_can_act():
    # Under `simple` it admits every microbatch at once and then has nothing to do until the
    # last body ends: one notification a step, where each backward and each body end (2m) woke it.
    counts = run_ranks(_caller_notifications, 2, 4, 3, timeout=180)[0]
    assert counts == [1, 1], counts


def test_a_value_asked_for_later_then_at_once_is_sent_once_at_once():
    store = ValueStore(timeout_s=10)
    store.want(("k",), 0, later=True)
    store.want(("k",), 0)  # asked again without `later`: at once, and only once
    store.want(("k",), 1, later=True)
    assert store.put(("k",), torch.zeros(1), 0) == [(0, False), (1, True)]
    assert store.want(("k",), 2, later=True) is not None  # here already: sent now, as asked


def test_a_wakeup_wakes_one_wait_per_set_however_often_it_was_set():
    w = Wakeup()
    assert not w.wait(timeout=0)
    w.set()
    w.set()  # (a second set before the wait counts as one)
    assert w.wait(timeout=0)
    assert not w.wait(timeout=0.01)
    w.set()
    w.clear()
    assert not w.wait(timeout=0)
    got = []
    t = threading.Thread(target=lambda: got.append(w.wait(timeout=30)))
    t.start()
    w.set()
    t.join(timeout=30)
    assert got == [True]
