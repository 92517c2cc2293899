"""Activation checkpointing inside the smp pipeline, on torch.utils.checkpoint (non-reentrant).

`smp.set_activation_checkpointing(module, ...)` only marks the module. When the model is
partitioned (at construction for pp = 1, at the first step for pp > 1), `apply_marks` turns each
mark into checkpointed *units*: a unit runs `torch.utils.checkpoint.checkpoint(forward, ...,
use_reentrant=False)`, so only its inputs are kept and its activations are recomputed in its
backward. A unit runs on the rank that owns it: the wrapper is installed as the module's instance
`forward` before the pipeline's module server captures the forwards it serves, so the owner of a
module (pp_rank 0 or a remote rank answering requests) is the one that checkpoints and recomputes
it, and the other ranks' proxies just send requests.

A unit must lie wholly on one partition, because its recomputation re-runs its forward code and
that must not re-issue calls to other ranks (SPEC §7): with manual partitioning a unit that spans
partitions is an error naming it; with auto partitioning it is a warning and the unit runs without
checkpointing. With pp > 1 the root module's forward is glue code on pp_rank 0 and cannot be a unit.

On an `nn.Sequential`, `strategy` picks the units among its children: "each" (every child), 
"group_N" (N consecutive children at a time) or "contiguous" (maximal runs of children on the same
partition). A group owned by the rank running the Sequential is checkpointed in place; a group
owned by another rank is called there as one request to a served function named
"<sequential>#ckpt[a:b]" (ModuleServer.function_factory builds it on the owner), so the group is
recomputed where its activations were.

Functional forms: `smp.checkpoint(module, *args)` checkpoints one call (on the module's owner,
through "<module>#ckpt" when it lives elsewhere) and `smp.checkpoint_sequential(seq, input,
strategy)` runs a Sequential's children in checkpointed groups the same way.

`pack_args_as_tuple` exists for SageMaker's reentrant implementation, whose checkpointed function
could only take tensors; the non-reentrant checkpoint takes any arguments (tuples, keywords), so
modules that needed the flag run correctly without it and it has nothing left to do.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from smshim.modelparallel.torch.errors import SMPRuntimeError, SMPValidationError
from smshim.modelparallel.torch.pipeline.context import at_tp_region_depth, ctx
from smshim.modelparallel.torch.state import state

if TYPE_CHECKING:
    from smshim.modelparallel.torch.pipeline.server import ModuleServer

# `model` below is smp's DistributedModel, annotated as the nn.Module it is: naming the API's
# type would make the engine import the API.

logger = logging.getLogger(__name__)

__all__ = ["set_activation_checkpointing", "checkpoint", "checkpoint_sequential", "apply_marks"]

_MARK = "_smp_activation_checkpointing"
# Served-function names: "<module>#ckpt" and "<sequential>#ckpt[a:b]", with "-no-rng" after
# "#ckpt" when the caller asked for preserve_rng_state=False (the owner builds the function from
# the name alone).
_SUFFIX = "#ckpt"
_NO_RNG = "-no-rng"
_GROUP_NAME = re.compile(r"^(.*)#ckpt(-no-rng)?\[(\d+):(\d+)\]$")
_MODULE_NAME = re.compile(r"^(.*)#ckpt(-no-rng)?$")


def _served_name(base: str, preserve_rng_state: bool,
                 group: Optional[Tuple[int, int]] = None) -> str:
    name = base + _SUFFIX + ("" if preserve_rng_state else _NO_RNG)
    return name if group is None else f"{name}[{group[0]}:{group[1]}]"


@dataclass(frozen=True)
class CheckpointSpec:
    preserve_rng_state: bool = True
    pack_args_as_tuple: bool = False
    strategy: str = "each"


def _group_size(strategy: str) -> Optional[int]:
    """N for "group_N"; None for "each"/"contiguous"; ValueError otherwise."""
    if strategy in ("each", "contiguous"):
        return None
    m = re.fullmatch(r"group_(\d+)", strategy)
    if m is None or int(m.group(1)) < 1:
        raise SMPValidationError(
            f"activation checkpointing strategy={strategy!r} is invalid: use 'each', "
            "'contiguous' or 'group_N' with N >= 1 (e.g. 'group_2')")
    return int(m.group(1))


def _run_checkpointed(fn: Callable[..., Any], preserve_rng_state: bool, *args: Any,
                      **kwargs: Any) -> Any:
    # Without grad (evaluation, the partitioning trace) there is nothing to save or recompute.
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    # The recomputation runs in backward; it must see the tensor-parallel nesting of this call
    # (a module nested in a distributed module does not gather the TP ranks' batches).
    depth = ctx.tp_region_depth

    def at_this_depth(*a: Any, **k: Any) -> Any:
        with at_tp_region_depth(depth):
            return fn(*a, **k)

    return _torch_checkpoint(at_this_depth, *args, use_reentrant=False,
                             preserve_rng_state=preserve_rng_state, **kwargs)


# ---- marking --------------------------------------------------------------------------------
def set_activation_checkpointing(module: nn.Module, preserve_rng_state: bool = True,
                                 pack_args_as_tuple: bool = False, strategy: str = "each") -> None:
    """Recompute `module`'s activations in its backward (see the module docstring). Call after
    creating the module and before the model is partitioned."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"smp.set_activation_checkpointing expects an nn.Module, got "
                        f"{type(module).__name__}")
    _group_size(strategy)
    if strategy != "each" and not isinstance(module, nn.Sequential):
        raise SMPValidationError(
            f"smp.set_activation_checkpointing({type(module).__name__}, strategy={strategy!r}): "
            "strategies other than 'each' apply to the children of an nn.Sequential")
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        raise SMPValidationError(
            f"smp.set_activation_checkpointing: a {type(module).__name__} has no forward to "
            "checkpoint; mark the modules it holds")
    model = state.model if state.initialized else None
    if model is not None and model.partitioned and getattr(model, "_ckpt_applied", False):
        raise SMPRuntimeError(
            "smp.set_activation_checkpointing must be called before the model is partitioned "
            "(before smp.DistributedModel for pp = 1, before the first step for pp > 1)")
    setattr(module, _MARK, CheckpointSpec(preserve_rng_state, pack_args_as_tuple, strategy))


