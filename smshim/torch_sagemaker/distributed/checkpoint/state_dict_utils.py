"""`sm_state_dict_type` / `SMStateDictType.SM_LOCAL_STATE_DICT`, and `init_optim_state`.

SM_LOCAL_STATE_DICT is each rank's own FSDP shards as plain tensors (`<unit>._flat_param`, padding
included) plus the model's persistent buffers: no collective at all, unlike FSDP's
LOCAL_STATE_DICT, whose ShardedTensors exchange metadata. It restores only at the same
hybrid_shard_degree and FSDP wrapping (the replica count may change).
"""

from __future__ import annotations

import contextlib
import enum
from typing import Any, Dict, Iterator, List, Tuple

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType


class SMStateDictType(enum.Enum):
    SM_LOCAL_STATE_DICT = "sm_local_state_dict"


def _flat_params(model: torch.nn.Module) -> List[Tuple[str, torch.Tensor]]:
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for unit in FSDP.fsdp_modules(model):
        handle = unit._handle
        if handle is None:
            continue
        prefix = names[id(unit)]
        out.append((f"{prefix}._flat_param" if prefix else "_flat_param", handle.flat_param))
    return out


def _persistent_buffers(model: torch.nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    for mname, m in model.named_modules():
        for bname, b in m._buffers.items():
            if b is not None and bname not in m._non_persistent_buffers_set:
                yield (f"{mname}.{bname}" if mname else bname), b


def local_state_dict(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    sd = {k: p.detach() for k, p in _flat_params(model)}
    sd.update({k: b.detach() for k, b in _persistent_buffers(model)})
    return sd


def load_local_state_dict(model: torch.nn.Module, state_dict: Dict[str, Any], strict: bool = True):
    own = dict(_flat_params(model))
    own.update(dict(_persistent_buffers(model)))
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    if strict and (missing or unexpected):
        raise ValueError(f"SM_LOCAL_STATE_DICT: missing {missing[:5]}, unexpected {unexpected[:5]}: "
                         "saved at another hybrid_shard_degree or wrapping?")
    with torch.no_grad():
        for key, tensor in own.items():
            if key in state_dict:
                src = state_dict[key]
                if tuple(src.shape) != tuple(tensor.shape):
                    raise ValueError(f"SM_LOCAL_STATE_DICT: {key!r} is {tuple(src.shape)} in the "
                                     f"checkpoint but {tuple(tensor.shape)} here (another "
                                     "hybrid_shard_degree or model?)")
                tensor.copy_(src)
    return missing, unexpected


@contextlib.contextmanager
def sm_state_dict_type(model: torch.nn.Module, state_dict_type, state_dict_config=None,
                       optim_state_dict_config=None):
    """Like `FSDP.state_dict_type`; also takes SMStateDictType.SM_LOCAL_STATE_DICT, under which
    `model.state_dict()` / `model.load_state_dict()` use each rank's own shards."""
    if isinstance(state_dict_type, StateDictType):
        with FSDP.state_dict_type(model, state_dict_type, state_dict_config, optim_state_dict_config):
            yield
        return
    if state_dict_type is not SMStateDictType.SM_LOCAL_STATE_DICT:
        raise ValueError(f"sm_state_dict_type: unknown state dict type {state_dict_type!r}")
    model.state_dict = lambda *a, **k: local_state_dict(model)
    model.load_state_dict = lambda sd, strict=True, **k: load_local_state_dict(model, sd, strict)
    try:
        yield
    finally:
        del model.state_dict, model.load_state_dict


def init_optim_state(optimizer: torch.optim.Optimizer, skip_empty_param: bool = True) -> None:
    """Create the optimizer's state (one step on zero gradients at learning rate 0, so no
    parameter moves), giving a loaded optimizer state something to load into."""
    saved_lr = [g.get("lr") for g in optimizer.param_groups]
    grads = {}
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            if skip_empty_param and p.numel() == 0:
                continue
            grads[p] = p.grad
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lr):
            group["lr"] = lr
        for p, g in grads.items():
            p.grad = g
