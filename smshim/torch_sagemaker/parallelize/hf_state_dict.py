"""A transformed model's full state dict in Hugging Face layout: the module tree is HF's, so the
translation is gathering every DTensor (TP or EP split) into its full tensor and dropping the
wrapper prefixes FSDP and activation checkpointing add. Collective over the TP/EP (and FSDP)
groups: call it on every rank."""

from __future__ import annotations

import warnings
from typing import Dict

import torch
from torch import nn
from torch.distributed.tensor import DTensor

_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def hf_name(name: str) -> str:
    """`name` without the parts FSDP, activation checkpointing, torch.compile (anywhere) and
    DDP / offload wrappers (a leading "module.") add."""
    for p in _WRAPPER_PARTS:
        name = name.replace(p, "")
    return name[len("module."):] if name.startswith("module.") else name


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_hf_state_dict(model: nn.Module, cpu: bool = True) -> Dict[str, torch.Tensor]:
    """Full (unsharded) state dict, HF key names. Works on the transformed model itself and on it
    wrapped by FSDP1 (FULL_STATE_DICT, gathered over the sharding group) or fully_shard."""
    from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    if any(isinstance(m, FSDP) for m in model.modules()):
        with warnings.catch_warnings():  # FSDP1's state_dict_type is deprecated, still the API
            warnings.simplefilter("ignore", FutureWarning)
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                      FullStateDictConfig(offload_to_cpu=False, rank0_only=False)):
                sd = model.state_dict()
    else:
        sd = model.state_dict()
    out = {}
    for k, v in sd.items():
        v = _full(v).detach()
        out[hf_name(k)] = v.cpu() if cpu else v
    return out