# ---- applying the marks at partitioning -------------------------------------------------------
@dataclass
class _Unit:
    name: str                 # module, or "<seq>#ckpt[a:b]" for a group
    modules: List[str]        # module names whose subtrees it covers
    spec: CheckpointSpec


def _subtree_owners(names: Sequence[str], assignment: Dict[str, int]) -> set:
    owners = set()
    for root in names:
        prefix = root + "." if root else ""
        owners.update(o for n, o in assignment.items() if n == root or n.startswith(prefix))
    return owners


def _children(seq: nn.Sequential, name: str) -> List[str]:
    return [f"{name}.{c}" if name else c for c, _ in seq.named_children()]


def _units(root: nn.Module, assignment: Dict[str, int]) -> List[Tuple[_Unit, str]]:
    """(unit, kind) for every mark: kind "module" (wrap the module) or "group"."""
    out: List[Tuple[_Unit, str]] = []
    for name, module in root.named_modules():
        spec = getattr(module, _MARK, None)
        if spec is None:
            continue
        if not isinstance(module, nn.Sequential) or spec.strategy == "each":
            if isinstance(module, nn.Sequential):
                for child in _children(module, name):
                    out.append((_Unit(child, [child], spec), "module"))
            else:
                out.append((_Unit(name, [name], spec), "module"))
            continue
        children = _children(module, name)
        n = _group_size(spec.strategy)
        if n is not None:
            bounds = [(i, min(i + n, len(children))) for i in range(0, len(children), n)]
        else:  # contiguous: runs of children with one owner
            bounds, start = [], 0
            for i in range(1, len(children) + 1):
                if i == len(children) or _subtree_owners([children[i]], assignment) != \
                        _subtree_owners([children[start]], assignment):
                    bounds.append((start, i))
                    start = i
        for a, b in bounds:
            out.append((_Unit(_served_name(name, spec.preserve_rng_state, (a, b)),
                              children[a:b], spec), "group"))
    return out


