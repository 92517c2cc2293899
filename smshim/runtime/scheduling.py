"""Where a pipeline's threads run: in the kernel's batch class (`SCHED_BATCH`), and, on a
CPU-only host, on cores of their own rank's.

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

On a host without CUDA whose every core the process may use, `bind_to_own_cores` gives each of
the host's ranks an equal slice of the cores, as `mpirun` binds ranks by default: a stage is
several busy threads, and left free the kernel spreads two ranks' threads over the same cores
(the tiny-block step took 16-19 ms unbound against 12-14 bound, docs/benchmarks.md). Not when a
launcher bound the rank already (its set is not the whole host), nor with more ranks than cores;
`SMSHIM_BIND_CORES=0` turns it off. The intra-op thread count is cut to the slice's size. (The
pipeline calls it only when the launcher gave the host's rank count: `LaunchInfo.local_known`.)
"""

from __future__ import annotations

import logging
import os
from typing import List, Optional, Set, Tuple

import torch

__all__ = ["ENV", "BIND_ENV", "available", "use_batch_scheduling", "bind_to_own_cores",
           "binding", "restore"]

logger = logging.getLogger(__name__)

ENV = "SMSHIM_SCHED_BATCH"
BIND_ENV = "SMSHIM_BIND_CORES"

_changed: Set[int] = set()  # ids of the threads moved from SCHED_OTHER
_bound: Optional[List[int]] = None  # the cores this rank was bound to
_unbound: Optional[Set[int]] = None  # the affinity before
_threads_before: Optional[int] = None  # the intra-op thread count before, if cut


def _tids() -> List[int]:
    return [int(name) for name in os.listdir("/proc/self/task")]


def _set_affinity(cores) -> None:
    """Every thread of the process on `cores` (affinity is a thread's own on Linux)."""
    for tid in _tids():
        try:
            os.sched_setaffinity(tid, cores)
        except OSError as e:  # (a thread that ended meanwhile)
            logger.debug("affinity of thread %d: %s", tid, e)


def available() -> bool:
    """The kernel has SCHED_BATCH and this process can list its threads."""
    return hasattr(os, "SCHED_BATCH") and os.path.isdir("/proc/self/task")


def use_batch_scheduling() -> bool:
    """Put this process's threads under SCHED_BATCH (threads they start later inherit it), unless
    `SMSHIM_SCHED_BATCH=0`. Returns whether it did."""
    if os.environ.get(ENV, "1") == "0" or not available():
        return False
    for tid in _tids():
        try:
            if os.sched_getscheduler(tid) != os.SCHED_OTHER:
                continue  # (batch already, or a policy someone chose on purpose)
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
            _changed.add(tid)
        except OSError as e:  # (a thread that ended meanwhile)
            logger.debug("SCHED_BATCH for thread %d: %s", tid, e)
    return True


def bind_to_own_cores(local_rank: int, local_size: int) -> Optional[List[int]]:
    """Bind this process's threads to local rank `local_rank`'s slice of the host's cores (see
    the module's docstring for when). Returns the cores, or None if it left the affinity."""
    global _bound, _unbound, _threads_before
    if (os.environ.get(BIND_ENV, "1") == "0" or not available()
            or not hasattr(os, "sched_setaffinity") or torch.cuda.is_available()):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if (local_size < 2 or local_size > len(cpus) or len(cpus) != os.cpu_count()
            or not 0 <= local_rank < local_size):
        return None
    share = len(cpus) // local_size
    cores = cpus[local_rank * share:(local_rank + 1) * share]
    _unbound, _bound = set(cpus), cores
    _set_affinity(cores)
    if torch.get_num_threads() > share:
        _threads_before = torch.get_num_threads()
        torch.set_num_threads(share)
    logger.info("local rank %d of %d bound to cores %s (%s=0 leaves it)", local_rank,
                local_size, cores, BIND_ENV)
    return cores


def binding() -> Optional[Tuple[List[int], Set[int]]]:
    """The cores `bind_to_own_cores` bound this process to and those it had before, if it did
    (and `restore` did not undo it)."""
    if _bound is None or _unbound is None:
        return None
    return list(_bound), set(_unbound)


def restore() -> None:
    """Undo `bind_to_own_cores`; the threads `use_batch_scheduling` changed, if they still run,
    go back to SCHED_OTHER."""
    global _bound, _unbound, _threads_before
    if _unbound is not None:
        _set_affinity(_unbound)
        _bound = _unbound = None
    if _threads_before is not None:
        torch.set_num_threads(_threads_before)
        _threads_before = None
    while _changed:
        tid = _changed.pop()
        try:
            if os.sched_getscheduler(tid) == os.SCHED_BATCH:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            pass  # (it ended)
