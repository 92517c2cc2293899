"""`tsm.init`, `tsm.is_initialized` and `tsm.transform`."""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist

from smshim.runtime import launch as _runtime
from smshim.torch_sagemaker import activation_offloading, fsdp_patch, topology
from smshim.torch_sagemaker.distributed.checkpoint import optimizer_load
from smshim.torch_sagemaker.config import TsmConfig, load_config, resolve_degrees
from smshim.torch_sagemaker.rng import DEFAULT_NAME
from smshim.torch_sagemaker.state_handler import Ranker, state

logger = logging.getLogger(__name__)

ConfigArg = Union[None, str, os.PathLike, Mapping[str, Any]]


def _device_type() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _fill_state(cfg: TsmConfig) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    d = resolve_degrees(cfg, world)  # raises on every rank alike, before any collective below
    mesh = topology.build_mesh(d, _device_type())
    c = topology.coords(d, rank)
    s = state
    s.config, s.degrees, s.mesh = cfg, d, mesh
    s.rank, s.world_size = rank, world
    s.hybrid_shard_degree = cfg.hybrid_shard_degree
    s.tensor_parallel_degree, s.context_parallel_degree, s.expert_parallel_degree = d.tp, d.cp, d.ep
    s.tp_rank = c.mp if d.tp > 1 else 0
    s.ep_rank = c.mp if d.ep > 1 else 0
    s.cp_rank = c.cp
    s.dp_rank, s.dp_size = rank // (d.tp * d.cp), world // (d.tp * d.cp)
    s.world_process_group = dist.group.WORLD
    s.cp_process_group = mesh["cp"].get_group()
    s.ep_process_group = mesh["mp"].get_group() if d.ep > 1 else None
    fallback = d.mp == 1 and d.cp == 1 and cfg.hybrid_shard_degree in (0, 1)
    s.tp_process_group = None if fallback else mesh["mp"].get_group()
    s.rep_rank_process_group = None if fallback else mesh["replica"].get_group()
    s.sm_activation_offloading = cfg.sm_activation_offloading
    s.activation_loading_horizon = cfg.activation_loading_horizon
    s.fsdp_cache_flush_warnings = cfg.fsdp_cache_flush_warnings
    s.allow_empty_shards = cfg.allow_empty_shards
    s.random_seed = cfg.random_seed
    s.ranker = Ranker(d)
    s.background_groups = topology.background_groups(d)
    tracker = s.get_rng_state_tracker()
    tracker.reset()
    tracker.add(DEFAULT_NAME, cfg.random_seed + (s.tp_rank if d.tp > 1 else s.ep_rank))
    s.initialized = True


def init(config: ConfigArg = None) -> None:
    """Initialise SMP v2 for this job: read and check the config, lay out the ranks, build the
    process groups (torch DeviceMesh), and install the FSDP patches (see fsdp_patch) and the
    prefetching activation offload (see activation_offloading), and the group-aware
    load_sharded_optimizer_state_dict (see distributed.checkpoint.optimizer_load).

    The default process group is brought up from the launcher's environment if the script has not
    done it (scripts normally call `dist.init_process_group` first)."""
    cfg = load_config(config)
    if not dist.is_initialized():
        _runtime.init_distributed()
    if state.initialized:
        logger.warning("tsm.init() called again: the state is rebuilt from the new config")
    _fill_state(cfg)
    fsdp_patch.install()
    activation_offloading.install()
    optimizer_load.install()
    logger.info("%r", state)


def is_initialized() -> bool:
    return state.initialized


def transform(model: torch.nn.Module, device: Optional[torch.device] = None,
              dtype: Optional[torch.dtype] = None, config: Any = None,
              load_state_dict_from_rank0: bool = False, cp_comm_type: str = "p2p") -> torch.nn.Module:
    """With TP, CP and EP degrees all 1 the model is returned as it is (nothing to split).
    Otherwise the model is split by smshim.torch_sagemaker.parallelize.apply over `tsm.state`'s mesh."""
    if not state.initialized:
        raise RuntimeError("tsm.transform: call tsm.init() first")
    if state.tensor_parallel_degree == state.context_parallel_degree == state.expert_parallel_degree == 1:
        return model
    from smshim.torch_sagemaker import parallelize

    mp = state.mesh["mp"]
    return parallelize.apply(
        model, tp_mesh=mp if state.tensor_parallel_degree > 1 else None,
        cp_mesh=state.mesh["cp"] if state.context_parallel_degree > 1 else None,
        ep_mesh=mp if state.expert_parallel_degree > 1 else None, device=device, dtype=dtype,
        config=config, load_state_dict_from_rank0=load_state_dict_from_rank0,
        cp_comm_type=cp_comm_type, random_seed=state.random_seed)