def _valid(unit: _Unit, assignment: Dict[str, int], pp_size: int) -> bool:
    """Does the unit lie on one partition? Manual partitioning: raise; auto: warn."""
    owners = _subtree_owners(unit.modules, assignment)
    whole_root = pp_size > 1 and "" in unit.modules
    if len(owners) <= 1 and not whole_root:
        return True
    what = (f"activation checkpointing of '{unit.name or '<root>'}': "
            + ("with pipeline_parallel_degree > 1 the root module's forward runs as glue code on "
               "pp_rank 0 and calls the other partitions" if whole_root else
               f"it spans pipeline partitions {sorted(owners)}, and a checkpointed module must lie "
               "wholly on one partition"))
    if not state.cfg.auto_partition:
        raise SMPValidationError(f"{what}; place it on one partition with smp.partition / "
                                 "smp.set_partition, or checkpoint its children instead")
    logger.warning("%s (auto partition); it runs without activation checkpointing", what)
    return False


def _wrap(module: nn.Module, spec: CheckpointSpec) -> None:
    real = module.forward  # the class's forward, or an instance forward set before
    if getattr(real, "_smp_checkpointed", False):
        return  # wrapped for an earlier DistributedModel of the same module (after smp.reset())

    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        return _run_checkpointed(real, spec.preserve_rng_state, *args, **kwargs)

    checkpointed_forward.__name__ = f"checkpointed_forward[{type(module).__name__}]"
    checkpointed_forward._smp_checkpointed = True  # type: ignore[attr-defined]
    module.forward = checkpointed_forward


def _install_group_forward(model: nn.Module, seq_name: str, seq: nn.Sequential,
                           groups: List[Tuple[_Unit, bool]]) -> None:
    """The Sequential's forward, running its children group by group."""
    assignment = model._assignment
    modules = dict(model.module.named_modules())
    plan = []
    for unit, ok in groups:
        children = [modules[c] for c in unit.modules]
        owner = next(iter(_subtree_owners(unit.modules, assignment)), 0)
        plan.append((unit, ok, children, owner))
    # Where the Sequential's forward runs (the root's: on pp_rank 0, its step body).
    here = 0 if seq_name == "" else assignment.get(seq_name, 0)

    def grouped_forward(x: Any) -> Any:
        pipeline = model._pipeline
        for unit, ok, children, owner in plan:
            if not ok or ctx.tracing:
                for c in children:
                    x = c(x)
            elif pipeline is not None and owner != here:
                # Run (and later recompute) the group on its owner, as one request.
                x = pipeline.server.call(unit.name, owner, (x,), {})
            else:
                x = _run_checkpointed(_sequence(children), unit.spec.preserve_rng_state, x)
        return x

    seq.forward = grouped_forward


def _sequence(children: Sequence[nn.Module]) -> Callable[[Any], Any]:
    def run(x: Any) -> Any:
        for c in children:
            x = c(x)
        return x

    return run


def apply_marks(model: nn.Module) -> None:
    """Install the checkpointing wrappers for every mark (before the pipeline's server captures
    the modules' forwards). Called once the partition is known."""
    if getattr(model, "_ckpt_applied", False):
        return
    model._ckpt_applied = True  # type: ignore[attr-defined]
    assignment = model._assignment
    modules = dict(model.module.named_modules())
    grouped: Dict[str, List[Tuple[_Unit, bool]]] = {}
    count = 0
    for unit, kind in _units(model.module, assignment):
        ok = _valid(unit, assignment, model._pp_size)
        if kind == "module":
            if ok:
                _wrap(modules[unit.name], unit.spec)
                count += 1
        else:
            seq_name = _GROUP_NAME.match(unit.name).group(1)
            grouped.setdefault(seq_name, []).append((unit, ok))
            count += ok
    for seq_name, groups in grouped.items():
        _install_group_forward(model, seq_name, modules[seq_name], groups)
    if count:
        logger.info("activation checkpointing: %d unit(s) on pipeline rank %d's model", count,
                    model._pp_rank)


