"""Long-lived daemon threads that take jobs in turn: the transport's receivers and pp_rank 0's
microbatch bodies.

Not a ThreadPoolExecutor: its threads are joined at interpreter exit, and a thread left inside a
gloo receive, or in a step body abandoned midway, would hang the exit. And not a thread per job:
a fresh thread costs its start and, on the CPU, its compute (per-thread state of the allocator
and the math library is built again: 5-14 % more CPU time for a forward and backward through
half of a small GPT, `benchmarks/thread_reuse.py`), and the pipeline runs one body per
microbatch.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, List

import torch

from smshim.modelparallel.torch.pipeline.wakeup import Wakeup

logger = logging.getLogger(__name__)


def adopt_intra_op_threads() -> None:
    """Give the calling (new) thread the process's intra-op thread count.

    OpenMP keeps the thread count per thread: `torch.set_num_threads` (and OMP_NUM_THREADS read
    after the OpenMP runtime started, as in a forked process) sets it for the calling thread only.
    ATen applies the process's count to a new thread on its first parallelised op, but a matrix
    product runs in the BLAS first: in a thread that has done nothing else (the idle-time weight
    gradients, a step body) it ran with the OpenMP default, one thread per core. On a machine
    whose cores are all busy, the extra OpenMP thread waits for a core at the end of every
    product while the caller spins: 0.35-3.4 ms of CPU for a product that takes 18 us (a 64 x 16
    weight's gradient, two processes on two cores)."""
    torch.set_num_threads(torch.get_num_threads())


class Workers:
    """Daemon threads named `name`: `run` hands a job to an idle one (a new one if none is);
    a thread that finishes its job waits, idle, for the next."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.threads: List[threading.Thread] = []
        self._idle: List[list] = []  # [event, job] of threads waiting for a job
        self._lock = threading.Lock()
        self._stopped = False

    def run(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` on an idle thread (a new one if none is idle). `fn` reports its own
        errors: one that escapes is logged."""
        with self._lock:
            if self._stopped:
                return
            slot = self._idle.pop() if self._idle else None
            start = slot is None
            if start:
                slot = [Wakeup(), None]
                thread = threading.Thread(target=self._loop, args=(slot,), daemon=True,
                                          name=self.name)
                self.threads.append(thread)
        slot[1] = (fn, args)
        slot[0].set()
        if start:
            thread.start()

    def _loop(self, slot: list) -> None:
        adopt_intra_op_threads()
        event = slot[0]
        while True:
            event.wait()
            event.clear()
            if self._stopped:
                return
            fn, args = slot[1]
            slot[1] = None
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001  (the job reports its own errors)
                logger.exception("%s: unexpected error", self.name)
            del fn, args  # hold nothing while idle
            with self._lock:
                if self._stopped:
                    return
                self._idle.append(slot)

    def stop(self) -> None:
        """Idle threads end now, busy ones when their job returns."""
        with self._lock:
            self._stopped = True
            idle, self._idle = self._idle, []
        for event, _ in idle:
            event.set()
