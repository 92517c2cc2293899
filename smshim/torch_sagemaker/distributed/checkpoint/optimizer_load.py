"""`load_sharded_optimizer_state_dict(..., process_group=)`, as SMP's scripts call it.

torch's version (torch.distributed.checkpoint.optimizer) takes no process group: for FSDP's 1-D
sharded state dicts it chunks every optimizer tensor over the whole world. Under hybrid sharding a
rank holds 1/hybrid_shard_degree of each tensor, chunked over its sharding group, so replica ranks
read the wrong slices (a resumed run diverged at its first step). This version chunks over
`process_group` (the sharding group, `model.process_group`) and reads with it, whole for the
parameters FSDP does not shard (DTensors in the model's state dict: experts kept out of FSDP);
without a group, or with the world's, or for 2-D (TP) layouts, it is torch's own. `tsm.init` puts it in place of
torch's module attribute, so `from torch.distributed.checkpoint.optimizer import
load_sharded_optimizer_state_dict` done after `tsm.init` (or after `import torch.sagemaker` with
init following) gets it; a name imported before that stays torch's.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import optimizer as _upstream
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.tensor import DTensor

_originals: Dict[str, Any] = {}


def _is_world(group) -> bool:
    return group is None or dist.get_world_size(group) == dist.get_world_size()


def load_sharded_optimizer_state_dict(model_state_dict, optimizer_key: str, storage_reader,
                                      planner=None, process_group: Optional[dist.ProcessGroup] = None):
    upstream = _originals.get("load_sharded_optimizer_state_dict", _upstream.load_sharded_optimizer_state_dict)
    _, dp_pg = _upstream._get_state_dict_2d_layout(model_state_dict)
    if _is_world(process_group) or dp_pg is not None:
        return upstream(model_state_dict, optimizer_key, storage_reader, planner)
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
    from torch.distributed.fsdp._shard_utils import _create_chunk_sharded_tensor

    device_type = dist.distributed_c10d._get_pg_default_device(process_group).type
    devices = torch.cuda.device_count() if device_type == "cuda" else 1
    metadata = storage_reader.read_metadata()
    state_dict: Dict[str, Any] = {}
    for key, value in metadata.state_dict_metadata.items():
        if metadata.planner_data[key][0] != optimizer_key:
            continue
        if isinstance(value, BytesStorageMetadata):
            state_dict[key] = "<bytes_io>"
            continue
        tensor = _upstream._alloc_tensor(value.properties, value.size, device_type)
        path = metadata.planner_data[key]
        kept_out = len(path) > 2 and isinstance(model_state_dict.get(path[2]), DTensor)
        if value.size.numel() == 1 or kept_out:
            # (a DTensor in a 1-D FSDP state dict: a parameter FSDP does not shard, such as an
            # expert kept out of FSDP; every rank of the group holds all of what it saved)
            state_dict[key] = tensor
        else:
            state_dict[key] = _create_chunk_sharded_tensor(
                tensor, rank=dist.get_rank(process_group), world_size=dist.get_world_size(process_group),
                num_devices_per_node=devices, pg=process_group)
    dcp.load(state_dict, storage_reader=storage_reader, planner=planner, process_group=process_group)
    return unflatten_state_dict(state_dict, metadata.planner_data)


def install() -> None:
    if not _originals:
        _originals["load_sharded_optimizer_state_dict"] = _upstream.load_sharded_optimizer_state_dict
        _upstream.load_sharded_optimizer_state_dict = load_sharded_optimizer_state_dict


def uninstall() -> None:
    if _originals:
        _upstream.load_sharded_optimizer_state_dict = _originals.pop("load_sharded_optimizer_state_dict")
