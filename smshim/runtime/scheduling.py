"""The process's threads in the kernel's batch class (`SCHED_BATCH`) while a pipeline runs.

A pipeline stage is a handful of threads that hand work to each other (a step body, the
receiver that serves requests, gloo's event loop, the senders, the caller's thread), and the
Python ones take turns at the GIL. Under the default policy a thread that is woken preempts the
one that woke it when they share a core; the woken thread then waits for the GIL the waker still
holds, and the kernel switches back: two switches for a hand-off, and on small modules the
hand-offs are most of a step. A batch thread is not preempted by a thread it wakes (the woken one
runs when it blocks or its slice ends), which suits a training process: throughput, not latency,
work. On the tiny-block benchmark it takes 10-15 % off smshim's step; on 8 sleep stages on 2
cores, 2 % (docs/benchmarks.md).

Linux only; elsewhere, and with `SMSHIM_SCHED_BATCH=0`, nothing changes. A thread someone gave
another policy (real-time, idle) keeps it. Nice values are untouched. `restore` gives the threads
changed here their policy back; threads started meanwhile by batch threads stay batch (as those
of a pipeline's transport, which end with it).
"""

from __future__ import annotations

import logging
import os
from typing import Set

__all__ = ["ENV", "available", "use_batch_scheduling", "restore"]

logger = logging.getLogger(__name__)

ENV = "SMSHIM_SCHED_BATCH"

_changed: Set[int] = set()  # ids of the threads moved from SCHED_OTHER


def available() -> bool:
    """The kernel has SCHED_BATCH and this process can list its threads."""
    return hasattr(os, "SCHED_BATCH") and os.path.isdir("/proc/self/task")


def use_batch_scheduling() -> bool:
    """Put this process's threads under SCHED_BATCH (threads they start later inherit it), unless
    `SMSHIM_SCHED_BATCH=0`. Returns whether it did."""
    if os.environ.get(ENV, "1") == "0" or not available():
        return False
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            if os.sched_getscheduler(tid) != os.SCHED_OTHER:
                continue  # (batch already, or a policy someone chose on purpose)
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
            _changed.add(tid)
        except OSError as e:  # (a thread that ended meanwhile)
            logger.debug("SCHED_BATCH for thread %d: %s", tid, e)
    return True


def restore() -> None:
    """The threads `use_batch_scheduling` changed, if they still run, go back to SCHED_OTHER."""
    while _changed:
        tid = _changed.pop()
        try:
            if os.sched_getscheduler(tid) == os.SCHED_BATCH:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            pass  # (it ended)
