"""Unsharded FSDP1 around a `tsm.transform`'ed (TP) model: NO_SHARD, or a sharding group of one
rank (hybrid_shard_degree 1, or TP over every rank, e.g. TP2 on 2 processes).

There FSDP1 registers the original parameters as `nn.Parameter` views of the flat parameter after
every forward. For a DTensor (a TP shard) it cannot set `param.data`, so it registers a new
parameter each time: the optimizer, built on the first, would step parameters the model no longer
uses, an outer FSDP unit would flatten them again, and FSDP's checks compare them with the plain
local parameters it keeps (`flat_param._params`). The patches of `FlatParamHandle` below keep one
DTensor parameter per TP tensor (`_TP_PARAMS`), whose local tensor is the plain parameter's view of
the flat parameter and whose gradient wraps the plain one's; `optim_state_dict_to_load` hands
back the optimizer state of those parameters as DTensors like them. Sharded strategies never
reach the parameter patches: their parameters are flat views, not DTensors. (The optimizer-state
conversion also serves the experts expert parallelism keeps out of FSDP.)
"""

from __future__ import annotations

from typing import Any, Dict

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp._common_utils import _set_fsdp_flattened
from torch.distributed.fsdp._flat_param import FlatParamHandle
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


_TP_PARAMS = "_smshim_tp_params"  # on a FlatParamHandle: {index in the flat parameter: DTensor}
_originals: Dict[str, Any] = {}
_HANDLE_METHODS = ("_use_unsharded_views", "_writeback_orig_params", "_use_sharded_grad_views")


def dtensor_like(param: DTensor, local: torch.Tensor) -> DTensor:
    """`local` as this rank's part of a DTensor laid out like `param` (no communication)."""
    return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride(), run_check=False)


def _tp_params(handle) -> Dict[int, Any]:
    return handle.__dict__.setdefault(_TP_PARAMS, {})


def _patched_use_unsharded_views(self, as_params: bool) -> None:
    """After FSDP registered its views as parameters: a TP tensor's is the DTensor registered
    the first time, now viewing the flat parameter as FSDP's new one does."""
    _originals["_use_unsharded_views"](self, as_params)
    if not (as_params and self._use_orig_params) or self.uses_sharded_strategy:
        return

    flat_param, kept = self.flat_param, _tp_params(self)
    for i, (name, module, _) in enumerate(flat_param._param_infos):
        new = getattr(module, name)
        if type(new) is not DTensor:
            continue
        local = new._local_tensor.detach()
        flat_param._params[i].data = local  # (what FSDP does for a plain parameter)
        if i not in kept:
            _set_fsdp_flattened(new)  # (else an outer FSDP unit would flatten it again)
            kept[i] = new
        elif kept[i] is not new:
            kept[i]._local_tensor = local
            self._setattr_param(module, name, kept[i])
    for name, module, _, prim_name, prim_module, _ in flat_param._shared_param_infos:
        self._setattr_param(module, name, getattr(prim_module, prim_name))


def _patched_writeback_orig_params(self) -> bool:
    """FSDP's check that the original parameters still view the flat parameter, run on the
    plain parameters it knows, with the gradients the optimizer's DTensors hold (None after
    `zero_grad`)."""
    kept = _tp_params(self)
    swapped = []
    for i, param in kept.items():
        name, module, _ = self.flat_param._param_infos[i]
        plain = self.flat_param._params[i]
        plain.grad = None if param.grad is None else param.grad._local_tensor
        if getattr(module, name) is param:
            module._parameters[name] = plain
            swapped.append((module, name, param))
    try:
        return _originals["_writeback_orig_params"](self)
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param


def _patched_use_sharded_grad_views(self) -> None:
    """After the backward: the DTensor parameters' gradients wrap the plain ones FSDP set."""
    _originals["_use_sharded_grad_views"](self)
    for i, param in _tp_params(self).items():
        grad = self.flat_param._params[i].grad
        param.grad = None if grad is None else dtensor_like(param, grad)


def _patched_optim_state_dict_to_load(model, optim, optim_state_dict, is_named_optimizer=False,
                                      load_directly=False, group=None):
    """For a DTensor parameter FSDP1 does not flatten (a TP shard under unsharded FSDP; an expert
    kept out of FSDP), `optim_state_dict_to_load` hands back its optimizer state as a plain
    tensor: the whole (a FULL or world-saved state dict) or this rank's slice (DCP's sharded
    optimizer loader). The optimizer steps DTensors: each becomes a DTensor like its parameter,
    holding this rank's slice (cut locally: no communication)."""
    converted = _originals["optim_state_dict_to_load"](
        model, optim, optim_state_dict, is_named_optimizer=is_named_optimizer,
        load_directly=False, group=group)
    params = [p for g in optim.param_groups for p in g["params"]]
    for key, values in converted.get("state", {}).items():
        param = params[key] if isinstance(key, int) and key < len(params) else None
        if not isinstance(param, DTensor):
            continue
        shape, offset = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements)
        for name, value in values.items():
            if type(value) is not torch.Tensor or not value.dim():
                continue
            if value.shape == param.shape:  # the whole tensor: this rank's slice of it
                value = value[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
            elif value.shape != torch.Size(shape):
                continue
            values[name] = dtensor_like(param, value.contiguous())
    if load_directly:
        optim.load_state_dict(converted)
    return converted


def install() -> None:
    if _originals:
        return
    for name in _HANDLE_METHODS:
        _originals[name] = getattr(FlatParamHandle, name)
        setattr(FlatParamHandle, name, globals()[f"_patched{name}"])
    _originals["optim_state_dict_to_load"] = FSDP.optim_state_dict_to_load
    FSDP.optim_state_dict_to_load = staticmethod(_patched_optim_state_dict_to_load)


def uninstall() -> None:
    if not _originals:
        return
    for name in _HANDLE_METHODS:
        setattr(FlatParamHandle, name, _originals.pop(name))
    FSDP.optim_state_dict_to_load = staticmethod(_originals.pop("optim_state_dict_to_load"))
