"""`timeit`: log how long a block took (scripts wrap model creation and the FSDP call)."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Optional

logger = logging.getLogger("torch.sagemaker")


@contextlib.contextmanager
def timeit(enabled: bool = True, name: str = "", rank: Optional[int] = None):
    start = time.perf_counter()
    try:
        yield
    finally:
        if enabled:
            where = f"[rank {rank}] " if rank is not None else ""
            logger.info("%s%s took %.3f s", where, name, time.perf_counter() - start)
