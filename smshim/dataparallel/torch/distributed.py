"""`smdistributed.dataparallel.torch.distributed`: the smddp function API on torch.distributed.

Rank and size come from the launcher (torchrun, mpirun, `smshim run`); see smshim/runtime/launch.py.
`group` arguments take `group.WORLD` (the documented value) or a group from `new_group`.
"""

from __future__ import annotations

import enum
import logging
import sys
from typing import Any, List, Optional

import torch
import torch.distributed as _dist

from smshim.runtime import launch as _runtime

logger = logging.getLogger(__name__)

__all__ = [
    "ReduceOp", "group", "is_available", "init_process_group", "is_initialized",
    "get_world_size", "get_rank", "get_local_rank", "get_local_size", "all_reduce", "reduce",
    "broadcast", "all_gather", "all_to_all_single", "barrier", "new_group",
]


class ReduceOp(enum.Enum):
    AVERAGE = "average"
    SUM = "sum"
    MIN = "min"
    MAX = "max"


class group:  # noqa: N801  (smddp spells it this way: dist.group.WORLD)
    WORLD = "smddp.group.WORLD"


_TORCH_OPS = {
    ReduceOp.SUM: _dist.ReduceOp.SUM,
    ReduceOp.MIN: _dist.ReduceOp.MIN,
    ReduceOp.MAX: _dist.ReduceOp.MAX,
}


def _pg(g: Any) -> Optional[_dist.ProcessGroup]:
    """Our group argument as torch's: WORLD (or None) is the default group."""
    if g is None or g is group.WORLD or (isinstance(g, str) and g == group.WORLD):
        return None
    if isinstance(g, _dist.ProcessGroup):
        return g
    if g is _dist.GroupMember.NON_GROUP_MEMBER:
        # What torch's new_group() hands to ranks outside the group. torch would silently skip the
        # collective; an smddp script never expects that, so say so instead of returning garbage.
        raise ValueError(
            f"rank {_dist.get_rank()} is not a member of this group (new_group() returned "
            "GroupMember.NON_GROUP_MEMBER here): call collectives on it only from its member ranks"
        )
    raise TypeError(
        f"group={g!r} is not a process group: pass dist.group.WORLD or a group from "
        "dist.new_group()"
    )


# init_process_group() was called. Real smddp has a communicator of its own, so a script that
# imported torch_smddp may still call torch.distributed.init_process_group(backend="smddp") after
# this API's init: then we do not claim torch's default group at once; torch's call creates it
# (and it serves this API too), or else the first collective here does (every rank makes it).
# Without torch_smddp, init brings the default group up at once, so torch.distributed works too.
_joined = False


def _require_init(fn: str) -> None:
    if _dist.is_initialized():
        return
    if not _joined:
        raise RuntimeError(
            f"smdistributed.dataparallel: {fn}() called before init_process_group() "
            f"(rank {_runtime.detect_launch().rank})"
        )
    _runtime.init_distributed()


def _op(op: Any) -> ReduceOp:
    if isinstance(op, ReduceOp):
        return op
    if op == _dist.ReduceOp.AVG:  # accepted for drop-in ease (real smddp rejects it)
        return ReduceOp.AVERAGE
    for ours, theirs in _TORCH_OPS.items():
        if op == theirs:
            return ours
    raise ValueError(f"op={op!r} is not supported: use ReduceOp.SUM, AVERAGE, MIN or MAX")


class _AveragingWork:
    """A work handle whose completion also divides the summed result by the group size.

    gloo has no AVG, so AVERAGE is a SUM whose division must happen once the data is there: on
    wait(), on the first is_completed() that sees it done, or in the future's continuation.
    """

    def __init__(self, work: Any, tensor: torch.Tensor, n: int) -> None:
        self._work, self._tensor, self._n, self._done = work, tensor, n, False

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            _divide(self._tensor, self._n)

    def wait(self, timeout: Any = None) -> bool:
        if timeout is None:
            self._work.wait()
        else:
            self._work.wait(timeout)
        self._finish()
        return True

    def is_completed(self) -> bool:
        if not self._done and self._work.is_completed():
            self._finish()
        return self._done

    def is_success(self) -> bool:
        return self._work.is_success() if hasattr(self._work, "is_success") else True

    def exception(self):
        return self._work.exception() if hasattr(self._work, "exception") else None

    def result(self) -> List[torch.Tensor]:
        self.wait()
        return [self._tensor]

    def get_future(self) -> torch.futures.Future:
        """A future that completes with the averaged tensor (as torch's Work.get_future())."""

        def _averaged(fut: torch.futures.Future) -> List[torch.Tensor]:
            fut.value()  # re-raise a failed collective
            self._finish()
            return [self._tensor]

        return self._work.get_future().then(_averaged)


