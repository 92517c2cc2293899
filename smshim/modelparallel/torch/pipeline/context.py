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


class _Serving(threading.local):
    """What a thread of the module server is doing (serving.py)."""

    here: bool = False  # it may take the run queue's role (it dispatches a frame, or serves)
    chains: bool = False  # it serves requests (`_serve`) and may chain the next one
    next = None  # the request `_serve` runs next (`_chain` took it)
    kept = None  # the chain holds the compute lock: how its end counts as done
    # While a served request delivers its results: the (direction, microbatch) of the request
    # a result may make ready to run next, and that request, once it has (`_ready`, `_chain`).
    chain_key = None
    candidate = None


_serving = _Serving()
