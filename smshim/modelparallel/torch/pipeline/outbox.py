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
        # `lock` guards everything but `posting`.
        self.lock = threading.RLock()
        self.items: List[tuple] = []  # (message, done event or None), not yet posted
        # Items are held until then (see send's hold; sender.py posts them then).
        self.hold_until: Optional[float] = None
        self.posting = threading.Lock()  # one frame at a time, in queue order (see _post)
        # Posted frames not yet known complete: (works, buffers, done events, description).
        self.posted: collections.deque = collections.deque()

