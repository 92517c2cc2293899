"""load_state_dict_from_rank0: every rank gets rank 0's weights before it cuts its shards.

Rank 0 must hold real tensors; the others may be on `meta` (built under init_empty_weights): they
get storage here and rank 0's values, parameter by parameter (one full tensor in flight at a time),
buffers included (non-persistent ones such as rotary frequencies are not in a state dict and would
otherwise stay uninitialised).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def _meta_names(model: nn.Module):
    return [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]


def broadcast_from_rank0(model: nn.Module, device: torch.device) -> None:
    meta = _meta_names(model)
    flag = torch.tensor([1 if (dist.get_rank() == 0 and meta) else 0])
    dist.all_reduce(flag)  # every rank learns rank 0's state, so all raise together
    if flag.item():
        raise ValueError("load_state_dict_from_rank0=True needs real weights on rank 0, but its "
                         f"{meta[:3]}... are on meta; load them there (from_pretrained) first")
    if meta:
        model.to_empty(device=device)
    with torch.no_grad():
        for _, t in list(model.named_parameters()) + list(model.named_buffers()):
            buf = t.data if t.is_contiguous() else t.data.contiguous()
            dist.broadcast(buf, src=0)
            if buf is not t.data:
                t.data.copy_(buf)
