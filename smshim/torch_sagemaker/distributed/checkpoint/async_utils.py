"""`AsyncCallsQueue`: the background saves a script has started, and finishing them.

A save is finished ("finalized") only when it is done on every rank of its group, so that a
script that deletes or overwrites older checkpoints never does so while a peer still writes.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class AsyncCallsQueue:
    def __init__(self) -> None:
        self._calls: List[Tuple[int, Future]] = []
        self._next = 0

    def schedule(self, future: Future) -> int:
        idx = self._next
        self._next += 1
        self._calls.append((idx, future))
        return idx

    def get_num_unfinalized_calls(self) -> int:
        return len(self._calls)

    def maybe_finalize_async_calls(self, blocking: bool = True,
                                   process_group: Optional[dist.ProcessGroup] = None,
                                   skip_sync: bool = False) -> List[int]:
        """Finish the saves done on every rank of `process_group` (all of them if `blocking`);
        return their indices. A failed save raises here."""
        if not self._calls:
            return []
        if blocking:
            ready = [True] * len(self._calls)
        else:
            ready = [f.done() for _, f in self._calls]
            if not skip_sync and dist.is_initialized():
                flags = torch.tensor(ready, dtype=torch.int32)
                dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=process_group)
                ready = [bool(v) for v in flags.tolist()]
        done, left = [], []
        for (idx, future), ok in zip(self._calls, ready):
            if ok:
                future.result()  # re-raises the background save's error
                done.append(idx)
            else:
                left.append((idx, future))
        self._calls = left
        return done

    def close(self) -> None:
        self.maybe_finalize_async_calls(blocking=True)
