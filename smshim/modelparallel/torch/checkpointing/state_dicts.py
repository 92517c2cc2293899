"""Full and partial state dicts of the DistributedModel and DistributedOptimizer.

Full model state: keys, order and `_metadata` exactly as the unwrapped module's `state_dict()`
(tied parameters under every name the module lists), tensors on the CPU, so a plain single-process
module loads it with `module.load_state_dict(sd)`. With pp > 1 every rank contributes the entries
it holds and the dict is gathered over the PP group (smp.allgather, a collective of the PP group).

Partial model state (`local_state_dict()`): the entries of the full dict that this rank holds,
plus metadata keys
    `_smp_is_partial`: True, `_smp_pp_size`, `_smp_pp_rank`,
    `_smp_partition`: the module -> pp rank assignment it was saved under.
With tensor parallelism also `_smp_tp_size`, `_smp_tp_rank` (a partial dict holds shards).
A partial dict only loads on the same pp rank (and tp rank) of a job with the same degrees and
partition; anything else raises, naming what it needs. Every rank compares the same metadata (the degree and
the assignment are the same on all ranks), so every rank raises the same error instead of some
ranks going on into a step that would wait for the ones that failed.

Which entries a rank holds: the module's `state_dict(keep_vars=True)` gives every key and the
tensor object behind it (freed non-local parameters keep their Parameter objects). A key whose
tensor is a parameter or buffer is held where that tensor is local (so a tied parameter is held,
under all its names, where it lives); any other entry (e.g. `_extra_state`) is held by the rank
owning the module it belongs to.

Optimizer: the wrapped optimizer holds every model parameter, indexed as torch's
`Optimizer.state_dict()` does (position in param_groups, first occurrence), and only local
parameters ever get state. The full optimizer state is the union of the ranks' local states with
those same indices, i.e. exactly what a torch optimizer over the unwrapped module's parameters (same
order) produces; each rank loads only its local parameters' entries of a full dict.

Loads before partitioning (pp > 1): a full model dict is applied at once (the module is still
whole, and the partitioning trace then sees the loaded weights); a partial model dict and any
optimizer dict are kept and applied by a post-partition hook, once, in the order given.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

import torch
import torch.nn as nn
from torch.nn.modules.module import _IncompatibleKeys

from smshim.modelparallel.torch.tensor_parallel import shard as tp_shard
from smshim.modelparallel.torch.comm import CommGroup, allgather
from smshim.modelparallel.torch.errors import SMPRuntimeError, SMPValidationError
from smshim.modelparallel.torch.state import state

# The model and optimizer are smp's DistributedModel and DistributedOptimizer, annotated by their
# torch base classes: naming the API's own types here would make this module import the API.

logger = logging.getLogger(__name__)

PARTIAL_KEY = "_smp_is_partial"
PP_SIZE_KEY = "_smp_pp_size"
PP_RANK_KEY = "_smp_pp_rank"
TP_SIZE_KEY = "_smp_tp_size"  # only with tensor parallelism: a partial dict then holds shards
TP_RANK_KEY = "_smp_tp_rank"
PARTITION_KEY = "_smp_partition"
_META_PREFIX = "_smp_"


# Helpers --------------------------------------------------------------------------------------
def _split_meta(sd: Dict[str, Any]) -> Tuple[Dict[str, Any], "OrderedDict[str, Any]"]:
    """(metadata entries, the rest) of a state dict; the rest keeps the dict's `_metadata`."""
    if not isinstance(sd, dict):
        raise SMPValidationError(f"load_state_dict expects a dict, got {type(sd).__name__}")
    meta = {k: v for k, v in sd.items() if isinstance(k, str) and k.startswith(_META_PREFIX)}
    body: "OrderedDict[str, Any]" = OrderedDict(
        (k, v) for k, v in sd.items() if not (isinstance(k, str) and k.startswith(_META_PREFIX)))
    metadata = getattr(sd, "_metadata", None)
    if metadata is not None:
        body._metadata = metadata  # type: ignore[attr-defined]  (module versions, as torch keeps)
    return meta, body


