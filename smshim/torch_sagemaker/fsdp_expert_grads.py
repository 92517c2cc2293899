"""Expert gradients under FSDP when more ranks than the EP group hold the same experts.

The patched FSDP keeps the experts out of FSDP (`ignored_modules`, fsdp_patch.py): each EP rank
holds E/ep experts whose gradients arrive averaged over its EP group's tokens (scaled by 1/ep in
the backward, parallelize/moe/expert_parallel.py). But the EP group is not every rank that holds
those experts: with world > ep, the ranks of the other shard positions (a sharding group larger
than the EP group) and of the other replicas hold them too, each with its own tokens, while
FSDP averages the other parameters over every data-parallel rank. Here, at the end of each
backward that synchronises gradients (FSDP's post-backward final callback, which runs once on
every rank), the root averages its experts' gradients over the ranks holding the same experts
(`tsm.state.mesh["dp"]`), as one all-reduce of one flat buffer. An expert parameter that got no
gradient on a rank (no token reached its experts) joins with zeros: every rank takes part in the
same collective, and in one process the stacked expert weight gets a gradient whenever any
expert is used.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch.distributed.fsdp import _runtime_utils
from torch.distributed.tensor import DTensor

from smshim.torch_sagemaker.fsdp_unsharded_tp import dtensor_like

_EXPERTS = "_smshim_expert_grads"  # on the root FSDP module: (parameters, group, its size)
_originals: Dict[str, Any] = {}


def average_over(root: torch.nn.Module, params: List[torch.nn.Parameter],
                 group: dist.ProcessGroup) -> None:
    """Have FSDP root `root` average the gradients of `params` (DTensors, kept out of FSDP) over
    `group` after every backward that synchronises gradients."""
    setattr(root, _EXPERTS, (list(params), group, dist.get_world_size(group)))


def _average(params: List[torch.nn.Parameter], group: dist.ProcessGroup, n: int) -> None:
    locals_ = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    grads = [None if p.grad is None else
             (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad) for p in params]
    flat = torch.cat([(g if g is not None else torch.zeros_like(t)).reshape(-1)
                      for g, t in zip(grads, locals_)])
    flat.div_(n)
    dist.all_reduce(flat, group=group)
    offset = 0
    for p, g, t in zip(params, grads, locals_):
        piece = flat[offset:offset + t.numel()].view_as(t)
        offset += t.numel()
        if g is not None:
            g.copy_(piece)
        elif isinstance(p, DTensor):
            p.grad = dtensor_like(p, piece.clone())
        else:
            p.grad = piece.clone()


def _patched_final_callback(state, module) -> None:
    _originals["_post_backward_final_callback"](state, module)
    spec = getattr(state, _EXPERTS, None)
    if spec is not None and state._sync_gradients:
        with torch.no_grad():
            _average(*spec)


def install() -> None:
    if _originals:
        return
    _originals["_post_backward_final_callback"] = _runtime_utils._post_backward_final_callback
    _runtime_utils._post_backward_final_callback = _patched_final_callback


def uninstall() -> None:
    if not _originals:
        return
    _runtime_utils._post_backward_final_callback = _originals.pop("_post_backward_final_callback")
