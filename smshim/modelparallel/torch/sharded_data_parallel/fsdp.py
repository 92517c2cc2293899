"""`sharded_data_parallel_degree` k > 1: the DistributedModel's module under torch's FSDP.

Layout. The world's ranks form replicas of k consecutive ranks: rank r holds shard `r % k` of
replica `r // k`. Parameters, gradients and optimizer state are sharded over the k ranks of a
replica (the shard group) and replicated across replicas (the replicate group, ranks with the
same shard). k == world: FULL_SHARD on the shard group; k < world: HYBRID_SHARD with the
explicit (shard, replicate) groups. Gradients end as the average over every data-parallel rank,
so training equals one process on the global batch (each rank's loss is its own batch's mean).

The whole module is one FSDP unit (the root): correct for any module, and the unit of the
all-gather; `use_orig_params=True` keeps the user's Parameter objects (as sharded views between
steps), so an optimizer built from `model.parameters()` before or after wrapping steps the
shards, and torch's plain optimizers work unchanged.

State dicts. Full: gathered by FSDP (a collective over every rank), on rank 0, keyed as the
plain module's; the optimizer's is turned from FSDP's name-keyed form into torch's index form
over the optimizer's own parameter order, so both load into a plain module and optimizer. Local
(partial checkpoints): each rank's flat shard pieces and its optimizer's own state dict, marked
with the degree and shard rank they load at (no collective).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from smshim.modelparallel.torch.errors import SMPValidationError

# torch's FSDP is imported by the functions that use it: importing it costs ~1.2 s of CPU, which
# `smshim run` would pay on every smp launch (it reads the smp config before any process starts).
if TYPE_CHECKING:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

logger = logging.getLogger(__name__)

SDP_KEY = "_smp_sdp"  # marker of a local (partial) state dict: {"degree": k, "shard_rank": s}
PARTIAL_KEY = "_smp_is_partial"


@dataclass(frozen=True)
class ShardLayout:
    """Where rank `rank` of `world` sits with sharding degree `degree`."""
    degree: int
    world: int
    rank: int

    @property
    def shard_rank(self) -> int:
        return self.rank % self.degree

    @property
    def replica(self) -> int:
        return self.rank // self.degree

    @property
    def replicas(self) -> int:
        return self.world // self.degree

    def shard_groups(self) -> List[List[int]]:
        k = self.degree
        return [list(range(r * k, r * k + k)) for r in range(self.replicas)]

    def replicate_groups(self) -> List[List[int]]:
        return [list(range(s, self.world, self.degree)) for s in range(self.degree)]


def make_groups(layout: ShardLayout, timeout: Any) -> Tuple[Any, Optional[Any]]:
    """(shard group, replicate group or None). Every rank creates every group, in one order."""
    shard = replicate = None
    for ranks in layout.shard_groups():
        g = dist.new_group(ranks, timeout=timeout)
        if layout.rank in ranks:
            shard = g
    if layout.replicas > 1:
        for ranks in layout.replicate_groups():
            g = dist.new_group(ranks, timeout=timeout)
            if layout.rank in ranks:
                replicate = g
    return shard, replicate


def wrap(module: nn.Module, layout: ShardLayout, device: torch.device, timeout: Any,
         compute_dtype: Optional[torch.dtype] = None) -> FSDP:
    """The module as one FSDP unit sharded over its replica's k ranks, starting from rank 0's
    values, computing in `compute_dtype` (None: the parameters' own). A collective: every rank
    calls it."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

    shard, replicate = make_groups(layout, timeout)
    hybrid = replicate is not None
    kwargs: Dict[str, Any] = dict(
        sharding_strategy=ShardingStrategy.HYBRID_SHARD if hybrid else ShardingStrategy.FULL_SHARD,
        process_group=(shard, replicate) if hybrid else shard,
        use_orig_params=True,
    )
    if compute_dtype is not None:
        # fp16/bf16: fp32 shards (the master weights), forward and backward in compute_dtype,
        # gradients reduced and kept in fp32 (as SMP's fp32 master gradients).
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=compute_dtype,
                                                   reduce_dtype=torch.float32,
                                                   buffer_dtype=compute_dtype)
    if device.type == "cpu":
        kwargs["device_id"] = torch.device("cpu")
    else:
        kwargs["device_id"] = device
    # Same starting values everywhere before sharding: rank 0's (FSDP's sync_module_states
    # needs a GPU and covers one shard group only).
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, 0)
    wrapped = FSDP(module, **kwargs)
    logger.info("sharded data parallelism: rank %d holds shard %d of %d (replica %d of %d, %s)",
                layout.rank, layout.shard_rank, layout.degree, layout.replica, layout.replicas,
                "HYBRID_SHARD" if hybrid else "FULL_SHARD")
    return wrapped


