"""The base of the tensor-parallel modules: parameters that hold this rank's shard of a full
tensor, a state-dict load hook that takes a full tensor's shard, and the outermost-module batch
gathering of `prescaled_batch: false`.

Every distributed module computes exactly what its unsplit counterpart computes on its inputs. Its
`state_dict()` holds shards (the local form; `DistributedModel.state_dict()` gathers them into the
unsplit module's tensors); its `load_state_dict()` accepts either a shard or the full tensor, of
which it keeps this rank's slice, so a plain module's state dict loads directly.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import nn

from smshim.modelparallel.torch.tensor_parallel import collectives as tp_comm
from smshim.modelparallel.torch.tensor_parallel import shard as tp_shard
from smshim.modelparallel.torch.state import state

__all__ = ["DistributedModule", "tp_rank_size"]


def tp_rank_size() -> "tuple[int, int]":
    """(tp_rank, tp_size); (0, 1) before smp.init (the modules then act unsplit)."""
    return tp_comm.tp_world()


class DistributedModule(nn.Module):
    """Base of the `smp.nn` tensor-parallel modules."""

    def __init__(self) -> None:
        super().__init__()
        self._register_load_state_dict_pre_hook(_take_shards, with_module=True)

    def _sharded(self, full: torch.Tensor, dim: Optional[int], chunks: int = 1) -> nn.Parameter:
        """A Parameter holding this rank's shard of `full` (dim None: replicated)."""
        rank, size = tp_rank_size()
        split = tp_shard.TPSplit(dim, chunks)
        p = nn.Parameter(tp_shard.shard(full.detach(), split, rank, size).clone())
        return tp_shard.mark(p, dim, chunks)  # type: ignore[return-value]

    def _forward_region(self, fn: Callable[..., Any], *tensors: Optional[torch.Tensor]) -> Any:
        """Run `fn(*tensors)`; the outermost distributed module gathers the TP ranks' batches
        first (prescaled_batch false) and returns this rank's rows of `fn`'s tensor result."""
        with tp_comm.region() as outer:
            if not (outer and state.initialized):
                return fn(*tensors)
            out = fn(*(tp_comm.batch_in(t) for t in tensors))
            if isinstance(out, tuple):
                return tuple(tp_comm.batch_out(o) if isinstance(o, torch.Tensor) else o
                             for o in out)
            return tp_comm.batch_out(out)


def _take_shards(module: nn.Module, sd: dict, prefix: str, *args: Any) -> None:
    """Load hook: a full tensor given for a sharded parameter is replaced by this rank's slice."""
    rank, size = tp_rank_size()
    if size == 1:
        return
    for name, p in module.named_parameters(recurse=False):
        split = tp_shard.split_of(p)
        key = prefix + name
        if split is None or split.dim is None or key not in sd:
            continue
        value = sd[key]
        full_shape = list(p.shape)
        full_shape[split.dim] *= size
        if isinstance(value, torch.Tensor) and list(value.shape) == full_shape:
            sd[key] = tp_shard.shard(value, split, rank, size)


def linear_init(out_features: int, in_features: int, bias: bool, normal: bool = False,
                std: float = 0.02) -> "tuple[torch.Tensor, Optional[torch.Tensor]]":
    """Full weight and bias initialised as nn.Linear does (same RNG draws, so the same values
    for the same seed), or N(0, std) weights and zero bias with `normal`."""
    w = torch.empty(out_features, in_features)
    b = torch.empty(out_features) if bias else None
    if normal:
        nn.init.normal_(w, 0.0, std)
        if b is not None:
            nn.init.zeros_(b)
        return w, b
    nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    if b is not None:
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
        nn.init.uniform_(b, -bound, bound)
    return w, b
