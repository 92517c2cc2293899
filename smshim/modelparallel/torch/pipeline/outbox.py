"""What a rank has queued for one peer: messages not yet posted (held back to leave together),
and the frames posted to it that may still be in flight (transport.py's sender side)."""

from __future__ import annotations

import collections
import threading
from typing import List, Optional

NEVER = float("inf")  # a deadline that never comes


class Outbox:
    """Messages queued for one peer, and the frames posted to it that may still be in flight."""

    def __init__(self) -> None:
        # `lock` guards everything but `posting`; taken as `with box.lock` (Condition's `with`
        # is a Python call, and every message sent enters it), waited on through `cond`.
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.items: List[tuple] = []  # (message, done event or None), not yet posted
        self.hold_until: Optional[float] = None  # items are held until then (see send's hold)
        self.last_deadline = -NEVER  # the latest hold_until set
        self.wakes_at = NEVER  # when the sender thread's wait ends by itself
        self.posting = threading.Lock()  # one frame at a time, in queue order (see _post)
        # Posted frames not yet known complete: (works, buffers, done events, description).
        self.posted: collections.deque = collections.deque()