def clip_grad_norm(wrapped: FSDP, max_norm: float, norm_type: float = 2.0) -> float:
    """The exact global gradient norm over every shard (torch's clip_grad_norm_ of the unsharded
    model), gradients clipped in place. A collective: call it on every rank."""
    return float(wrapped.clip_grad_norm_(max_norm, norm_type))


# ---- full state dicts (collectives) ------------------------------------------------------------
def _full_context(wrapped: FSDP, rank0_only: bool):
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    # offload_to_cpu only off the CPU: on gloo, FSDP1 (torch 2.13) segfaults with it, and the
    # tensors are on the CPU already.
    offload = wrapped.compute_device.type != "cpu"
    with warnings.catch_warnings():  # torch 2.4+ calls the FSDP1 context deprecated; it works
        warnings.simplefilter("ignore", FutureWarning)
        return _entered(FSDP.state_dict_type(
        wrapped, StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only),
        FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only)))


@contextlib.contextmanager
def _entered(cm: Any) -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with cm:
            yield


def full_model_state_dict(wrapped: FSDP) -> Dict[str, Any]:
    """The plain module's state dict on rank 0 (CPU tensors; {} elsewhere). Every rank calls."""
    with _full_context(wrapped, rank0_only=True):
        sd = wrapped.state_dict()
    if dist.get_rank() != 0:  # FSDP's rank 0 is each shard group's
        return {}
    return {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
            for k, v in sd.items()}


def load_full_model_state_dict(wrapped: FSDP, sd: Dict[str, Any], strict: bool = True) -> Any:
    """Load a plain module's state dict (every rank passes the same dict)."""
    with _full_context(wrapped, rank0_only=False):
        return wrapped.load_state_dict(sd, strict=strict)


def _param_names(wrapped: FSDP, optimizer: torch.optim.Optimizer) -> List[str]:
    """The optimizer's parameters' names, in torch's state-dict index order."""
    # The user's module's names (FSDP's own carry its wrapper's prefix).
    names = {id(p): n for n, p in wrapped.module.named_parameters()}
    out = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in names:
                raise SMPValidationError(
                    "sharded data parallelism: the optimizer holds a parameter that is not the "
                    "DistributedModel's; build it from model.parameters()")
            out.append(names[id(p)])
    return out


def full_optim_state_dict(wrapped: FSDP, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """torch's optimizer state dict of the unsharded model (indices over the optimizer's
    parameter order), on rank 0 ({} elsewhere). Every rank calls."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with _full_context(wrapped, rank0_only=True):
        named = FSDP.optim_state_dict(wrapped, optimizer)
    if not named or dist.get_rank() != 0:
        return {}
    index = {n: i for i, n in enumerate(_param_names(wrapped, optimizer))}
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [index[n] for n in g["params"]]} for g in named["param_groups"]]
    return {"state": {index[n]: s for n, s in named["state"].items()}, "param_groups": groups}


def load_full_optim_state_dict(wrapped: FSDP, optimizer: torch.optim.Optimizer,
                               sd: Dict[str, Any]) -> None:
    """Load torch's index-form optimizer state of the unsharded model (every rank, same dict)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    names = _param_names(wrapped, optimizer)
    if len(names) != sum(len(g["params"]) for g in sd["param_groups"]):
        raise SMPValidationError(
            f"sharded data parallelism: the optimizer state dict holds "
            f"{sum(len(g['params']) for g in sd['param_groups'])} parameters, the optimizer "
            f"{len(names)}; load a state dict of this model's optimizer")
    named = {"state": {names[i]: s for i, s in sd["state"].items()},
             "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                               "params": [names[i] for i in g["params"]]}
                              for g in sd["param_groups"]]}
    with _full_context(wrapped, rank0_only=False):
        flat = FSDP.optim_state_dict_to_load(wrapped, optimizer, named)
    optimizer.load_state_dict(flat)


