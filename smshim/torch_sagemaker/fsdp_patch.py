"""What `tsm.init()` changes in torch's FSDP1, and why (each patch is undone by `uninstall()`).

SMP v2 scripts wrap their model with the ordinary `FullyShardedDataParallel(...)` and never pass
process groups; SMP makes that call follow the job's degrees. Installed by `tsm.init()`, only then:

1. `FullyShardedDataParallel.__init__` (only when the call passes neither `process_group` nor
   `device_mesh`, i.e. a script's root call; the children auto-wrap creates receive the root's
   groups and pass through untouched):
   * process groups from `tsm.state`'s DeviceMesh: hybrid_shard_degree k >= 2 -> a 2-D
     (replicate, shard) mesh and HYBRID_SHARD (`_HYBRID_SHARD_ZERO2` kept, other strategies
     rewritten, as SMP does); 1 -> NO_SHARD over each rank's sharding group of one (SMP's
     `model.process_group`), gradients averaged over the data-parallel ranks by a communication
     hook; 0 -> stock FSDP, or the largest sharding group when TP/CP/EP > 1. Orthogonal to the
     TP group by construction.
   * `post_param_init_fn=` (an SMP argument stock FSDP rejects) is accepted: it runs on each module
     right after `param_init_fn` has materialised it (DelayedParamIniter re-ties weights there).
   * `device_id`: stock FSDP refuses a machine without an accelerator unless told
     `device_id=cpu`; without CUDA we pass the CPU (a CUDA `device_id` is mapped to it).
   * a HYBRID_SHARD call at hybrid_shard_degree 0 without TP gets an explicit (nodes, local ranks)
     mesh: stock FSDP derives the node size from the accelerator count, which is 0 on a CPU host.
   * a model holding DTensors (tsm.transform's TP shards) gets the same sharding as a
     `device_mesh` slice of tsm.state's mesh instead of groups (FSDP1's TP path needs one). Its
     sharded state dicts split the tensors TP leaves whole inside each replica
     (fsdp_shard_layout.py), so that replica 0 alone can save per TP rank, as AWS's scripts do.
   * expert parallelism: the experts become `ignored_modules`, the rest is sharded over the
     ranks with the same EP rank and replicated over the EP ranks (data-parallel ranks too) and
     replicas; the experts' gradients are averaged over the ranks holding the same experts
     (fsdp_expert_grads.py, installed with the patches here).
2. `FullStateDictConfig.__init__` accepts `translate_on_save` (default True), an SMP field: a
   transformed model's FULL state dict has its TP/EP DTensors gathered whole (the HF layout; the
   module tree is HF's already), by a state-dict hook on the root FSDP module. Models that did
   not go through `tsm.transform` are in that layout already, so nothing is translated for them.
3. `FullyShardedDataParallel.set_state_dict_type` (which `FSDP.state_dict_type` calls): when the
   model computes on the CPU, `offload_to_cpu=True` of a FULL state dict (model or optimizer) is
   turned off. The tensors are on the CPU already, so the result is the same; and with it, stock
   FSDP1 on torch 2.13 segfaults on gloo (every strategy) in the state dict every script takes at
   the end, `FullStateDictConfig(offload_to_cpu=True, rank0_only=True)`.
4. `torch.distributed.fsdp._init_utils._check_module_states_for_sync_module_states`: on a host
   without CUDA, CPU tensors are allowed with `sync_module_states=True` (stock FSDP demands GPU
   tensors; gloo broadcasts CPU tensors fine). This is what SMP's fine-tuning recipe needs on CPU:
   rank 0 loads the pretrained weights, the others build on meta, FSDP spreads rank 0's weights.
5. Unsharded FSDP1 (NO_SHARD, or a sharding group of one) around a TP model keeps the DTensor
   parameters the optimizer holds, and loads optimizer state into them (fsdp_unsharded_tp.py).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from typing import Any, Callable, Dict, Optional

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import _init_utils as _fsdp_init_utils
from torch.distributed.fsdp import (FullStateDictConfig, ShardingStrategy,
                                    StateDictType)

from smshim.torch_sagemaker import fsdp_expert_grads, fsdp_unsharded_tp
from smshim.torch_sagemaker.fsdp_shard_layout import keep_shards_inside_each_replica
from smshim.torch_sagemaker.state_handler import state

logger = logging.getLogger(__name__)

_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
_originals: Dict[str, Any] = {}
_FSDP_PARAMS = list(inspect.signature(FSDP.__init__).parameters)[1:]  # without self


def _cpu_only() -> bool:
    return not torch.cuda.is_available()


def _device_id(device_id: Any) -> Any:
    if not _cpu_only():
        return device_id
    if device_id is not None and torch.device(device_id).type not in ("cpu", "cuda"):
        return device_id
    return torch.device("cpu")


def _with_post_init(param_init_fn: Optional[Callable], post: Optional[Callable]) -> Optional[Callable]:
    if post is None:
        return param_init_fn
    if param_init_fn is None:
        logger.warning("FSDP(post_param_init_fn=...) without param_init_fn: it runs after FSDP's "
                       "own materialisation would, i.e. never for a model that is not on meta")
        return None

    def init_then_post(module: torch.nn.Module) -> None:
        param_init_fn(module)
        post(module)

    return init_then_post


_node_groups_cache: Dict[str, Any] = {}


def _node_groups():
    """(local ranks, nodes) process groups for stock HYBRID_SHARD on a CPU host (built once)."""
    if "groups" not in _node_groups_cache:
        mesh = _node_mesh()
        _node_groups_cache["groups"] = (mesh["shard"].get_group(), mesh["rep"].get_group())
    return _node_groups_cache["groups"]


def _node_mesh():
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % local:
        raise ValueError(f"FSDP HYBRID_SHARD: world size {world} is not a multiple of "
                         f"LOCAL_WORLD_SIZE={local}")
    return init_device_mesh("cpu", (world // local, local), mesh_dim_names=("rep", "shard"))


def _hybrid_groups():
    """(shard, replicate) process groups from tsm.state's mesh. Given as groups, not as a 2-D
    slice of the mesh: FSDP1 builds its sharded state dict's DTensors on the slice's root mesh
    and shards them along that root's first dimension (the replicas), which DCP then rejects."""
    return (state.mesh["shard"].get_group(), state.mesh["rep"].get_group())


