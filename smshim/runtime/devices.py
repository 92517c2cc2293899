"""Which backend the process groups that carry CUDA tensors use: NCCL when every rank computes on
a GPU of its own, else None (the caller keeps gloo, which carries CPU tensors, and CUDA tensors
through host memory).

Group creation is a collective: every rank must create the same groups in the same order, so
the answer depends only on facts that are the same on every rank of a job on alike hosts (the
default backend, CUDA and NCCL being there, the GPUs per host and the ranks per host).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from smshim.runtime.launch import detect_launch

__all__ = ["device_backend", "device_backend_for"]


def device_backend_for(default_backend: str, cuda_available: bool, nccl_available: bool,
                       device_count: int, local_world_size: int) -> Optional[str]:
    """"nccl" when CUDA tensors of this job can travel on NCCL groups, else None.

    The default group must compute on CUDA (backend "nccl", or "smddp", which sends CUDA tensors
    through NCCL), and each rank on a host needs a GPU of its own: NCCL refuses two ranks of one
    communicator on one device, so ranks sharing a GPU take the host path."""
    if not (cuda_available and nccl_available):
        return None
    if default_backend not in ("nccl", "smddp"):
        return None
    if device_count < max(1, local_world_size):
        return None
    return "nccl"


def device_backend() -> Optional[str]:
    """`device_backend_for` with this process's facts (the default group must be up)."""
    cuda = torch.cuda.is_available()
    if not cuda:  # (the CPU path asks nothing more)
        return None
    return device_backend_for(
        dist.get_backend() if dist.is_initialized() else "gloo", cuda, dist.is_nccl_available(),
        torch.cuda.device_count(), detect_launch().local_size)
