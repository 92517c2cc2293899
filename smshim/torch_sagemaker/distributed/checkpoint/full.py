"""Whole-model checkpoints in the Hugging Face layout: what scripts export at the end.

`save_full(model, dir, hf_config)`: the FULL state dict (rank 0 only, `offload_to_cpu`, as AWS's
scripts take it) written by rank 0 as `pytorch_model.bin` with `config.json`, loadable by the plain
HF class (`from_pretrained(dir)`). `load_full(model, dir)`: every rank reads it into an FSDP model.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

WEIGHTS_NAME = "pytorch_model.bin"


def save_full(model: torch.nn.Module, directory: str, hf_config: Optional[Any] = None) -> None:
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state_dict = model.state_dict()
    if not dist.is_initialized() or dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        torch.save(state_dict, os.path.join(directory, WEIGHTS_NAME))
        if hf_config is not None:
            hf_config.save_pretrained(directory)
    if dist.is_initialized():
        dist.barrier()


def load_full(model: torch.nn.Module, directory: str) -> None:
    state_dict = torch.load(os.path.join(directory, WEIGHTS_NAME), map_location="cpu", weights_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=False, rank0_only=False)):
        model.load_state_dict(state_dict)
