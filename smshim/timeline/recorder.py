"""Pipeline timeline: Chrome-trace events per rank, enabled by ``SMSHIM_TRACE=<dir>``.

Each rank records spans (forward / backward / wait ...) into memory and `flush()` rewrites
``<dir>/trace_rank{rank}.json`` (open it in chrome://tracing or Perfetto, or draw it with
``benchmarks/plot_timeline.py``). When disabled every call is a near-free no-op.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import logging
import os
import tempfile
import threading
import time
import weakref
from typing import Any, ContextManager, Dict, List, Optional

__all__ = ["Timeline", "from_env", "TRACE_ENV", "DEFAULT_MAX_EVENTS"]

logger = logging.getLogger(__name__)

TRACE_ENV = "SMSHIM_TRACE"
DEFAULT_MAX_EVENTS = 200_000

# A reusable, re-entrant no-op: the disabled timeline hands out this one object.
_NOOP = contextlib.nullcontext()


def _now_us() -> float:
    # perf_counter_ns reads CLOCK_MONOTONIC on Linux, a per-host clock shared by all processes, so
    # the absolute timestamps of different ranks on one host line up without any synchronisation.
    # (Ranks on different hosts are only aligned to within their clocks' offset.)
    return time.perf_counter_ns() / 1000.0


class _Span:
    __slots__ = ("_tl", "_name", "_cat", "_args", "_start", "_lane")

    def __init__(self, tl: "Timeline", name: str, cat: str, args: Dict[str, Any]):
        self._tl, self._name, self._cat, self._args = tl, name, cat, args
        self._start = 0.0
        self._lane = 0

    def __enter__(self) -> "_Span":
        # The lane is taken on entry: a lane is only handed to a new thread once its previous owner
        # has died, which then guarantees that their spans do not overlap.
        self._lane = self._tl._lane()
        self._start = _now_us()
        return self

    def note(self, **args: Any) -> None:
        """Add arguments known only inside the span (e.g. the CPU time it took)."""
        self._args = dict(self._args, **args)

    def __exit__(self, exc_type, exc, tb) -> None:
        end = _now_us()
        args = self._args
        if exc_type is not None:
            args = dict(args, error=exc_type.__name__)
        self._tl._record({
            "name": self._name, "cat": self._cat, "ph": "X",
            "ts": self._start, "dur": max(0.0, end - self._start), "args": args,
        }, self._lane)


class Timeline:
    """Thread-safe recorder of one rank's timeline; disabled when ``directory`` is None."""

    def __init__(self, rank: int, directory: Optional[str], max_events: int = DEFAULT_MAX_EVENTS):
        self.rank = int(rank)
        self.directory = os.fspath(directory) if directory is not None else None
        self.enabled = self.directory is not None
        if not self.enabled:
            return
        os.makedirs(self.directory, exist_ok=True)
        self.path = os.path.join(self.directory, f"trace_rank{self.rank}.json")
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        # Only the newest events are kept so a long run cannot exhaust memory.
        self._events: collections.deque = collections.deque(maxlen=max_events)
        self._dropped = 0
        self._local = threading.local()
        # Lanes (Chrome "tid") are allocated per thread name so that worker threads re-created under
        # the same name reuse a row; a second live thread with the same name gets its own lane.
        self._lanes: Dict[str, List[List[Any]]] = {}  # name -> [[lane, thread], ...]
        self._next_lane = 0
        self._meta: List[Dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": self.rank, "args": {"sort_index": self.rank}},
        ]
        ref = weakref.ref(self)
        atexit.register(_flush_at_exit, ref)

    # -- recording -----------------------------------------------------------------------------
    def span(self, name: str, cat: str, **args: Any) -> ContextManager[Any]:
        """Context manager recording a complete event ("ph": "X") around its body."""
        if not self.enabled:
            return _NOOP
        return _Span(self, name, cat, args)

    def instant(self, name: str, cat: str, **args: Any) -> None:
        """Record an instant event ("ph": "i", thread scope)."""
        if not self.enabled:
            return
        self._record({"name": name, "cat": cat, "ph": "i", "s": "t", "ts": _now_us(), "args": args}, self._lane())

    def _lane(self) -> int:
        lane = getattr(self._local, "lane", None)
        if lane is not None:
            return lane
        thread = threading.current_thread()
        with self._lock:
            slots = self._lanes.setdefault(thread.name, [])
            for slot in slots:
                if not slot[1].is_alive():  # its previous owner is gone: take over the row
                    slot[1] = thread
                    lane = slot[0]
                    break
            else:
                lane = self._next_lane  # lanes are numbered 0, 1, 2 ... in order of first use
                self._next_lane += 1
                label = thread.name if not slots else f"{thread.name} #{len(slots) + 1}"
                slots.append([lane, thread])
                self._meta.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": lane,
                                   "args": {"name": label}})
                self._meta.append({"name": "thread_sort_index", "ph": "M", "pid": self.rank, "tid": lane,
                                   "args": {"sort_index": lane}})
        self._local.lane = lane
        return lane

    def _record(self, event: Dict[str, Any], lane: int) -> None:
        event["pid"] = self.rank
        event["tid"] = lane
        with self._lock:
            if len(self._events) == self._events.maxlen:
                self._dropped += 1
            self._events.append(event)

    # -- output --------------------------------------------------------------------------------
    def events(self) -> List[Dict[str, Any]]:
        """A snapshot of the recorded events (metadata first)."""
        if not self.enabled:
            return []
        with self._lock:
            return list(self._meta) + list(self._events)

    def flush(self) -> Optional[str]:
        """Rewrite ``<dir>/trace_rank{rank}.json`` with every kept event; returns its path.

        The file is written to a temporary name and renamed over the old one, so a reader never
        sees a partial file.
        """
        if not self.enabled:
            return None
        with self._flush_lock:
            with self._lock:
                events = list(self._meta) + list(self._events)
                dropped = self._dropped
            doc: Dict[str, Any] = {"traceEvents": events, "displayTimeUnit": "ms"}
            if dropped:
                doc["otherData"] = {"dropped_events": dropped}
            # dumps (not dump): only the one-shot encoder is the fast C one (~5 us per event).
            text = json.dumps(doc, default=str, separators=(",", ":"))
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".trace_rank{self.rank}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        if dropped:
            logger.debug("timeline rank %d: %d oldest events dropped (cap %d)", self.rank, dropped,
                         self._events.maxlen)
        return self.path

    def __repr__(self) -> str:
        where = self.path if self.enabled else "disabled"
        return f"Timeline(rank={self.rank}, {where})"


def _flush_at_exit(ref: "weakref.ref[Timeline]") -> None:
    # Safety net so a trace is written even if the engine never reached its own flush.
    tl = ref()
    if tl is None or not tl.enabled:
        return
    try:
        if tl._events and os.path.isdir(tl.directory):
            tl.flush()
    except Exception as e:  # never turn interpreter shutdown into a crash over a trace file
        logger.warning("could not write timeline %s at exit: %s", tl.path, e)


def from_env(rank: int) -> Timeline:
    """The rank's Timeline, writing to ``$SMSHIM_TRACE`` if set (non-empty), else disabled."""
    directory = os.environ.get(TRACE_ENV) or None
    return Timeline(rank, directory)