def serve_functions(model: nn.Module, server: "ModuleServer") -> None:
    """Let the owner run "<module>#ckpt" and "<seq>#ckpt[a:b]" requests."""
    modules = dict(model.module.named_modules())

    def factory(name: str) -> Optional[Callable[..., Any]]:
        m = _GROUP_NAME.match(name)
        if m is not None:
            seq_name, preserve = m.group(1), m.group(2) is None
            a, b = int(m.group(3)), int(m.group(4))
            seq = modules.get(seq_name)
            if not isinstance(seq, nn.Sequential):
                return None
            names = _children(seq, seq_name)[a:b]
            run = _sequence([modules[n] for n in names])
            return lambda x: _run_checkpointed(run, preserve, x)
        m = _MODULE_NAME.match(name)
        if m is not None and m.group(1) in modules:
            real, preserve = server.real_forward(m.group(1)), m.group(2) is None
            return lambda *args, **kwargs: _run_checkpointed(real, preserve, *args, **kwargs)
        return None

    server.function_factory = factory


# ---- functional forms -------------------------------------------------------------------------
def _pipeline_context(module: nn.Module) -> Tuple[Optional[Any], str]:
    """(the model's pipeline, module name) when `module` belongs to a partitioned pp > 1 model."""
    model = state.model if state.initialized else None
    if model is None or model._pipeline is None:
        return None, ""
    names = model.__dict__.get("_ckpt_module_names")
    if names is None:  # built once: these calls run once per layer and microbatch
        names = {id(m): n for n, m in model.module.named_modules()}
        model.__dict__["_ckpt_module_names"] = names
    name = names.get(id(module))
    return (model._pipeline, name) if name is not None else (None, "")


def checkpoint(module: nn.Module, *args: Any, preserve_rng_state: bool = True) -> Any:
    """`module(*args)` with its activations recomputed in backward, on the rank that owns it."""
    pipeline, name = _pipeline_context(module)
    if pipeline is None or ctx.tracing:
        return _run_checkpointed(module, preserve_rng_state, *args)
    model = state.model
    unit = _Unit(name, [name], CheckpointSpec(preserve_rng_state))
    if not _valid(unit, model._assignment, model._pp_size):
        return module(*args)
    server = pipeline.server
    if server.is_proxied(module):
        return server.call(_served_name(name, preserve_rng_state), model._assignment.get(name, 0),
                           args, {})
    return _run_checkpointed(module, preserve_rng_state, *args)


def checkpoint_sequential(sequential_module: nn.Sequential, input: Any, strategy: str = "each",
                          preserve_rng_state: bool = True, pack_args_as_tuple: bool = False) -> Any:
    """Run an nn.Sequential's children in checkpointed groups chosen by `strategy`."""
    if not isinstance(sequential_module, nn.Sequential):
        raise TypeError(f"smp.checkpoint_sequential expects an nn.Sequential, got "
                        f"{type(sequential_module).__name__}")
    n = _group_size(strategy)
    children = list(sequential_module.children())
    pipeline, name = _pipeline_context(sequential_module)
    if pipeline is None or ctx.tracing:
        size = 1 if strategy == "each" else (n or len(children))
        x = input
        for a in range(0, len(children), size):
            x = _run_checkpointed(_sequence(children[a:a + size]), preserve_rng_state, x)
        return x
    model = state.model
    assignment = model._assignment
    names = _children(sequential_module, name)
    here = 0 if name == "" else assignment.get(name, 0)  # (the root runs on pp_rank 0)
    if strategy == "each":
        bounds = [(i, i + 1) for i in range(len(children))]
    elif n is not None:
        bounds = [(i, min(i + n, len(children))) for i in range(0, len(children), n)]
    else:
        bounds, start = [], 0
        for i in range(1, len(children) + 1):
            if i == len(children) or _subtree_owners([names[i]], assignment) != \
                    _subtree_owners([names[start]], assignment):
                bounds.append((start, i))
                start = i
    x = input
    for a, b in bounds:
        unit = _Unit(_served_name(name, preserve_rng_state, (a, b)), names[a:b],
                     CheckpointSpec(preserve_rng_state))
        if not _valid(unit, assignment, model._pp_size):
            for c in children[a:b]:
                x = c(x)
            continue
        owner = next(iter(_subtree_owners(names[a:b], assignment)), 0)
        if owner != here or any(pipeline.server.is_proxied(c) for c in children[a:b]):
            x = pipeline.server.call(unit.name, owner, (x,), {})
        else:
            x = _run_checkpointed(_sequence(children[a:b]), preserve_rng_state, x)
    return x
