"""`save` and `async_save` on torch DCP, with SMP's arguments.

`coordinator_rank` is a global rank; DCP coordinates through rank 0 of `process_group`, which is
the smallest rank of the group, so the two agree whenever scripts pass min(group) (they do). An
asynchronous save runs DCP's collectives in a background thread: it uses the gloo twin with the
same ranks that `tsm.init` made (`state.background_groups`: every group of the layout, its
replication groups and the world), so they never interleave with the training's collectives on
the script's group. For any other group the save is written synchronously (with a warning):
creating a twin then would need every rank of the world, and only the saving ranks are here.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any, Dict, List, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from smshim.torch_sagemaker.distributed.checkpoint.async_utils import AsyncCallsQueue
from smshim.torch_sagemaker.distributed.checkpoint.filesystem import DistributedFileSystemWriter
from smshim.torch_sagemaker.distributed.checkpoint.group_local import restrict_to_group

logger = logging.getLogger(__name__)

_default_queue = AsyncCallsQueue()


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
    state_dict = restrict_to_group(state_dict, process_group)  # TP DTensors: this TP rank's part
    dcp.save(state_dict, storage_writer=_writer(checkpoint_id, storage_writer), planner=planner,
             process_group=process_group)


def _background_group(process_group) -> Optional[dist.ProcessGroup]:
    from smshim.torch_sagemaker.state_handler import state

    return state.background_groups.get(tuple(_ranks(process_group)))


def async_save(state_dict: Dict[str, Any], *, checkpoint_id=None, storage_writer=None, planner=None,
               process_group: Optional[dist.ProcessGroup] = None, coordinator_rank: int = 0,
               queue: Optional[AsyncCallsQueue] = None, sharded_strategy: Any = None,
               wait_error_handling: bool = True, force_check_all_plans: bool = True,
               s3_region: Optional[str] = None, s3client_config: Any = None) -> None:
    """Copy `state_dict` to CPU memory now and write it in the background; finish it with
    `maybe_finalize_async_calls` (or the queue's) before the next save and at exit."""
    _check_coordinator(process_group, coordinator_rank)
    writer = _writer(checkpoint_id, storage_writer)
    state_dict = restrict_to_group(state_dict, process_group)  # TP DTensors: this TP rank's part
    background = _background_group(process_group)
    if background is None:
        logger.warning("async_save over ranks %s: no background twin of this group (tsm.init makes "
                       "them for its layout's groups); writing synchronously", _ranks(process_group))
        dcp.save(state_dict, storage_writer=writer, planner=planner, process_group=process_group)
        future: Future = Future()
        future.set_result(None)
    else:
        future = dcp.async_save(state_dict, storage_writer=writer, planner=planner,
                                process_group=background)
    (queue or _default_queue).schedule(future)


def maybe_finalize_async_calls(blocking: bool = True,
                               process_group: Optional[dist.ProcessGroup] = None) -> List[int]:
    """Finish the default queue's saves (see AsyncCallsQueue.maybe_finalize_async_calls)."""
    return _default_queue.maybe_finalize_async_calls(blocking=blocking, process_group=process_group)