def _groups_for(strategy: Optional[ShardingStrategy]) -> Dict[str, Any]:
    """The strategy and group arguments the job's degrees give a script's root FSDP call."""
    d, mesh, hsd = state.degrees, state.mesh, state.hybrid_shard_degree
    strategy = strategy or ShardingStrategy.FULL_SHARD
    if hsd >= 2:
        if strategy not in _HYBRID:
            logger.info("hybrid_shard_degree=%d: FSDP sharding_strategy %s becomes HYBRID_SHARD",
                        hsd, strategy.name)
            strategy = ShardingStrategy.HYBRID_SHARD
        return {"sharding_strategy": strategy, "process_group": _hybrid_groups()}
    if hsd == 1:
        if strategy != ShardingStrategy.NO_SHARD:
            logger.info("hybrid_shard_degree=1: FSDP sharding_strategy %s becomes NO_SHARD",
                        strategy.name)
        # The group is the sharding group, of one rank (SMP's `model.process_group`, which
        # AWS's scripts save checkpoints over from replica 0); gradients are averaged over the
        # data-parallel ranks by `_average_over`.
        return {"sharding_strategy": ShardingStrategy.NO_SHARD,
                "process_group": mesh["shard"].get_group()}
    # hybrid_shard_degree 0: stock behaviour over the ranks with this TP/EP rank.
    if strategy in _HYBRID:
        if d.mp == 1 and d.cp == 1:
            return {"sharding_strategy": strategy, "process_group": _node_groups()} if _cpu_only() else {}
        return {"sharding_strategy": strategy, "process_group": _hybrid_groups()}
    if d.mp == 1:
        return {"sharding_strategy": strategy}
    return {"sharding_strategy": strategy, "process_group": mesh["dp"].get_group()}


def _expert_modules(module: torch.nn.Module) -> list:
    from smshim.torch_sagemaker.parallelize.moe.expert_parallel import ExpertParallelExperts

    return [m for m in module.modules() if isinstance(m, ExpertParallelExperts)]


def _holds_dtensors(module: torch.nn.Module, ignored) -> bool:
    from torch.distributed.tensor import DTensor

    skip = {id(p) for m in ignored for p in m.parameters()}
    return any(isinstance(p, DTensor) and id(p) not in skip for p in module.parameters())


