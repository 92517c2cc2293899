"""Tensor-parallel collectives: which process group a tensor-parallel module talks on, and the four
autograd-aware collectives the `smp.nn` modules are built from.

Why one TP process group per microbatch. gloo matches collectives on a process group purely by
the order in which they are issued: the k-th collective of rank A on a group pairs with the k-th of
rank B. The pipeline engine runs several microbatches concurrently (pp_rank 0 drives one worker
thread per microbatch in flight; the other ranks serve module calls from a thread pool), and the
TP peers of a stage are driven by *different* pp_rank-0 ranks (each TP rank belongs to its own
pipeline), so the order in which TP peers run microbatch 0's and microbatch 1's modules can differ.
On one shared group that pairs microbatch 0's all-reduce on one rank with microbatch 1's on the
other: a deadlock (different sizes) or a silently wrong result (same sizes). Within one microbatch
the order is fixed: TP peers run the same model code on the same microbatch, its forward in program
order and its backward in autograd's order for identical graphs. So `init` creates, on every rank
in the same order, one group per (TP group, microbatch index: gloo on CPU, NCCL on GPUs) (`create_groups`), and every
collective here uses the group of the microbatch the calling thread is running (the engine's
per-thread `ctx.microbatch`). Steps do not overlap on a rank, so reusing the groups across steps is
safe. Outside a step (evaluation, state dicts) only one thread runs, and smp's own TP group is used.

Why not `torch.distributed.tensor.parallel` (ColwiseParallel / RowwiseParallel / SequenceParallel).
`parallelize_module` turns parameters into DTensors bound to one DeviceMesh, i.e. to one process
group, so all microbatches' collectives would go through that one group in thread-dependent order:
exactly the hazard above. The parameters here stay plain tensors holding this rank's shard (which is
also what the partitioner, the gradient reducer and the checkpoints move, reduce and gather), and
each module calls the Megatron-style region functions below on the current microbatch's group.
`torch.distributed.nn.functional` has all-reduce and all-gather with autograd, but not the pairs
needed here: its all_gather's backward reduce-scatters (sums) the gradients, while after a gather
whose consumers compute identical gradients on every rank the right backward is to take this rank's
slice; and the "identity forward, all-reduce backward" entry of a column-parallel region has no
counterpart. So the four functions below are written against `torch.distributed` directly.

Why collectives give up the compute lock. A pipeline rank runs one module at a time (the engine's
ComputeLock), but a TP collective waits on the network for the peer's matching call. If TP rank 0
runs microbatch 0's module while its peer runs microbatch 2's (their pipelines drive them at
different times), each would hold its lock while waiting for a peer that needs its own lock to
reach the matching call: a deadlock across ranks even with separate groups. So, like every other
network wait of the engine, a collective releases this rank's compute lock while it waits and
takes it back (same priority) afterwards (`set_compute_lock`, registered by the pipeline).

During the partitioning trace (only global rank 0 runs the model, without gradients) no collective
may be issued: each function then reproduces the collective's output shape locally.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from smshim.runtime import devices as _devices
from smshim.modelparallel.torch.comm import CommGroup
from smshim.modelparallel.torch.pipeline.context import at_tp_region_depth, ctx as _engine_ctx
from smshim.modelparallel.torch.state import state

logger = logging.getLogger(__name__)

__all__ = ["create_groups", "set_compute_lock", "current_group", "tp_world", "copy_to_tp",
           "reduce_from_tp", "gather_from_tp", "scatter_to_tp", "tracing", "region",
           "gathers_batch", "batch_in", "batch_out", "agree", "region_depth", "at_region_depth"]

# Microbatch index -> this rank's TP process group for that microbatch.
_mb_groups: Dict[int, Any] = {}
_compute_lock: Any = None  # the pipeline's ComputeLock, when a pipeline runs on this rank


def group_backend() -> str:
    """The backend of the per-microbatch groups: NCCL when the job computes on GPUs of their own
    (`smshim.runtime.devices`; the TP collectives' tensors live on the compute device), else gloo
    (on the CPU, and when ranks share a GPU, which NCCL refuses). The NCCL groups' collectives
    are issued in thread-dependent order across groups, as on gloo; each group has its own
    communicator and stream, so one microbatch's collective never queues behind another's."""
    return _devices.device_backend() or "gloo"


def create_groups(tp_groups: List[List[int]], my_group: List[int], microbatches: int,
                  timeout: Any, backend: Optional[str] = None) -> None:
    """Create one group per (TP group, microbatch), on `backend` (default: `group_backend()`).
    A collective over the whole job: every rank calls it with the same arguments, in the same
    place of `smp.init`."""
    _mb_groups.clear()
    if len(my_group) == 1:
        return
    backend = backend or group_backend()
    for mb in range(microbatches):
        for members in tp_groups:
            group = dist.new_group(members, backend=backend, timeout=timeout)
            if members == my_group:
                _mb_groups[mb] = group
    logger.debug("created %d tensor-parallel %s groups per microbatch for %d microbatches",
                 len(tp_groups), backend, microbatches)


def set_compute_lock(lock: Any) -> None:
    """The pipeline registers its ComputeLock (None when it closes); see the module docstring."""
    global _compute_lock
    _compute_lock = lock


def _network_wait() -> Any:
    lock = _compute_lock
    return lock.released() if lock is not None else contextlib.nullcontext()


def _ctx() -> Any:
    # The engine's per-thread execution context (which microbatch this thread runs, tracing).
    return _engine_ctx


def tracing() -> bool:
    """True while the partitioning trace runs the model on one rank: no collectives then."""
    return bool(getattr(_ctx(), "tracing", False))


def current_group() -> Any:
    """The TP process group for the microbatch this thread is running."""
    c = _ctx()
    if c.in_step and c.microbatch in _mb_groups:
        return _mb_groups[c.microbatch]
    return state.process_group(CommGroup.TP_GROUP)


def tp_world() -> Tuple[int, int]:
    """(tp_rank, tp_size) of this rank; (0, 1) before smp.init (the modules then act unsplit)."""
    if not state.initialized:
        return 0, 1
    topo = state.topology
    return topo.tp_rank, topo.tp_size


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous().clone()
    if tp_world()[1] > 1 and not tracing():
        group = current_group()
        with _network_wait():
            dist.all_reduce(x, group=group)
    return x


def _all_gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    _, size = tp_world()
    x = x.contiguous()
    if size == 1:
        return x
    if tracing():
        return torch.cat([x] * size, dim=dim)
    parts = [torch.empty_like(x) for _ in range(size)]
    group = current_group()
    with _network_wait():
        dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _my_chunk(x: torch.Tensor, dim: int) -> torch.Tensor:
    rank, size = tp_world()
    n = x.shape[dim]
    if n % size:
        raise ValueError(f"tensor parallelism: dimension {dim} of size {n} is not divisible by "
                         f"tensor_parallel_degree {size} (rank {state.topology.rank})")
    k = n // size
    return x.narrow(dim, rank * k, k).contiguous()


def agree(obj: Any) -> List[Any]:
    """Every TP rank's `obj` (picklable, small), in tp_rank order, on the current microbatch's
    group: lets the ranks check, before gathering their batches, that they are about to issue
    the same collectives (a hang otherwise)."""
    _, size = tp_world()
    if size == 1 or tracing():
        return [obj] * size
    out: List[Any] = [None] * size
    group = current_group()
    with _network_wait():
        dist.all_gather_object(out, obj, group=group)
    return out


class _CopyToTP(torch.autograd.Function):
    """Entry of a column-parallel region: identity forward; backward sums the input gradient
    over the TP ranks (each computed only its part of the consumers)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _all_reduce(g)


class _ReduceFromTP(torch.autograd.Function):
    """Exit of a row-parallel region: sum of the ranks' partial results; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _all_reduce(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g


class _GatherFromTP(torch.autograd.Function):
    """Concatenate the ranks' pieces along `dim`; the gradient of the whole is the same on every
    rank (its consumers are replicated), so backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.dim = dim
        return _all_gather(x, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):  # type: ignore[override]
        return _my_chunk(g, ctx.dim), None


class _ScatterToTP(torch.autograd.Function):
    """Keep this rank's slice along `dim`; backward gathers the slices' gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.dim = dim
        return _my_chunk(x, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):  # type: ignore[override]
        return _all_gather(g, ctx.dim), None


def copy_to_tp(x: torch.Tensor) -> torch.Tensor:
    return _CopyToTP.apply(x)


def reduce_from_tp(x: torch.Tensor) -> torch.Tensor:
    return _ReduceFromTP.apply(x)


def gather_from_tp(x: torch.Tensor, dim: int) -> torch.Tensor:
    return _GatherFromTP.apply(x, dim)


def scatter_to_tp(x: torch.Tensor, dim: int) -> torch.Tensor:
    return _ScatterToTP.apply(x, dim)


# Batch gathering (prescaled_batch false) ------------------------------------------------------
class region:
    """`with region() as outer:` around a distributed module's forward. `outer` is True for the
    outermost distributed module of a nest, which alone gathers the TP ranks' batches at entry
    and hands each rank its rows back at exit (nested modules already see the gathered batch)."""

    def __enter__(self) -> bool:
        depth = _engine_ctx.tp_region_depth
        _engine_ctx.tp_region_depth = depth + 1
        return depth == 0

    def __exit__(self, *exc: Any) -> None:
        _engine_ctx.tp_region_depth -= 1


def region_depth() -> int:
    """How many distributed modules' forwards this thread is inside."""
    return _engine_ctx.tp_region_depth


at_region_depth = at_tp_region_depth


def gathers_batch() -> bool:
    """Whether distributed modules gather the TP ranks' batches: unless `prescaled_batch`, the TP
    ranks of a group hold different data (SPEC §7)."""
    return tp_world()[1] > 1 and not state.cfg.prescaled_batch


def batch_in(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """At the entry of the outermost distributed module: the TP group's batches, concatenated in
    tp_rank order along dim 0. Backward keeps this rank's rows: every rank's module computes the
    same complete input gradient, because `batch_out`'s backward gives it the whole batch's
    output gradient."""
    if x is None or not gathers_batch():
        return x
    return gather_from_tp(x, 0)


def batch_out(y: torch.Tensor) -> torch.Tensor:
    """At the exit of the outermost distributed module: this rank's rows of the result."""
    if not gathers_batch():
        return y
    return scatter_to_tp(y, 0)
