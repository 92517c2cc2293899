"""`save` and `async_save` on torch DCP, with SMP's arguments.

`coordinator_rank` is a global rank; DCP coordinates through rank 0 of `process_group`, which is
the smallest rank of the group, so the two agree whenever scripts pass min(group) (they do). An
asynchronous save runs DCP's collectives in a background thread: it gets its own gloo group (same
ranks), so they never interleave with the training's collectives on the script's group.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from smshim.torch_sagemaker.distributed.checkpoint.async_utils import AsyncCallsQueue
from smshim.torch_sagemaker.distributed.checkpoint.filesystem import DistributedFileSystemWriter

logger = logging.getLogger(__name__)

_default_queue = AsyncCallsQueue()
_background_groups: Dict[Tuple[int, ...], dist.ProcessGroup] = {}


def _ranks(process_group: Optional[dist.ProcessGroup]) -> List[int]:
    return sorted(dist.get_process_group_ranks(process_group or dist.group.WORLD))


def _check_coordinator(process_group, coordinator_rank: int) -> None:
    if not dist.is_initialized():
        return
    ranks = _ranks(process_group)
    if coordinator_rank not in ranks:
        raise ValueError(f"checkpoint: coordinator_rank={coordinator_rank} is not in the process "
                         f"group {ranks}; pass min(get_global_ranks(group))")
    if coordinator_rank != ranks[0]:
        logger.warning("checkpoint: coordinator_rank=%d; DCP coordinates through the group's "
                       "smallest rank %d", coordinator_rank, ranks[0])


def _writer(checkpoint_id, storage_writer):
    if storage_writer is not None:
        return storage_writer
    if checkpoint_id is None:
        raise ValueError("checkpoint save: give checkpoint_id or storage_writer")
    if str(checkpoint_id).startswith("s3://"):
        raise NotImplementedError(f"checkpoint_id={checkpoint_id!r}: smshim writes checkpoints to "
                                  "a file system only; save locally and upload")
    return DistributedFileSystemWriter(checkpoint_id)


def save(state_dict: Dict[str, Any], *, checkpoint_id=None, storage_writer=None, planner=None,
         process_group: Optional[dist.ProcessGroup] = None, coordinator_rank: int = 0,
         wait_error_handling: bool = True, force_check_all_plans: bool = True,
         s3_region: Optional[str] = None, s3client_config: Any = None) -> None:
    """Save `state_dict` (sharded tensors included) collectively over `process_group`."""
    _check_coordinator(process_group, coordinator_rank)
    dcp.save(state_dict, storage_writer=_writer(checkpoint_id, storage_writer), planner=planner,
             process_group=process_group)


def _background_group(process_group) -> dist.ProcessGroup:
    ranks = tuple(_ranks(process_group))
    group = _background_groups.get(ranks)
    if group is None:
        group = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
        _background_groups[ranks] = group
    return group


def async_save(state_dict: Dict[str, Any], *, checkpoint_id=None, storage_writer=None, planner=None,
               process_group: Optional[dist.ProcessGroup] = None, coordinator_rank: int = 0,
               queue: Optional[AsyncCallsQueue] = None, sharded_strategy: Any = None,
               wait_error_handling: bool = True, force_check_all_plans: bool = True,
               s3_region: Optional[str] = None, s3client_config: Any = None) -> None:
    """Copy `state_dict` to CPU memory now and write it in the background; finish it with
    `maybe_finalize_async_calls` (or the queue's) before the next save and at exit."""
    _check_coordinator(process_group, coordinator_rank)
    writer = _writer(checkpoint_id, storage_writer)
    future = dcp.async_save(state_dict, storage_writer=writer, planner=planner,
                            process_group=_background_group(process_group))
    (queue or _default_queue).schedule(future)


def maybe_finalize_async_calls(blocking: bool = True,
                               process_group: Optional[dist.ProcessGroup] = None) -> List[int]:
    """Finish the default queue's saves (see AsyncCallsQueue.maybe_finalize_async_calls)."""
    return _default_queue.maybe_finalize_async_calls(blocking=blocking, process_group=process_group)