# ---- local state dicts (each rank's shard; no collective) --------------------------------------
def _marker(layout: ShardLayout) -> Dict[str, int]:
    return {"degree": layout.degree, "shard_rank": layout.shard_rank}


def local_model_state_dict(module: nn.Module, layout: ShardLayout) -> Dict[str, Any]:
    """This rank's pieces of the flat shards (a parameter outside the shard has 0 elements) and
    the (replicated) buffers."""
    sd: Dict[str, Any] = {n: p.detach().cpu().clone() for n, p in module.named_parameters()}
    sd.update({n: b.detach().cpu().clone() for n, b in module.named_buffers()})
    sd[PARTIAL_KEY] = True
    sd[SDP_KEY] = _marker(layout)
    return sd


def check_local(sd: Dict[str, Any], layout: ShardLayout, what: str) -> None:
    got = sd.get(SDP_KEY)
    if got != _marker(layout):
        raise SMPValidationError(
            f"rank {layout.rank}: {what} was saved as shard {got and got.get('shard_rank')} of "
            f"sharded_data_parallel_degree {got and got.get('degree')}, but this rank holds shard "
            f"{layout.shard_rank} of sharded_data_parallel_degree {layout.degree}; a partial "
            "checkpoint loads only at the degree it was saved with (save a full one, "
            "partial=False, to change it)")


def load_local_model_state_dict(module: nn.Module, sd: Dict[str, Any], layout: ShardLayout,
                                strict: bool = True) -> None:
    check_local(sd, layout, "the partial model state dict")
    own = dict(module.named_parameters())
    own.update(dict(module.named_buffers()))
    given = {k: v for k, v in sd.items() if not k.startswith("_smp_")}
    missing, unexpected = sorted(set(own) - set(given)), sorted(set(given) - set(own))
    if strict and (missing or unexpected):
        raise SMPValidationError(
            f"rank {layout.rank}: the partial model state dict does not match the model: missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for k, v in given.items():
            if k not in own:
                continue
            if own[k].shape != v.shape:
                raise SMPValidationError(
                    f"rank {layout.rank}: {k!r} has shape {tuple(v.shape)} in the partial "
                    f"checkpoint but {tuple(own[k].shape)} here; it was saved from another model")
            own[k].copy_(v)


def local_optim_state_dict(optimizer: torch.optim.Optimizer, layout: ShardLayout) -> Dict[str, Any]:
    sd = optimizer.state_dict()
    sd[PARTIAL_KEY] = True
    sd[SDP_KEY] = _marker(layout)
    return sd


def load_local_optim_state_dict(optimizer: torch.optim.Optimizer, sd: Dict[str, Any],
                                layout: ShardLayout) -> None:
    check_local(sd, layout, "the partial optimizer state dict")
    optimizer.load_state_dict({k: v for k, v in sd.items() if not k.startswith("_smp_")})


def unscale_and_check(params: List[torch.Tensor], inv_scale: float) -> bool:
    """Divide this rank's gradient shards by the loss scale; True if one is inf/NaN here."""
    found = False
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                if inv_scale != 1.0:
                    p.grad.mul_(inv_scale)
                found = found or not bool(torch.isfinite(p.grad).all())
    return found
