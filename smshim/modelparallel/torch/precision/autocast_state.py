"""The caller's autocast state, carried to wherever its modules run.

`torch.autocast` is a thread's state. Under pipeline parallelism a module that pp_rank 0's code
calls runs on its owner, in a serving thread of another rank, and pp_rank 0's step bodies run in
worker threads; single-process training would run all of it under the caller's autocast. So the
state is captured where a call is made (and where the step is called) and applied where the
module (and the body) runs. Autocast has no effect on a backward (its ops take the forward's
dtypes), so only forwards need it.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Iterator, Optional, Tuple

import torch

# (device type, dtype, cache enabled) for each device type whose autocast is on.
State = Optional[Tuple[Tuple[str, torch.dtype, bool], ...]]

_DEVICE_TYPES = ("cpu", "cuda")


def capture() -> State:
    """The calling thread's autocast state (None when autocast is off for every device type)."""
    if not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")):
        return None  # (the usual case, at every remote call: without building a tuple)
    on = tuple((device_type, torch.get_autocast_dtype(device_type),
                torch.is_autocast_cache_enabled())
               for device_type in _DEVICE_TYPES if torch.is_autocast_enabled(device_type))
    return on or None


def applied(state: State) -> ContextManager[None]:
    """Run the block under the autocast `state` that `capture` returned (nothing for None)."""
    return _OFF if not state else _applied(state)


_OFF = contextlib.nullcontext()


@contextlib.contextmanager
def _applied(state: Tuple[Tuple[str, torch.dtype, bool], ...]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for device_type, dtype, cache_enabled in state:
            stack.enter_context(torch.autocast(device_type, dtype=dtype,
                                               cache_enabled=cache_enabled))
        yield