def _divide(tensor: torch.Tensor, n: int) -> None:
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.div_(n)
    else:
        tensor.floor_divide_(n)


def is_available() -> bool:
    """True when this process was started as part of a distributed job."""
    return _dist.is_available() and _runtime.detect_launch().launcher != "single"


def init_process_group(*args: Any, **kwargs: Any) -> None:
    """Join the job; arguments are accepted and ignored, as in smddp. Rank and size come from
    the launcher; the environment is checked now, on every rank (see `_joined`)."""
    global _joined
    if _joined or _dist.is_initialized():
        logger.info("init_process_group: already initialised")
    _runtime.detect_launch()
    _joined = True
    if "smshim.dataparallel.torch.torch_smddp" not in sys.modules:
        _runtime.init_distributed()


def is_initialized() -> bool:
    return _joined or _dist.is_initialized()


def _world_or_group(fn: str, g: Any) -> Optional[_dist.ProcessGroup]:
    """None when the question is about WORLD and no group is needed to answer it."""
    if not _dist.is_initialized() and _joined and (g is None or g is group.WORLD):
        return None
    _require_init(fn)
    return _pg(g)


def get_world_size(group: Any = group.WORLD) -> int:
    pg = _world_or_group("get_world_size", group)
    if pg is None and not _dist.is_initialized():
        return _runtime.detect_launch().world_size  # no collective just to ask
    return _dist.get_world_size(pg)


def get_rank(group: Any = group.WORLD) -> int:
    pg = _world_or_group("get_rank", group)
    if pg is None and not _dist.is_initialized():
        return _runtime.detect_launch().rank
    return _dist.get_rank(pg)


def get_local_rank() -> int:
    return _runtime.detect_launch().local_rank


def get_local_size() -> int:
    return _runtime.detect_launch().local_size


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = group.WORLD,
               async_op: bool = False):
    _require_init("all_reduce")
    pg, op = _pg(group), _op(op)
    if op is not ReduceOp.AVERAGE:
        return _dist.all_reduce(tensor, _TORCH_OPS[op], group=pg, async_op=async_op)
    if tensor.is_cuda and _dist.get_backend(pg) in ("nccl", "smddp"):  # NCCL has AVG
        return _dist.all_reduce(tensor, _dist.ReduceOp.AVG, group=pg, async_op=async_op)
    # gloo has no AVG: sum, then divide (after the wait when asynchronous).
    n = _dist.get_world_size(pg)
    work = _dist.all_reduce(tensor, _dist.ReduceOp.SUM, group=pg, async_op=async_op)
    if async_op:
        return _AveragingWork(work, tensor, n)
    _divide(tensor, n)
    return None


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = group.WORLD,
           async_op: bool = False):
    """Reduce onto global rank `dst` (in place there); AVERAGE divides on `dst` only."""
    _require_init("reduce")
    pg, op = _pg(group), _op(op)
    if op is not ReduceOp.AVERAGE:
        return _dist.reduce(tensor, dst, _TORCH_OPS[op], group=pg, async_op=async_op)
    work = _dist.reduce(tensor, dst, _dist.ReduceOp.SUM, group=pg, async_op=async_op)
    n = _dist.get_world_size(pg)
    if _dist.get_rank() != dst:
        return work
    if async_op:
        return _AveragingWork(work, tensor, n)
    _divide(tensor, n)
    return None


def broadcast(tensor: torch.Tensor, src: int = 0, group: Any = group.WORLD, async_op: bool = False):
    _require_init("broadcast")
    return _dist.broadcast(tensor, src, group=_pg(group), async_op=async_op)


def all_gather(tensor_list: List[torch.Tensor], tensor: torch.Tensor, group: Any = group.WORLD,
               async_op: bool = False):
    _require_init("all_gather")
    return _dist.all_gather(tensor_list, tensor, group=_pg(group), async_op=async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                      input_split_sizes=None, group: Any = group.WORLD, async_op: bool = False):
    _require_init("all_to_all_single")
    return _dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                   group=_pg(group), async_op=async_op)


def barrier(group: Any = group.WORLD, async_op: bool = False):
    _require_init("barrier")
    return _dist.barrier(group=_pg(group), async_op=async_op)


def new_group(ranks: Optional[List[int]] = None, **kwargs: Any):
    _require_init("new_group")
    kwargs.setdefault("timeout", _runtime.timeout())
    return _dist.new_group(ranks, **kwargs)