def _expert_parallel_args(module: torch.nn.Module, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """EP: the experts (split by EP, gradients pre-scaled by 1/ep) stay out of FSDP, and the root
    averages their gradients over the other ranks that hold the same experts
    (fsdp_expert_grads.py). The EP ranks are data-parallel ranks too: the rest of the model is
    sharded over the ranks with this EP rank (`shard`, hybrid_shard_degree of them: SMP's
    `model.process_group`, so that AWS's per-EP-rank checkpoints `tp0_ep{r}` hold one EP rank's
    share each) and replicated over the EP ranks and replicas (HYBRID_SHARD). A sharding group of
    one: NO_SHARD, averaged over every rank by `_average_over`."""
    ignored = list(kwargs.get("ignored_modules") or [])
    ignored += [m for m in _expert_modules(module) if all(m is not i for i in ignored)]
    strategy = kwargs.get("sharding_strategy") or ShardingStrategy.FULL_SHARD
    shard = state.mesh["shard"].get_group()
    if state.mesh["shard"].size() == 1:
        return {"sharding_strategy": ShardingStrategy.NO_SHARD, "process_group": shard,
                "ignored_modules": ignored}
    if strategy not in _HYBRID:
        strategy = ShardingStrategy.HYBRID_SHARD
    return {"sharding_strategy": strategy, "ignored_modules": ignored,
            "process_group": (shard, state.mesh["rep_mp"].get_group())}


def _tensor_parallel_args(strategy: Optional[ShardingStrategy]) -> Dict[str, Any]:
    """A model holding DTensors (tsm.transform's TP shards) needs FSDP1's 2-D path: a
    `device_mesh` sliced from the TP mesh's root (so FSDP flattens the TP shards and rebuilds the
    DTensors in state dicts), not process groups. Same groups as `_groups_for` gives."""
    args = _groups_for(strategy)
    args.pop("process_group", None)
    if args["sharding_strategy"] in _HYBRID:
        args["device_mesh"] = state.mesh["rep", "shard"]
    elif state.hybrid_shard_degree == 1:
        args["device_mesh"] = state.mesh["shard"]
    else:
        args["device_mesh"] = state.mesh["dp"]
    return args


def _average_over(root: FSDP, group, sync_module_states: bool) -> None:
    """NO_SHARD over a sharding group of one (hybrid_shard_degree 1, `_groups_for`; with EP, a
    sharding group of one, `_expert_parallel_args`): what NO_SHARD does over its group is done
    over `group`, every rank holding the same parameters: the gradient all-reduce, by a
    communication hook on every unit (FSDP calls it with the gradient to reduce in place), and
    `sync_module_states=True`'s broadcast of the first rank's parameters and buffers (what FSDP
    manages: not the experts EP keeps out)."""
    import torch.distributed as dist
    from torch.distributed.fsdp._common_utils import clean_tensor_name
    from torch.distributed.fsdp._traversal_utils import _get_fsdp_handles, _get_fsdp_states

    n = dist.get_world_size(group)
    if n == 1:
        return
    if sync_module_states:
        src = min(dist.get_process_group_ranks(group))
        ignored = set(getattr(root, "_ignored_buffer_names", ()))
        with torch.no_grad():
            for handle in _get_fsdp_handles(root):
                dist.broadcast(handle.flat_param.data, src, group=group)
            for name, buffer in root.named_buffers():
                if clean_tensor_name(name) not in ignored:
                    dist.broadcast(buffer.data, src, group=group)

    def average(_hook_state, grad: torch.Tensor) -> None:
        grad.div_(n)
        dist.all_reduce(grad, group=group)

    for fsdp_state in _get_fsdp_states(root):
        fsdp_state._comm_hook, fsdp_state._comm_hook_state = average, None


def _after_root_init(root: FSDP, module: torch.nn.Module, sync_module_states: bool) -> None:
    """What the job's degrees add to a script's root FSDP once it is built: gradient averaging
    (and the start from the same weights) beyond FSDP's own groups (hybrid_shard_degree 1;
    experts, kept out of FSDP)."""
    import torch.distributed as dist

    if state.expert_parallel_degree > 1:
        if state.mesh["shard"].size() == 1:
            _average_over(root, dist.group.WORLD, sync_module_states)
        same_experts = state.mesh["dp"].get_group()
        if dist.get_world_size(same_experts) > 1:
            fsdp_expert_grads.average_over(
                root, [p for m in _expert_modules(module) for p in m.parameters()], same_experts)
    elif state.hybrid_shard_degree == 1:
        _average_over(root, state.mesh["dp"].get_group(), sync_module_states)


def _patched_init(self, module, *args, post_param_init_fn=None, **kwargs):
    kwargs.update(zip(_FSDP_PARAMS, args))
    on_tp_mesh = False
    if state.initialized:
        kwargs["device_id"] = _device_id(kwargs.get("device_id"))
        if kwargs.get("process_group") is None and kwargs.get("device_mesh") is None:
            if state.expert_parallel_degree > 1:
                kwargs.update(_expert_parallel_args(module, kwargs))
            elif _holds_dtensors(module, kwargs.get("ignored_modules") or []):
                kwargs.update(_tensor_parallel_args(kwargs.get("sharding_strategy")))
                on_tp_mesh = True
            else:
                kwargs.update(_groups_for(kwargs.get("sharding_strategy")))
            root = True
        else:
            root = False
        kwargs["param_init_fn"] = _with_post_init(kwargs.get("param_init_fn"), post_param_init_fn)
    elif post_param_init_fn is not None:
        raise TypeError("FSDP(post_param_init_fn=...) is SMP's argument: call tsm.init() first")
    else:
        root = False
    _originals["FSDP.__init__"](self, module, **kwargs)
    if on_tp_mesh:
        keep_shards_inside_each_replica(self)
    if root:
        _after_root_init(self, module, bool(kwargs.get("sync_module_states")))
    if root and _transformed(module):
        self._register_state_dict_hook(_translate_full_state_dict)


def _transformed(module: torch.nn.Module) -> bool:
    return any(getattr(m, "_smshim_transform", None) is not None for m in module.modules())


def _translate_full_state_dict(module, state_dict, prefix, local_metadata):
    """FULL state dict of a transformed model with `translate_on_save` (the default): TP/EP
    DTensor shards become whole tensors, i.e. the HF layout (the module tree is HF's already).
    A collective over each TP/EP group, which holds the values on the ranks FSDP returns them on
    (with rank0_only, FSDP rank 0 of every TP rank's sharding group), in key order."""
    from torch.distributed.tensor import DTensor

    if getattr(module, "_state_dict_type", None) != StateDictType.FULL_STATE_DICT:
        return None
    config = getattr(module, "_state_dict_config", None)
    if not getattr(config, "translate_on_save", True):
        return None
    for key in [k for k in state_dict if k.startswith(prefix)]:
        value = state_dict[key]
        if isinstance(value, DTensor):
            full = value.full_tensor().detach()
            state_dict[key] = full.cpu() if getattr(config, "offload_to_cpu", False) else full
    return None


def _fsdp_on_cpu(module: torch.nn.Module) -> bool:
    for m in FSDP.fsdp_modules(module):
        return m.compute_device.type == "cpu"
    return False


def _patched_set_state_dict_type(module, state_dict_type, state_dict_config=None,
                                 optim_state_dict_config=None):
    if state_dict_type == StateDictType.FULL_STATE_DICT and _fsdp_on_cpu(module):
        if state_dict_config is not None and state_dict_config.offload_to_cpu:
            translate = getattr(state_dict_config, "translate_on_save", True)
            state_dict_config = dataclasses.replace(state_dict_config, offload_to_cpu=False)
            state_dict_config.translate_on_save = translate
        if optim_state_dict_config is not None and optim_state_dict_config.offload_to_cpu:
            optim_state_dict_config = dataclasses.replace(optim_state_dict_config, offload_to_cpu=False)
    return _originals["FSDP.set_state_dict_type"](module, state_dict_type, state_dict_config,
                                                  optim_state_dict_config)


def _patched_full_config_init(self, *args, translate_on_save: bool = True, **kwargs):
    _originals["FullStateDictConfig.__init__"](self, *args, **kwargs)
    self.translate_on_save = translate_on_save


def _patched_check_sync_states(module_states) -> None:
    if _cpu_only():
        return
    _originals["_check_module_states_for_sync_module_states"](module_states)


def installed() -> bool:
    return bool(_originals)


def install() -> None:
    """Install the patches above (idempotent)."""
    if _originals:
        return
    _originals["FSDP.__init__"] = FSDP.__init__
    _originals["FSDP.set_state_dict_type"] = FSDP.set_state_dict_type
    _originals["FullStateDictConfig.__init__"] = FullStateDictConfig.__init__
    FSDP.__init__ = functools.wraps(_originals["FSDP.__init__"])(_patched_init)
    FSDP.set_state_dict_type = staticmethod(_patched_set_state_dict_type)
    FullStateDictConfig.__init__ = _patched_full_config_init
    _originals["_check_module_states_for_sync_module_states"] = \
        _fsdp_init_utils._check_module_states_for_sync_module_states
    _fsdp_init_utils._check_module_states_for_sync_module_states = _patched_check_sync_states
    fsdp_unsharded_tp.install()
    fsdp_expert_grads.install()
    logger.debug("torch.sagemaker: FSDP patches installed")


def uninstall() -> None:
    """Give torch back its own FSDP (tests; a process that leaves SMP mode)."""
    if not _originals:
        return
    FSDP.__init__ = _originals.pop("FSDP.__init__")
    FSDP.set_state_dict_type = staticmethod(_originals.pop("FSDP.set_state_dict_type"))
    FullStateDictConfig.__init__ = _originals.pop("FullStateDictConfig.__init__")
    _fsdp_init_utils._check_module_states_for_sync_module_states = \
        _originals.pop("_check_module_states_for_sync_module_states")
    fsdp_unsharded_tp.uninstall()
    fsdp_expert_grads.uninstall()


__all__ = ["install", "uninstall", "installed"]
