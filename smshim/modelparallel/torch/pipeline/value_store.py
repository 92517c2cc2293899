"""The tensors a pipeline rank holds for its peers, by key.

A rank keeps here the results of the requests it served (forward outputs and backward input
gradients, under the key of the call that made them) until some peer needs them, and the values
peers sent it, until a request of its own uses them. Keys are unique across the pipeline (they
start with the calling rank and its call id), so one store serves both.

`want(key, dst)` is how a value leaves: sent at once if it is here, else as soon as `put` brings
it (`later`: with the next frame to dst, when dst does not need it yet). `get(key)` waits for a
value, bounded by SMSHIM_TIMEOUT; the error says what was awaited and from which rank. Values
are dropped per microbatch (`drop_microbatch`) once nothing can ask for them any more, and all at
the end of a step.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from smshim.modelparallel.torch.pipeline.messages import PipelineError
from smshim.modelparallel.torch.pipeline.wakeup import Wakeup

Key = Tuple[Any, ...]


def _nested_key(key: Key) -> bool:
    """A value of a call made by another rank than pp_rank 0 (keys start with the caller)."""
    return key[0] != 0


class ValueStore:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._values: Dict[Key, Tuple[torch.Tensor, int]] = {}
        # The keys of each microbatch's values (dropping a microbatch looks at its own only).
        self._by_microbatch: Dict[int, List[Key]] = {}
        self._wanted: Dict[Key, List[Tuple[int, bool]]] = {}  # (dst, later)
        self._waiters: Dict[Key, List[tuple]] = {}
        # Threads in `get`, by the key they wait for: a value wakes only its own waiters (on
        # pp_rank 0 every microbatch's body may be waiting for a gradient at once).
        self._getters: Dict[Key, List[Wakeup]] = {}
        self._error: Optional[BaseException] = None

    def put(self, key: Key, value: torch.Tensor, microbatch: int) -> Sequence[Tuple[int, bool]]:
        """Keep `value`; returns the ranks that asked for it before it existed (send it to them),
        each with whether it may go with the next frame (see `want`)."""
        ready = None
        with self._lock:
            values = self._values
            if key not in values:
                keys = self._by_microbatch.get(microbatch)
                if keys is None:
                    self._by_microbatch[microbatch] = [key]
                else:
                    keys.append(key)
            values[key] = (value, microbatch)
            if self._getters:
                for event in self._getters.get(key, ()):
                    event.set()
            waiters = self._waiters.pop(key, None) if self._waiters else None
            if waiters:
                ready = []
                for waiter in waiters:
                    waiter[0].discard(key)
                    if not waiter[0]:
                        ready.append(waiter[1])
            wanted = self._wanted.pop(key, ()) if self._wanted else ()
        if ready:
            for fn in ready:
                fn()
        return wanted

    def when_ready(self, keys, fn: Callable[[], None]) -> None:
        """Call `fn` once every key is here (at once if they are): a request waits for its
        inputs without holding a thread."""
        with self._lock:
            missing = {k for k in keys if k not in self._values}
            if missing:
                waiter = (missing, fn)
                for k in missing:
                    self._waiters.setdefault(k, []).append(waiter)
                return
        fn()

    def want(self, key: Key, dst: int, later: bool = False) -> Optional[torch.Tensor]:
        """The value if it is here (send it now); else remember that `dst` wants it. `later`:
        dst will need it only after what this rank sends it next, so it may go with that."""
        with self._lock:
            entry = self._values.get(key)
            if entry is not None:
                return entry[0]
            wanted = self._wanted.setdefault(key, [])
            if (dst, False) in wanted or (dst, later) in wanted:
                return None  # asked for already, as soon
            if (dst, True) in wanted:  # asked for later before, now at once
                wanted.remove((dst, True))
            wanted.append((dst, later))
            return None

    def peek(self, key: Key) -> Optional[torch.Tensor]:
        with self._lock:
            entry = self._values.get(key)
            return None if entry is None else entry[0]

    def get(self, key: Key, describe: Callable[[], str]) -> torch.Tensor:
        deadline = time.monotonic() + self.timeout_s
        event: Optional[Wakeup] = None
        try:
            while True:
                with self._lock:
                    entry = self._values.get(key)
                    if entry is not None:
                        return entry[0]
                    if self._error is not None:
                        raise PipelineError(f"{describe()}: {self._error}") from self._error
                    if event is None:
                        event = Wakeup()
                        self._getters.setdefault(key, []).append(event)
                    else:
                        event.clear()  # (a `put` after this check sets it again: none is lost)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PipelineError(f"{describe()}: nothing came in {self.timeout_s:.0f} s "
                                        "(SMSHIM_TIMEOUT sets this limit)")
                event.wait(timeout=min(left, 1.0))
        finally:
            if event is not None:
                with self._lock:
                    getters = self._getters.get(key)
                    if getters is not None:
                        getters.remove(event)
                        if not getters:
                            del self._getters[key]

    def drop_microbatch(self, microbatch: int, keep_nested: bool = False) -> None:
        """Drop the microbatch's values; with `keep_nested`, but those of nested calls
        (`_nested_key`), which stay until the step's end."""
        with self._lock:
            keys = self._by_microbatch.pop(microbatch, None)
            if not keys:
                return
            kept = []
            for key in keys:
                if keep_nested and _nested_key(key):
                    kept.append(key)
                else:
                    self._values.pop(key, None)
            if kept:
                self._by_microbatch[microbatch] = kept

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
            self._by_microbatch.clear()
            self._wanted.clear()
            self._waiters.clear()

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            self._error = exc
            for events in self._getters.values():
                for event in events:
                    event.set()

    def reset_error(self) -> None:
        with self._lock:
            self._error = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._values)
