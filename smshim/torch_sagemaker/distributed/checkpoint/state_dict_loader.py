"""`load` on torch DCP: checks the checkpoint against the state dict first, on every rank.

Every rank reads the checkpoint's metadata itself and compares each key and shape with what it is
loading into; a mismatch raises a ValueError naming the key and both shapes on every rank, before
any collective (DCP would otherwise fail on some ranks inside its collectives)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from smshim.torch_sagemaker.distributed.checkpoint.filesystem import DistributedFileSystemReader
from smshim.torch_sagemaker.distributed.checkpoint.group_local import restrict_to_group, write_back


def _flatten(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state_dict)
    return flat


def check_against_checkpoint(state_dict: Dict[str, Any], reader, where: str) -> None:
    metadata = reader.read_metadata()
    saved = metadata.state_dict_metadata
    for key, value in _flatten(state_dict).items():
        if not isinstance(value, torch.Tensor):
            continue
        if key not in saved:
            raise ValueError(f"checkpoint {where} has no entry {key!r} (it holds e.g. "
                             f"{sorted(saved)[:5]}): is it a checkpoint of this model?")
        md = saved[key]
        if isinstance(md, TensorStorageMetadata) and tuple(md.size) != tuple(value.size()):
            raise ValueError(f"checkpoint {where}: {key!r} has shape {tuple(md.size)} there but "
                             f"{tuple(value.size())} in the model being loaded: it is a checkpoint "
                             "of another model shape")


def _check_keys_matched(state_dict, process_group) -> None:
    keys = sorted(_flatten(state_dict))
    everyone = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(everyone, keys, group=process_group)
    ranks = sorted(dist.get_process_group_ranks(process_group or dist.group.WORLD))
    for rank, other in zip(ranks, everyone):
        if other != keys:
            diff = sorted(set(other) ^ set(keys))[:5]
            raise ValueError(f"checkpoint load: rank {rank} loads other keys than rank "
                             f"{dist.get_rank()} (e.g. {diff})")


def load(state_dict: Dict[str, Any], *, checkpoint_id=None, storage_reader=None, planner=None,
         process_group: Optional[dist.ProcessGroup] = None, check_keys_matched: bool = True,
         coordinator_rank: int = 0, s3_region: Optional[str] = None,
         s3client_config: Any = None) -> None:
    """Load the checkpoint into `state_dict` in place (resharding as the state dict asks)."""
    if storage_reader is None:
        if checkpoint_id is None:
            raise ValueError("checkpoint load: give checkpoint_id or storage_reader")
        storage_reader = DistributedFileSystemReader(checkpoint_id)
    where = str(checkpoint_id if checkpoint_id is not None else getattr(storage_reader, "path", ""))
    original, state_dict = state_dict, restrict_to_group(state_dict, process_group)
    check_against_checkpoint(state_dict, storage_reader, where)
    if check_keys_matched and dist.is_initialized():
        _check_keys_matched(state_dict, process_group)
    dcp.load(state_dict, storage_reader=storage_reader, planner=planner, process_group=process_group)
    if state_dict is not original:
        write_back(original, state_dict)
