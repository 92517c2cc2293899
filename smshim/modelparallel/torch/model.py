"""`smp.DistributedModel`: wraps the user's module, partitions it at the first step, and runs it.

With pp = 1 there is nothing to partition: the model is "partitioned" at construction and a step
is a plain loop over microbatches, with no threads or messages. With pp > 1, the first step
decides the partition (partitioner.py; pp_rank 0 decides and broadcasts), frees the parameters
and buffers of modules this rank does not own, and builds the Pipeline (pipeline.py) that runs
every later step.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from smshim.runtime import devices as _devices
from smshim.runtime import launch as _runtime

from smshim.modelparallel.torch.pipeline import activation_checkpointing
from smshim.modelparallel.torch.pipeline import partitioner
from smshim.modelparallel.torch.comm import CommGroup
from smshim.modelparallel.torch.precision.mixed_precision import cast_model, config_dtype
from smshim.modelparallel.torch.errors import (BwdExecutionNotInStepFnError, FwdExecutionNotInStepFnError,
                     MultipleDistributedModelError, SMPRuntimeError, SMPUnsupportedError)
from smshim.modelparallel.torch.checkpointing import state_dicts
from smshim.modelparallel.torch.tensor_parallel import replace as tensor_parallel
from smshim.modelparallel.torch.tensor_parallel import collectives as tp_comm
from smshim.modelparallel.torch.tensor_parallel import shard as tp_shard
from smshim.modelparallel.torch.pipeline import channels
from smshim.modelparallel.torch.pipeline.pipeline import Pipeline
from smshim.reducer.grad_reducer import GradReducer
from smshim.modelparallel.torch.pipeline.context import ctx
from smshim.modelparallel.torch.sharded_data_parallel import fsdp as sdp
from smshim.modelparallel.torch.state import require_init, state
from smshim.timeline.recorder import from_env as _timeline_from_env

logger = logging.getLogger(__name__)


class _HookHandle:
    def __init__(self, hooks: list, fn: Callable) -> None:
        self._hooks, self._fn = hooks, fn

    def remove(self) -> None:
        if self._fn in self._hooks:
            self._hooks.remove(self._fn)


class DistributedModel(nn.Module):
    """The model-parallel wrapper; see SPEC §2. One per process."""

    def __init__(self, module: nn.Module, trace_device: str = "gpu",
                 trace_execution_times: bool = False, trace_memory_usage: bool = False,
                 overlapping_allreduce: bool = True, backward_passes_per_step: int = 1,
                 average_grads_across_microbatches: bool = True, bucket_cap_mb: int = 25,
                 broadcast_buffers: bool = True, find_unused_parameters: bool = False,
                 gradient_as_bucket_view: bool = False) -> None:
        require_init("smp.DistributedModel")
        if state.model is not None:
            raise MultipleDistributedModelError(
                f"rank {state.topology.rank}: a DistributedModel already exists; smp supports one "
                "per process (call smp.reset() first to start over)")
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedModel wraps an nn.Module, got {type(module).__name__}")
        if trace_device not in ("cpu", "gpu"):
            raise ValueError(f"trace_device={trace_device!r}: use 'cpu' or 'gpu'")
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step} must be >= 1")
        super().__init__()
        # Modules marked for tensor parallelism become their smp.nn versions now, before the
        # optimizer (built from model.parameters()) and the partitioner see them.
        module = tensor_parallel.distribute(module)
        # fp16/bf16: every stage runs the model in the reduced dtype (mixed_precision.py);
        # sharded data parallelism keeps fp32 shards and lets FSDP cast for compute.
        sharded = state.cfg.sharded_data_parallel_degree > 1
        cast_model(module, torch.float32 if sharded and config_dtype(state.cfg) else
                   config_dtype(state.cfg))
        self.module = module
        self.trace_device = trace_device
        self.trace_execution_times = trace_execution_times
        self.trace_memory_usage = trace_memory_usage  # activation sizes are always traced
        self.average_grads_across_microbatches = average_grads_across_microbatches
        self.backward_passes_per_step = backward_passes_per_step
        self.overlapping_allreduce = overlapping_allreduce
        self.broadcast_buffers = broadcast_buffers
        self._ddp_options = dict(bucket_cap_mb=bucket_cap_mb,
                                 gradient_as_bucket_view=gradient_as_bucket_view,
                                 find_unused_parameters=find_unused_parameters)
        self._reducer: Optional[GradReducer] = None  # the DP group's (join() uses it)
        self._reducers: List[GradReducer] = []  # the DP group's and, with TP, the RDP group's
        self._tp_params: List[nn.Parameter] = []
        self._comm_hook: Optional[Tuple[Any, Callable]] = None
        self._steps_done = 0
        self._joining, self._join_rounds = False, 0
        self._post_partition_hooks: List[Callable] = []
        self._post_step_hooks: List[Callable] = []
        self._assignment: Optional[Dict[str, int]] = None
        self._pipeline: Optional[Pipeline] = None
        topo = state.topology
        self._pp_size = topo.pp_size
        self._pp_rank = topo.pp_rank
        self._device = _runtime.device()
        self._timeline = _timeline_from_env(topo.rank)
        self._groups: Optional[Tuple[dist.ProcessGroup, dist.ProcessGroup]] = None
        self._pair_groups: Optional[Dict[Tuple[int, int], dist.ProcessGroup]] = None
        # sharded_data_parallel_degree > 1: the module under FSDP, kept out of the submodules
        # (self.module stays the user's module, holding the same Parameter objects).
        self.__dict__["_sdp_module"] = None
        if self._pp_size > 1:
            # CUDA tensors' own groups (channels.py): NCCL when each rank has a GPU of its own.
            pair_backend = channels.channel_backend(_devices.device_backend(), os.environ)
            # Gloo groups for pipeline messages only (nothing else's tags on them; gloo carries
            # the frames and CPU tensors), one per direction (see transport.py), and the device
            # channel's pair groups. Every rank creates every PP group's, in the same order.
            for ranks in topo.all_groups(CommGroup.PP_GROUP):
                gs = tuple(dist.new_group(ranks, timeout=_runtime.timeout(), backend="gloo")
                           for _ in range(2))
                pairs = (channels.create_pair_groups(ranks, topo.rank, pair_backend,
                                                     _runtime.timeout())
                         if pair_backend is not None else None)
                if topo.rank in ranks:
                    self._groups, self._pp_ranks = gs, list(ranks)
                    self._pair_groups = pairs
                    self._pair_backend = pair_backend
        else:
            self._assignment = {name: 0 for name, _ in module.named_modules(remove_duplicate=False)}
            module.to(self._device)
            if sharded:
                self._setup_sharded_data_parallel()
            else:
                self._setup_data_parallel()
        state.model = self
        self._reset_handle = state.register_reset_callback(self._on_reset)

    # ---- properties and accessors -------------------------------------------------------------
    @property
    def partitioned(self) -> bool:
        return self._assignment is not None

    def get_module(self) -> nn.Module:
        return self.module

    def _require_partitioned(self, what: str) -> None:
        if not self.partitioned:
            raise SMPRuntimeError(
                f"{what}() is only available after partitioning, which happens at the first call "
                "of the @smp.step function")

    def _is_local(self, module_name: str) -> bool:
        return self._assignment.get(module_name, 0) == self._pp_rank

    def local_named_modules(self) -> Iterator[Tuple[str, nn.Module]]:
        self._require_partitioned("local_named_modules")
        for name, m in self.module.named_modules():
            if self._is_local(name):
                yield name, m

    def local_modules(self) -> Iterator[nn.Module]:
        for _, m in self.local_named_modules():
            yield m

    def local_named_parameters(self) -> Iterator[Tuple[str, nn.Parameter]]:
        self._require_partitioned("local_named_parameters")
        seen = set()
        for name, m in self.module.named_modules():
            if not self._is_local(name):
                continue
            for pname, p in m.named_parameters(recurse=False):
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{name}.{pname}" if name else pname), p

    def local_parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.local_named_parameters():
            yield p

    def local_named_buffers(self) -> Iterator[Tuple[str, torch.Tensor]]:
        self._require_partitioned("local_named_buffers")
        for name, m in self.module.named_modules():
            if self._is_local(name):
                for bname, b in m.named_buffers(recurse=False):
                    yield (f"{name}.{bname}" if name else bname), b

    def local_buffers(self) -> Iterator[torch.Tensor]:
        for _, b in self.local_named_buffers():
            yield b

    def is_local_parameter(self, p: torch.Tensor) -> bool:
        return any(p is q for q in self.local_parameters())

    # ---- hooks --------------------------------------------------------------------------------
    def register_post_partition_hook(self, fn: Callable) -> _HookHandle:
        self._post_partition_hooks.append(fn)
        return _HookHandle(self._post_partition_hooks, fn)

    def register_post_step_hook(self, fn: Callable) -> _HookHandle:
        """`fn(model, optimizer)` runs once, right after the next @smp.step call returns."""
        self._post_step_hooks.append(fn)
        return _HookHandle(self._post_step_hooks, fn)

    # ---- execution ----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if ctx.tracing:
            return self.module(*args, **kwargs)
        if self._pp_size > 1 and not ctx.in_step:
            raise FwdExecutionNotInStepFnError(
                "with pipeline_parallel_degree > 1 the DistributedModel can only be called inside "
                "an @smp.step function")
        wrapped = self._sdp_module
        return (self.module if wrapped is None else wrapped)(*args, **kwargs)

    def backward(self, tensors: Any, grad_tensors: Any = None) -> None:
        """Replaces `loss.backward()` inside an @smp.step function."""
        if not ctx.in_step:
            raise BwdExecutionNotInStepFnError(
                "model.backward() can only be called inside an @smp.step function")
        if ctx.tracing:
            return  # the partitioning trace runs forward only
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if grad_tensors is None:
            grad_tensors = [None] * len(tensors)
        elif isinstance(grad_tensors, torch.Tensor):
            grad_tensors = [grad_tensors]
        grads = []
        scale = 1.0 / self._num_mb if self.average_grads_across_microbatches else 1.0
        # fp16/bf16: the loss is scaled here (smp scripts call model.backward(loss), never
        # scaler.scale(loss)); the optimizer unscales before its step.
        scaler = getattr(state.optimizer, "loss_scaler", None)
        if scaler is not None:
            scale *= scaler.scale
        # Scaling each microbatch's gradient by 1/m averages over microbatches without touching
        # gradients accumulated before this step.
        for t, g in zip(tensors, grad_tensors):
            if g is None:
                if t.numel() != 1:
                    raise ValueError("model.backward: grad_tensors is needed for a non-scalar tensor")
                # From the metadata only: `t` may be a handle to a loss on another rank, whose
                # value rank 0 does not need for the backward. (`full`: ones times the scale,
                # rounded to the dtype alike, in one op.)
                grads.append(torch.full(t.shape, scale, dtype=t.dtype, device=t.device))
            else:
                grads.append(g * scale if scale != 1.0 else g)
        if self._pipeline is not None:
            self._pipeline.backward(tensors, grads)
        else:
            torch.autograd.backward(tensors, grads)

    # ---- the step (called by smp.step) -------------------------------------------------------
    def _run_step(self, fn: Callable, mb_inputs: Sequence[Tuple[tuple, dict]]) -> List[Any]:
        # Plain attributes set every step: skip nn.Module.__setattr__'s parameter/module checks.
        self.__dict__["_num_mb"] = len(mb_inputs)
        if not self.partitioned:
            self._partition(fn, mb_inputs)
        elif self._pipeline is None and not getattr(self, "_ckpt_applied", False):
            # pp = 1 is partitioned at construction; marks made until the first step count.
            activation_checkpointing.apply_marks(self)
        try:
            if self._pipeline is None:
                results = self._run_local(fn, mb_inputs)
                self._reduce_gradients_if_due()
                return results
            if self._pp_rank == 0:
                return self._pipeline.run(fn, mb_inputs)
            return self._pipeline.serve(len(mb_inputs))
        finally:
            self._steps_done += 1

    def _run_local(self, fn: Callable, mb_inputs) -> List[Any]:
        results = []
        step = getattr(self, "_local_step", 0)
        for mb, (args, kwargs) in enumerate(mb_inputs):
            ctx.step, ctx.microbatch, ctx.in_step = step, mb, True
            state.microbatch = mb
            try:
                results.append(fn(*args, **kwargs))
            finally:
                ctx.in_step = False
        self.__dict__["_local_step"] = step + 1
        return results

    def _after_step(self) -> None:
        # A post-step hook runs once, after the next step (Hugging Face registers one to load
        # optimizer state once the model is partitioned, and never removes it).
        hooks, self._post_step_hooks[:] = list(self._post_step_hooks), []
        for fn in hooks:
            fn(self, state.optimizer)

    # ---- partitioning -------------------------------------------------------------------------
    def _partition(self, fn: Callable, mb_inputs) -> None:
        """Global rank 0 (pp_rank 0 of replica 0) decides; every rank of the job adopts the same
        decision, so the pipeline replicas hold the same modules and their DP groups line up."""
        cfg = state.cfg
        decision = [None]
        if state.topology.rank == 0:
            try:
                if cfg.auto_partition:
                    trace = self._trace(fn, mb_inputs[0])
                    decision[0] = partitioner.auto_assignment(
                        self.module, trace, self._pp_size, cfg.memory_weight,
                        self.trace_execution_times)
                else:
                    decision[0] = partitioner.manual_assignment(
                        self.module, self._pp_size, cfg.default_partition)
            except BaseException as e:  # tell the other ranks instead of leaving them waiting
                decision[0] = e
        dist.broadcast_object_list(decision, src=0, group=state.object_group)
        if isinstance(decision[0], BaseException):
            if state.topology.rank == 0:
                raise decision[0]
            raise SMPRuntimeError(f"partitioning failed on rank 0: {decision[0]}")
        self._apply_partition(decision[0])

    def _trace(self, fn: Callable, first_mb: Tuple[tuple, dict]) -> partitioner.Trace:
        """One microbatch's forward with hooks, on pp_rank 0, leaving no trace in the model:
        RNG state and buffers (e.g. BatchNorm statistics) are restored afterwards."""
        device = torch.device("cuda") if (self.trace_device == "gpu" and torch.cuda.is_available()) \
            else torch.device("cpu")
        rng = torch.get_rng_state()
        buffers = {n: b.detach().clone() for n, b in self.module.named_buffers()}
        self.module.to(device)
        args, kwargs = first_mb

        def run():
            ctx.in_step, ctx.tracing, ctx.microbatch = True, True, 0
            try:
                with torch.no_grad():
                    fn(*args, **kwargs)
            finally:
                ctx.in_step, ctx.tracing = False, False

        try:
            trace = partitioner.trace_modules(self.module, run, self.trace_execution_times)
        finally:
            torch.set_rng_state(rng)
            with torch.no_grad():
                for n, b in self.module.named_buffers():
                    b.copy_(buffers[n])
        return trace

    def _apply_partition(self, assignment: Dict[str, int]) -> None:
        self._assignment = assignment
        if self._pp_rank == 0:
            logger.debug("module placement (name -> pp rank): %s", assignment)
        local_params = {id(p) for p in self.local_parameters()}
        freed = 0
        with torch.no_grad():
            for name, m in self.module.named_modules():
                if self._is_local(name):
                    for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
                        t.data = t.data.to(self._device)
                    continue
                for p in m.parameters(recurse=False):
                    if id(p) not in local_params and p.numel():
                        freed += p.numel()
                        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                for b in m.buffers(recurse=False):
                    b.data = torch.empty(0, dtype=b.dtype, device=b.device)
        logger.info("pp rank %d keeps %d parameters, freed %d", self._pp_rank,
                    sum(p.numel() for p in self.local_parameters()), freed)
        # Before the pipeline's server captures the forwards it serves (activation_checkpointing).
        activation_checkpointing.apply_marks(self)
        self._pipeline = Pipeline(
            self.module, assignment, self._pp_ranks, self._pp_rank, self._groups,
            state.cfg.pipeline, state.cfg.active_microbatches, self._timeline,
            _runtime.timeout_seconds(), self._device, state.cfg.deterministic_server,
            None if self._pair_groups is None else channels.DeviceChannel(
                self._pp_rank, self._pp_ranks, self._pair_groups, self._device,
                everything=self._pair_backend == "gloo"))
        # Tensor-parallel collectives give the lock up while they wait (collectives.py says why).
        tp_comm.set_compute_lock(self._pipeline.lock)
        activation_checkpointing.serve_functions(self, self._pipeline.server)
        self._setup_data_parallel()
        for fn in list(self._post_partition_hooks):
            fn(self, state.optimizer)

    # ---- sharded data parallelism (sharded_data_parallel_degree > 1) ----------------------
    @property
    def sdp_layout(self) -> Optional["sdp.ShardLayout"]:
        """Where this rank sits among the shards, or None without sharded data parallelism."""
        return self.__dict__.get("_sdp_layout")

    def _setup_sharded_data_parallel(self) -> None:
        """The module under FSDP, sharded over replicas of k ranks (sharded_data_parallel/)."""
        topo = state.topology
        layout = sdp.ShardLayout(state.cfg.sharded_data_parallel_degree, topo.size, topo.rank)
        self.__dict__["_sdp_layout"] = layout
        self.__dict__["_sdp_module"] = sdp.wrap(self.module, layout, self._device,
                                                _runtime.timeout(), config_dtype(state.cfg))

    # ---- data parallelism across pipeline replicas (ddp: true) -------------------------------
    def _setup_data_parallel(self) -> None:
        """Make the replicas' copies of this partition identical and build its gradient reducers
        (the same bucketed reducer as smdistributed.dataparallel's DistributedDataParallel).

        With tensor parallelism the TP ranks of a stage hold different shards, so the parameters
        of the smp.nn modules ("TP-managed", tensor_parallel/shard.py) are made identical and averaged over
        the RDP group (the ranks holding the same shard), the others over the DP group. Unless
        prescaled_batch, a TP-managed gradient already sums the contributions of the TP group's
        tp_size batches (the modules gather them), so it is divided by tp_size as well: both
        kinds end as the average over all dp_size batches, as in single-process training."""
        topo = state.topology
        if topo.dp_size == 1:
            return
        named = list(self.local_named_parameters())
        buffers = list(self.local_named_buffers()) if self.broadcast_buffers else []
        tp_named = [(n, p) for n, p in named if tp_shard.is_tp_managed(p)]
        dp_named = [(n, p) for n, p in named if not tp_shard.is_tp_managed(p)]
        kinds = [(CommGroup.DP_GROUP, dp_named + buffers, dp_named)]
        if tp_named:
            kinds.append((CommGroup.RDP_GROUP, tp_named, tp_named))
        self._tp_params = [p for _, p in tp_named]
        reducers: List[GradReducer] = []
        self._reducer = None
        for kind, tensors, params in kinds:
            members = topo.group(kind)
            if len(members) == 1 or not tensors:
                continue
            group = state.process_group(kind)
            with torch.no_grad():
                for _, t in tensors:
                    dist.broadcast(t.data, members[0], group=group)
            if params:
                reducers.append(GradReducer([p for _, p in params], group,
                                            names=[n for n, _ in params], **self._ddp_options))
                if kind == CommGroup.DP_GROUP:
                    self._reducer = reducers[-1]
        self._reducers = reducers
        if self._comm_hook is not None:
            for r in reducers:
                r.register_comm_hook(*self._comm_hook)
        if self._pipeline is not None and self.overlapping_allreduce:
            # Each rank averages its gradients as soon as its own backward work for the step is
            # done, overlapping the other stages' backward (see Pipeline.on_local_backward_done).
            self._pipeline.reduce_early = self._reduce_gradients_if_due
        if self._pipeline is not None:
            self._pipeline.reduce_at_end = self._reduce_gradients_if_due

    def _reduce_gradients_if_due(self) -> None:
        """Average local gradients over the DP (RDP) group on every backward_passes_per_step-th
        step."""
        if (self._steps_done + 1) % self.backward_passes_per_step != 0:
            return
        if self._joining and self._reducer is not None:
            self._join_round(active=True)
        else:
            for r in self._reducers:
                r.finalize()
        if self._tp_params and tp_comm.gathers_batch():
            inv = 1.0 / state.topology.tp_size
            for p in self._tp_params:
                if p.grad is not None:
                    p.grad.mul_(inv)

    def _join_round(self, active: bool) -> int:
        """One reduction round inside `join()`: agree on how many replicas still train, reduce
        (a joined replica contributes zeros), and rescale to the average over the active ones.
        Returns the number of active replicas (0: everyone has joined, nothing was reduced)."""
        group = state.process_group(CommGroup.DP_GROUP)
        flag = torch.tensor([1 if active else 0], dtype=torch.int64)
        dist.all_reduce(flag, group=group)
        n_active = int(flag.item())
        if n_active == 0:
            return 0
        params = [p for p in self._reducer.params]
        if not active:
            for p in params:
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()
        self._reducer.finalize()
        if active:
            self._join_rounds += 1
            scale = state.topology.dp_size / n_active
            if scale != 1.0:
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(scale)
        else:
            for p in params:
                p.grad.zero_()  # the joined replica does not train on the others' gradients
        return n_active

    @contextlib.contextmanager
    def join(self) -> Iterator[None]:
        """Uneven inputs across DP replicas (ddp: true), as torch DDP's join: inside the context
        each gradient reduction first counts the replicas still training; a replica whose data
        ran out shadows the others' reductions with zero gradients when it leaves the context,
        until every replica has left; then all replicas take the parameters of the one that
        trained longest. Every rank of the job must enter and leave the context."""
        if state.topology.dp_size == 1:
            yield  # no data parallelism: nothing to even out
            return
        if self._sdp_module is not None:
            raise SMPUnsupportedError(
                f"rank {state.topology.rank}: DistributedModel.join() with "
                f"sharded_data_parallel_degree {state.cfg.sharded_data_parallel_degree} is not "
                "supported by smshim; give every data-parallel rank the same number of batches "
                "(drop_last=True)")
        if state.topology.tp_size > 1:
            raise SMPUnsupportedError(
                f"rank {state.topology.rank}: DistributedModel.join() with "
                f"tensor_parallel_degree {state.topology.tp_size} is not supported by smshim; "
                "give every data-parallel replica the same number of batches (drop_last=True)")
        self._joining, self._join_rounds = True, 0
        try:
            yield
            if self._reducer is None:
                raise SMPRuntimeError(
                    f"rank {state.topology.rank} left model.join() without running a step: every "
                    "replica must run at least one step (the first step partitions the model)")
            while self._join_round(active=False):
                pass
            self._sync_after_join()
        finally:
            self._joining = False

    def _sync_after_join(self) -> None:
        """Every replica takes the parameters of the replica that reduced the most rounds."""
        group = state.process_group(CommGroup.DP_GROUP)
        members = state.topology.group(CommGroup.DP_GROUP)
        rounds = torch.tensor([self._join_rounds * len(members) + members.index(state.topology.rank)],
                              dtype=torch.int64)
        dist.all_reduce(rounds, op=dist.ReduceOp.MAX, group=group)
        src = members[int(rounds.item()) % len(members)]
        with torch.no_grad():
            for _, t in list(self.local_named_parameters()) + list(self.local_named_buffers()):
                dist.broadcast(t.data, src, group=group)

    def register_comm_hook(self, state_: Any, hook: Callable) -> None:
        """torch DDP's communication hook, for the DP-group gradient reduction (ddp: true)."""
        if self._sdp_module is not None:
            raise SMPUnsupportedError(
                f"rank {state.topology.rank}: register_comm_hook with "
                f"sharded_data_parallel_degree {state.cfg.sharded_data_parallel_degree}: FSDP "
                "reduces the gradients, not smp's DDP reducer; remove the hook")
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook: a communication hook is already registered")
        self._comm_hook = (state_, hook)
        for r in self._reducers:
            r.register_comm_hook(state_, hook)

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> Dict[str, Any]:
        """The full model state, keys as the unwrapped module's, tensors on the CPU. With pp > 1
        after partitioning it is gathered over the PP group, and with tensor parallelism the
        shards over the TP group: call it on every rank of the MP group (rdp_rank 0). With
        sharded data parallelism it is gathered over every rank (call it on all) onto rank 0."""
        if self._sdp_module is not None:
            return sdp.full_model_state_dict(self._sdp_module)
        return state_dicts.model_state_dict(self, destination, prefix, keep_vars)

    def local_state_dict(self) -> Dict[str, Any]:
        """This rank's entries of the full state dict, with `_smp_is_partial: True` and the pp
        degree, pp rank and partition it was saved under. With sharded data parallelism: this
        rank's shard, marked with the degree and shard rank."""
        if self._sdp_module is not None:
            return sdp.local_model_state_dict(self.module, self.sdp_layout)
        return state_dicts.model_local_state_dict(self)

    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True):
        """Load a full or partial (`_smp_is_partial`) state dict; each rank takes its local
        entries. A partial dict given before partitioning is applied right after it. With
        sharded data parallelism a full dict is loaded on every rank (each keeps its shard)."""
        if self._sdp_module is not None:
            if sdp.SDP_KEY in state_dict:
                return sdp.load_local_model_state_dict(self.module, state_dict, self.sdp_layout,
                                                       strict)
            if state_dict.get(sdp.PARTIAL_KEY):
                raise SMPRuntimeError(
                    f"rank {state.topology.rank}: this partial state dict was saved without "
                    "sharded data parallelism; load a full one (partial=False)")
            return sdp.load_full_model_state_dict(self._sdp_module, state_dict, strict)
        return state_dicts.model_load_state_dict(self, state_dict, strict)

    def cpu(self) -> "DistributedModel":
        self.module.cpu()
        return self


    def _on_reset(self) -> None:
        self._reset_handle.remove()
        if self._pipeline is not None:
            tp_comm.set_compute_lock(None)
            self._pipeline.close()
            self._pipeline = None