def _is_partial(meta: Dict[str, Any]) -> bool:
    return bool(meta.get(PARTIAL_KEY, False))


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_to_cpu(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _pp() -> Tuple[int, int]:
    topo = state.topology
    return topo.pp_size, topo.pp_rank


def _check_partial_meta(meta: Dict[str, Any], what: str) -> None:
    """A partial dict must come from this pp degree and this pp rank; say what it needs if not."""
    pp_size, pp_rank = _pp()
    _check_partial_tp(meta, what)
    saved_size, saved_rank = meta.get(PP_SIZE_KEY), meta.get(PP_RANK_KEY)
    if saved_size is not None and int(saved_size) != pp_size:
        raise SMPValidationError(
            f"{what}: this partial state dict was saved at pipeline_parallel_degree={saved_size} "
            f"(pp rank {saved_rank}) and this job runs pipeline_parallel_degree={pp_size}. "
            f"A partial checkpoint only loads at the degree it was saved with: run with "
            f"pipeline_parallel_degree={saved_size}, or load a full checkpoint "
            "(model.state_dict() / smp.save_checkpoint(..., partial=False)), which loads at any "
            "degree")
    if saved_rank is not None and int(saved_rank) != pp_rank:
        raise SMPValidationError(
            f"{what}: this partial state dict belongs to pp rank {saved_rank}, but this rank is pp "
            f"rank {pp_rank}; each rank loads its own part (smp.load(f, partial=True) reads "
            f"f'{{f}}_{pp_rank}_0' on this rank)")


def _check_partial_tp(meta: Dict[str, Any], what: str) -> None:
    """A partial dict holds this rank's tensor-parallel shards: same tp degree and tp rank."""
    topo = state.topology
    saved_size = int(meta.get(TP_SIZE_KEY, 1))
    saved_rank = int(meta.get(TP_RANK_KEY, 0))
    if saved_size != topo.tp_size or saved_rank != topo.tp_rank:
        raise SMPValidationError(
            f"{what}: this partial state dict holds the shards of tp rank {saved_rank} at "
            f"tensor_parallel_degree={saved_size}, but rank {topo.rank} is tp rank "
            f"{topo.tp_rank} at tensor_parallel_degree={topo.tp_size}. Load the partial file "
            f"saved for this tp rank (smp.load reads f'{{f}}_{{pp_rank}}_{{tp_rank}}'), run at "
            f"tensor_parallel_degree={saved_size}, or load a full checkpoint")


def _add_tp_meta(sd: Dict[str, Any]) -> None:
    topo = state.topology
    if topo.tp_size > 1:
        sd[TP_SIZE_KEY] = topo.tp_size
        sd[TP_RANK_KEY] = topo.tp_rank


def _defer(model: nn.Module, apply: Any) -> None:
    """Run `apply()` right after partitioning, once, after any loads deferred before it."""
    pending = getattr(model, "_pending_loads", None)
    if pending is None:
        pending = model._pending_loads = []  # type: ignore[attr-defined]

        def run(m: Any, _opt: Any) -> None:
            handle.remove()
            items = list(m._pending_loads)
            m._pending_loads = None
            for fn in items:
                fn()

        handle = model.register_post_partition_hook(run)
    pending.append(apply)


# Model ----------------------------------------------------------------------------------------
def _module_names(model: nn.Module) -> Set[str]:
    return {name for name, _ in model.module.named_modules(remove_duplicate=False)}


def _owner_module(key: str, names: Set[str]) -> str:
    prefix = key.rpartition(".")[0]
    while prefix and prefix not in names:
        prefix = prefix.rpartition(".")[0]
    return prefix


def _local_keys(model: nn.Module, structure: Dict[str, Any]) -> List[str]:
    """The keys of the full state dict that this rank holds, in state-dict order."""
    module = model.module
    if model._pp_size == 1:
        return list(structure)
    local_ids = {id(t) for _, t in model.local_named_parameters()}
    local_ids.update(id(t) for _, t in model.local_named_buffers())
    all_ids = {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}
    names = _module_names(model)
    keys = []
    for key, value in structure.items():
        if isinstance(value, torch.Tensor) and id(value) in all_ids:
            held = id(value) in local_ids
        else:
            held = model._is_local(_owner_module(key, names))
        if held:
            keys.append(key)
    return keys


def _local_entries(model: nn.Module) -> Tuple["OrderedDict[str, Any]", List[str]]:
    structure = model.module.state_dict(keep_vars=True)
    keys = _local_keys(model, structure)
    return structure, keys


def model_state_dict(model: nn.Module, destination: Optional[Dict[str, Any]] = None,
                     prefix: str = "", keep_vars: bool = False) -> Dict[str, Any]:
    """The full model state (see the module docstring). A PP-group collective when pp > 1 and
    the model is partitioned; `keep_vars` is honoured only where the module is whole."""
    if model._pp_size == 1 or not model.partitioned:
        sd = model.module.state_dict(prefix=prefix, keep_vars=keep_vars)
        if not keep_vars:
            for k, v in sd.items():
                if isinstance(v, torch.Tensor) and v.device.type != "cpu":
                    sd[k] = v.detach().cpu()
        _gather_tp_shards(sd, model.module.state_dict(keep_vars=True), prefix)
    else:
        structure, keys = _local_entries(model)
        mine = {k: _to_cpu(structure[k]) for k in keys}
        _gather_tp_shards(mine, structure)
        parts = allgather(mine, CommGroup.PP_GROUP)
        merged: Dict[str, Any] = {}
        for part in parts:
            for k, v in part.items():
                merged.setdefault(k, v)
        missing = [k for k in structure if k not in merged]
        if missing:
            raise SMPRuntimeError(
                f"DistributedModel.state_dict(): no pp rank holds {missing[:5]}; the partition "
                "lost these entries (please report this as an smshim bug)")
        sd = OrderedDict((prefix + k, merged[k]) for k in structure)
        sd._metadata = OrderedDict(  # type: ignore[attr-defined]
            ((prefix[:-1] + ("." + k if k else "") if prefix else k), v)
            for k, v in getattr(structure, "_metadata", {}).items())
    if destination is not None:
        destination.update(sd)
        return destination
    return sd


def _gather_tp_shards(sd: Dict[str, Any], structure: Dict[str, Any], prefix: str = "") -> None:
    """Replace, in place, every tensor-parallel shard in `sd` by the full tensor gathered from
    the TP group (a collective of the TP group when tp > 1: every TP rank calls it)."""
    if state.topology.tp_size == 1:
        return
    splits = {prefix + k: tp_shard.split_of(v) for k, v in structure.items()
              if tp_shard.is_sharded(v)}
    mine = {k: v for k, v in sd.items() if k in splits and isinstance(v, torch.Tensor)}
    parts = allgather(_to_cpu(mine), CommGroup.TP_GROUP)
    for k in mine:
        sd[k] = tp_shard.unshard([part[k] for part in parts], splits[k])


def model_local_state_dict(model: nn.Module) -> Dict[str, Any]:
    """This rank's entries of the full state dict, plus the partial-dict metadata."""
    model._require_partitioned("local_state_dict")
    structure, keys = _local_entries(model)
    sd: "OrderedDict[str, Any]" = OrderedDict(
        (k, structure[k].detach() if isinstance(structure[k], torch.Tensor) else structure[k])
        for k in keys)
    sd._metadata = getattr(structure, "_metadata", None)  # type: ignore[attr-defined]
    pp_size, pp_rank = _pp()
    sd[PARTIAL_KEY] = True
    sd[PP_SIZE_KEY] = pp_size
    sd[PP_RANK_KEY] = pp_rank
    sd[PARTITION_KEY] = dict(model._assignment)
    _add_tp_meta(sd)
    return sd


def _format_key_errors(missing: Iterable[str], unexpected: Iterable[str], kind: str) -> str:
    parts = []
    missing, unexpected = list(missing), list(unexpected)
    if missing:
        parts.append(f"Missing key(s) in {kind} state_dict: {', '.join(map(repr, missing))}.")
    if unexpected:
        parts.append(f"Unexpected key(s) in {kind} state_dict: {', '.join(map(repr, unexpected))}.")
    return " ".join(parts)


def _check_partition(model: nn.Module, meta: Dict[str, Any]) -> None:
    saved = meta.get(PARTITION_KEY)
    if saved is None:
        return
    now = model._assignment
    moved = [(name, saved.get(name), now.get(name)) for name in sorted(set(saved) | set(now))
             if saved.get(name, 0) != now.get(name, 0)]
    if moved:
        desc = ", ".join(f"{n or '<root>'}: saved on pp rank {a}, now on {b}"
                         for n, a, b in moved[:5])
        raise SMPValidationError(
            f"DistributedModel.load_state_dict: this partial state dict was saved under a "
            f"different partition ({desc}{' ...' if len(moved) > 5 else ''}). Partial checkpoints "
            "need the same partition: use manual partitioning (smp.partition / set_partition) so "
            "it is the same in both jobs, or save and load a full checkpoint")


def _apply_model(model: nn.Module, meta: Dict[str, Any], body: "OrderedDict[str, Any]",
                 strict: bool) -> _IncompatibleKeys:
    partial = _is_partial(meta)
    if partial:
        _check_partition(model, meta)
    structure, local = _local_entries(model)
    expected = local if partial else list(structure)
    expected_set = set(expected)
    missing = [k for k in expected if k not in body]
    unexpected = [k for k in body if k not in expected_set]
    if strict and (missing or unexpected):
        kind = f"partial (pp rank {model._pp_rank})" if partial else "full"
        raise RuntimeError(
            f"Error(s) in loading state_dict for DistributedModel: "
            f"{_format_key_errors(missing, unexpected, kind)}")
    to_load: "OrderedDict[str, Any]" = OrderedDict((k, body[k]) for k in local if k in body)
    metadata = getattr(body, "_metadata", None)
    if metadata is not None:
        to_load._metadata = metadata  # type: ignore[attr-defined]
    # The module's own loader copies into the existing Parameter objects (param.copy_) and runs
    # modules' load hooks; non-local entries are simply not offered to it.
    model.module.load_state_dict(to_load, strict=False)
    return _IncompatibleKeys(missing, unexpected)


def model_load_state_dict(model: nn.Module, sd: Dict[str, Any],
                          strict: bool = True) -> _IncompatibleKeys:
    """Load a full or partial state dict; see the module docstring for when it applies."""
    meta, body = _split_meta(sd)
    if _is_partial(meta):
        _check_partial_meta(meta, "DistributedModel.load_state_dict")
        if not model.partitioned:
            logger.info("DistributedModel.load_state_dict: partial state dict kept until the "
                        "model is partitioned (first step); keys are checked then")
            _defer(model, lambda: _apply_model(model, meta, body, strict))
            return _IncompatibleKeys([], [])
        return _apply_model(model, meta, body, strict)
    if not model.partitioned or model._pp_size == 1:
        # The module is whole: load it now, with torch's own strict checks.
        return model.module.load_state_dict(body, strict=strict)
    return _apply_model(model, meta, body, strict)


# Optimizer ------------------------------------------------------------------------------------
def _param_indices(optimizer: torch.optim.Optimizer) -> Dict[int, int]:
    """id(param) -> index, exactly as torch's Optimizer.state_dict() numbers parameters."""
    mapping: Dict[int, int] = {}
    start = 0
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"], start):
            mapping.setdefault(id(p), i)
        start += len(group["params"])
    return mapping


def _local_indices(dopt: torch.optim.Optimizer) -> Optional[Set[int]]:
    """Indices of this rank's parameters; None when every parameter is local."""
    model = state.model
    if model is None or model._pp_size == 1:
        return None
    model._require_partitioned("DistributedOptimizer.local_state_dict")
    mapping = _param_indices(dopt.optimizer)
    return {mapping[id(p)] for p in model.local_parameters() if id(p) in mapping}


def _param_name(index: int, dopt: torch.optim.Optimizer) -> str:
    model = state.model
    params = [p for g in dopt.optimizer.param_groups for p in g["params"]]
    if model is None or index >= len(params):
        return f"index {index}"
    names = {id(p): n for n, p in model.module.named_parameters()}
    return f"index {index} ({names.get(id(params[index]), 'not a model parameter')})"


def optimizer_state_dict(dopt: torch.optim.Optimizer) -> Dict[str, Any]:
    """The full optimizer state in torch's format; a PP-group collective when pp > 1 (and a
    DP-group one with shard_optimizer_state)."""
    sd = dopt._torch_state_dict(gather=True)
    model = state.model
    if model is None or model._pp_size == 1 or not model.partitioned:
        sd = _to_cpu(sd)
        _gather_tp_optimizer_state(dopt, sd["state"])
        return sd
    local = _local_indices(dopt)
    mine = {i: _to_cpu(v) for i, v in sd["state"].items() if i in local}
    _gather_tp_optimizer_state(dopt, mine)
    merged: Dict[int, Any] = {}
    for part in allgather(mine, CommGroup.PP_GROUP):
        for i, v in part.items():
            merged.setdefault(i, v)
    out = {"state": {i: merged[i] for i in sorted(merged)},
           "param_groups": _to_cpu(sd["param_groups"])}
    out.update({k: v for k, v in sd.items() if k.startswith(_META_PREFIX)})
    return out


def _sharded_params(dopt: torch.optim.Optimizer) -> Dict[int, torch.Tensor]:
    """index -> parameter, for the tensor-parallel shards among the optimizer's parameters."""
    params = [p for g in dopt.optimizer.param_groups for p in g["params"]]
    out: Dict[int, torch.Tensor] = {}
    for i, p in enumerate(params):
        if tp_shard.is_sharded(p):
            out.setdefault(i, p)
    return out


def _gather_tp_optimizer_state(dopt: torch.optim.Optimizer, st: Dict[int, Any]) -> None:
    """Full tensors, in place, for the per-parameter state tensors shaped like a shard (e.g.
    Adam's moments); a collective of the TP group when tp > 1."""
    if state.topology.tp_size == 1:
        return
    sharded = _sharded_params(dopt)
    mine = {(i, name): v for i, entry in st.items() if i in sharded
            for name, v in entry.items()
            if isinstance(v, torch.Tensor) and v.shape == sharded[i].shape and v.dim() > 0}
    parts = allgather(mine, CommGroup.TP_GROUP)
    for (i, name) in mine:
        st[i][name] = tp_shard.unshard([part[(i, name)] for part in parts],
                                       tp_shard.split_of(sharded[i]))


def _shard_optimizer_state(dopt: torch.optim.Optimizer, st: Dict[int, Any]) -> Dict[int, Any]:
    """This rank's slices of the full per-parameter state tensors of tensor-parallel shards."""
    topo = state.topology
    if topo.tp_size == 1:
        return st
    out = {}
    sharded = _sharded_params(dopt)
    for i, entry in st.items():
        p = sharded.get(i)
        if p is None or not isinstance(entry, dict):
            out[i] = entry
            continue
        split = tp_shard.split_of(p)
        full = list(p.shape)
        full[split.dim] *= topo.tp_size
        out[i] = {name: (tp_shard.shard(v, split, topo.tp_rank, topo.tp_size)
                         if isinstance(v, torch.Tensor) and list(v.shape) == full else v)
                  for name, v in entry.items()}
    return out


def optimizer_local_state_dict(dopt: torch.optim.Optimizer,
                               gather_if_shard: bool = True) -> Dict[str, Any]:
    """This rank's optimizer state (global indices) plus the partial-dict metadata."""
    sd = dopt._torch_state_dict(gather=gather_if_shard)
    local = _local_indices(dopt)
    if local is not None:
        sd["state"] = {i: v for i, v in sd["state"].items() if i in local}
    pp_size, pp_rank = _pp()
    sd[PARTIAL_KEY] = True
    sd[PP_SIZE_KEY] = pp_size
    sd[PP_RANK_KEY] = pp_rank
    _add_tp_meta(sd)
    return sd


def _apply_optimizer(dopt: torch.optim.Optimizer, meta: Dict[str, Any],
                     body: Dict[str, Any]) -> None:
    if "state" not in body or "param_groups" not in body:
        raise SMPValidationError(
            "DistributedOptimizer.load_state_dict: expected a torch optimizer state dict with "
            f"'state' and 'param_groups', got keys {sorted(map(str, body))[:8]}")
    local = _local_indices(dopt)
    saved_state = body["state"]
    if local is not None:
        if _is_partial(meta):
            foreign = [i for i in saved_state if i not in local]
            if foreign:
                raise SMPValidationError(
                    f"DistributedOptimizer.load_state_dict: the partial state holds parameter "
                    f"{_param_name(foreign[0], dopt)}, which is not local to pp rank "
                    f"{_pp()[1]}: it was saved under a different partition. Load a full "
                    "optimizer state (optimizer.state_dict()) instead")
        saved_state = {i: v for i, v in saved_state.items() if i in local}
    # torch's loader checks the group structure, casts state to each parameter's device/dtype
    # and replaces the wrapped optimizer's `state`/`param_groups` (which DistributedOptimizer
    # reads through, so lr schedulers keep working).
    if not _is_partial(meta):
        saved_state = _shard_optimizer_state(dopt, saved_state)
    dopt.optimizer.load_state_dict({"state": saved_state, "param_groups": body["param_groups"]})


def optimizer_load_state_dict(dopt: torch.optim.Optimizer, sd: Dict[str, Any]) -> None:
    meta, body = _split_meta(sd)
    if _is_partial(meta):
        _check_partial_meta(meta, "DistributedOptimizer.load_state_dict")
    model = state.model
    if model is not None and not model.partitioned:
        logger.info("DistributedOptimizer.load_state_dict: kept until the model is partitioned")
        _defer(model, lambda: _apply_optimizer(dopt, meta, body))
        return
    _apply_optimizer(dopt, meta, body)
