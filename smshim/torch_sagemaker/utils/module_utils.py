"""Materialising a module's own tensors (used by delayed parameter initialisation)."""

from __future__ import annotations

from typing import Union

import torch

Device = Union[str, torch.device, None]


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def empty_module_params(module: torch.nn.Module, device: Device = None,
                        recurse: bool = False) -> torch.nn.Module:
    """Give the module's parameters (its own, or all with `recurse`) uninitialised storage on
    `device` (default: this process's device), keeping them the same Parameter objects' names."""
    device = torch.device(device) if device is not None else default_device()
    return module.to_empty(device=device, recurse=recurse)


def move_buffers_to_device(module: torch.nn.Module, device: Device = None,
                           recurse: bool = False) -> torch.nn.Module:
    """Move the module's buffers to `device`; buffers still on meta get uninitialised storage."""
    device = torch.device(device) if device is not None else default_device()
    modules = module.modules() if recurse else [module]
    for m in modules:
        for name, buf in list(m._buffers.items()):
            if buf is None:
                continue
            m._buffers[name] = torch.empty_like(buf, device=device) if buf.is_meta else buf.to(device)
    return module


def has_meta(module: torch.nn.Module, recurse: bool = False) -> bool:
    tensors = list(module.parameters(recurse=recurse)) + list(module.buffers(recurse=recurse))
    return any(t.is_meta for t in tensors)


__all__ = ["empty_module_params", "move_buffers_to_device", "default_device", "has_meta"]
