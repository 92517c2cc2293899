"""The engine's per-thread context: which step and microbatch a thread works for, and what it is
(a step body on pp_rank 0, a served request, tracing). Read by the model, tensor parallelism
and activation checkpointing, written by the pipeline and the server."""

from __future__ import annotations

import threading


class _Context(threading.local):
    step: int = -1
    microbatch: int = -1
    in_step: bool = False
    tracing: bool = False
    forward_done: bool = False  # this microbatch's body reached model.backward
    driver: bool = False  # a pp_rank 0 worker running the step body (not a served request)


ctx = _Context()


# .here: this thread may take the run queue's role (it dispatches a frame, or serves a request)
_serving = threading.local()
