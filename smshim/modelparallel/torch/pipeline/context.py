"""The engine's per-thread context: which step and microbatch a thread works for, and what it is
(a step body on pp_rank 0, a served request, tracing). Read by the model, tensor parallelism
and activation checkpointing, written by the pipeline and the server."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator


class _Context(threading.local):
    step: int = -1
    microbatch: int = -1
    in_step: bool = False
    tracing: bool = False
    forward_done: bool = False  # this microbatch's body reached model.backward
    driver: bool = False  # a pp_rank 0 worker running the step body (not a served request)
    in_backward: bool = False  # (a driver) inside its model.backward
    # How many tensor-parallel modules' forwards this thread is inside (the outermost gathers the
    # TP ranks' batches: tensor_parallel/collectives.py, `region`).
    tp_region_depth: int = 0


ctx = _Context()


@contextlib.contextmanager
def at_tp_region_depth(depth: int) -> Iterator[None]:
    """Run as if inside `depth` tensor-parallel modules' forwards: activation checkpointing's
    recomputation of a module that ran nested (no batch gathering of its own) runs in backward,
    outside any region, and must not gather the batch there either."""
    saved = ctx.tp_region_depth
    ctx.tp_region_depth = depth
    try:
        yield
    finally:
        ctx.tp_region_depth = saved


# .here: this thread may take the run queue's role (it dispatches a frame, or serves a request)
_serving = threading.local()
