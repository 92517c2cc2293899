"""`import smdistributed.dataparallel.torch.torch_smddp` registers the torch.distributed backend "smddp".

After the import, `torch.distributed.init_process_group(backend="smddp")` works under torchrun
(env://) and under mpirun (rank and size from the MPI environment, exported at import time, with
SMDATAPARALLEL_LOCAL_RANK), and native torch DDP/FSDP run on it. The backend is a process group that sends CPU tensors through
gloo and CUDA tensors through NCCL, built the way torch builds "cpu:gloo,cuda:nccl".
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroup

from smshim.runtime import launch as _runtime

logger = logging.getLogger(__name__)

BACKEND_NAME = "smddp"


def _create_smddp(opts: Any, backend_options: Any = None) -> ProcessGroup:
    """torch's extended-API backend constructor: returns a whole ProcessGroup.

    torch asks a plugin for one backend object and registers it for every device it claims; a
    ProcessGroup, though, is taken as-is, which lets us register gloo for "cpu" and NCCL for
    "cuda" ourselves.
    """
    store, rank, size, tmo = opts.store, opts.group_rank, opts.group_size, opts.timeout
    ranks = list(opts.global_ranks_in_group)
    pg = ProcessGroup(store, rank, size)
    use_nccl = torch.cuda.is_available() and dist.is_nccl_available()
    pg._set_default_backend(ProcessGroup.BackendType.NCCL if use_nccl
                            else ProcessGroup.BackendType.GLOO)
    gloo = dist.ProcessGroupGloo(PrefixStore("gloo/", store), rank, size, tmo)
    gloo.options.global_ranks_in_group = ranks
    gloo.options.group_name = opts.group_id
    gloo._set_sequence_number_for_group()
    pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, gloo)
    if use_nccl:
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts.is_high_priority_stream = False
        nccl_opts._timeout = tmo
        nccl_opts.global_ranks_in_group = ranks
        nccl_opts.group_name = opts.group_id
        nccl = dist.ProcessGroupNCCL(PrefixStore("nccl/", store), rank, size, nccl_opts)
        nccl._set_sequence_number_for_group()
        pg._register_backend(torch.device("cuda"), ProcessGroup.BackendType.NCCL, nccl)
    logger.debug("smddp group of %d (rank %d): cpu->gloo%s", size, rank,
                 ", cuda->nccl" if use_nccl else "")
    return pg


def _register() -> None:
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create_smddp, extended_api=True,
                                  devices=["cpu", "cuda"])


def _export_env() -> None:
    _runtime.export_mpi_env()
    info = _runtime.detect_launch()
    if info.launcher != "single":
        # Hugging Face's Trainer reads it right after init_process_group(backend="smddp").
        os.environ.setdefault("SMDATAPARALLEL_LOCAL_RANK", str(info.local_rank))


_register()
_export_env()
