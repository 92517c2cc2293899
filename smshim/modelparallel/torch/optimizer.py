"""`smp.DistributedOptimizer`: the user's optimizer, stepping only this rank's parameters.

It is a real `torch.optim.Optimizer` (lr schedulers check that) whose `param_groups`, `state` and
`defaults` are the wrapped optimizer's, read through properties: a scheduler changing a group's lr
changes the wrapped optimizer's, and the sharing survives `load_state_dict`, which makes torch
replace those objects. Parameters held by other pipeline ranks have no gradient here (their
storage was freed at partitioning), and torch optimizers skip parameters without a gradient: only
local parameters are stepped.

State dicts (state_dicts.py): `state_dict()` is the full state gathered over the PP group (a
collective), `local_state_dict()` this rank's part, `load_state_dict()` takes either and waits
for partitioning when needed.

With fp16/bf16 (mixed_precision.py) the step runs on fp32 master weights, with the loss scaled in
`model.backward` by `loss_scaler` (loss_scaler.py): the step unscales the gradients, agrees with
every rank of the job on overflow (`overflow`), and skips the step and lowers a dynamic scale
when one is found. With `shard_optimizer_state` (optimizer_sharding.py) each data-parallel
replica steps, and keeps optimizer state for, its share of the parameters.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional

import torch

from smshim.modelparallel.torch.checkpointing import state_dicts
from smshim.modelparallel.torch.comm import CommGroup, allgather
from smshim.modelparallel.torch.errors import SMPRuntimeError
from smshim.modelparallel.torch.precision.loss_scaler import LossScaler, agree_found_inf, make_loss_scaler
from smshim.modelparallel.torch.precision.mixed_precision import REDUCED, MasterWeights, config_dtype, upcast_state
from smshim.modelparallel.torch.checkpointing.optimizer_sharding import SHARD_DP_RANK_KEY, SHARD_DP_SIZE_KEY, ShardPlan
from smshim.modelparallel.torch.sharded_data_parallel import fsdp as sdp
from smshim.modelparallel.torch.state import require_init, state

logger = logging.getLogger(__name__)


def _shared(name: str) -> property:
    """An attribute that lives on the wrapped optimizer. Before `.optimizer` is set (inside
    torch's Optimizer.__init__) it is kept on this object instead."""
    own = f"_own_{name}"

    def get(self: "DistributedOptimizer") -> Any:
        inner = self.__dict__.get("optimizer")
        return getattr(inner, name) if inner is not None else self.__dict__.get(own)

    def set_(self: "DistributedOptimizer", value: Any) -> None:
        inner = self.__dict__.get("optimizer")
        if inner is not None:
            setattr(inner, name, value)
        else:
            self.__dict__[own] = value

    return property(get, set_)


class DistributedOptimizer(torch.optim.Optimizer):
    param_groups = _shared("param_groups")
    state = _shared("state")
    defaults = _shared("defaults")

    def __init__(self, optimizer: torch.optim.Optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, **dynamic_loss_args: Any) -> None:
        require_init("smp.DistributedOptimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        model = state.model
        if model is None:
            raise SMPRuntimeError("create the smp.DistributedModel before the DistributedOptimizer")
        in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [n for n, p in model.module.named_parameters()
                   if p.requires_grad and id(p) not in in_opt]
        if missing:
            raise RuntimeError(
                f"DistributedOptimizer: the optimizer does not hold the model parameter(s) "
                f"{missing[:5]}{' ...' if len(missing) > 5 else ''}; build it from "
                "model.parameters()")
        # torch's __init__ sets up the hook dictionaries; the placeholder group it needs is kept
        # aside (see _shared) and never used once `.optimizer` is set.
        torch.optim.Optimizer.__init__(self, [{"params": [torch.zeros(0, requires_grad=True)]}], {})
        self.optimizer = optimizer
        cfg = state.cfg
        self.reduced_dtype = config_dtype(cfg)
        # The loss is scaled only in mixed precision (SageMaker's FP16 optimizer exists only
        # then); in fp32 the arguments would change nothing, so say so instead of ignoring them.
        self.loss_scaler: Optional[LossScaler] = None
        if self.reduced_dtype is not None:
            self.loss_scaler = make_loss_scaler(static_loss_scale, dynamic_loss_scale,
                                                dynamic_loss_args)
        elif (static_loss_scale not in (None, 1.0)) or dynamic_loss_scale:
            logger.warning("DistributedOptimizer: static_loss_scale=%r / dynamic_loss_scale=%r "
                           "have no effect without \"fp16\" or \"bf16\" in the smp config (the "
                           "loss is not scaled in fp32)", static_loss_scale, dynamic_loss_scale)
        self.overflow = False
        self._masters = MasterWeights()
        self._shard: Optional[ShardPlan] = None
        self._unscaled = False  # this step's gradients are unscaled and checked already
        self._found_inf = False
        self._any_reduced: Optional[bool] = None
        # A model load replaces the reduced-precision weights: the masters follow them.
        model.module.register_load_state_dict_post_hook(lambda *_: self._masters.clear())
        optimizer.register_load_state_dict_post_hook(self._after_load)
        state.optimizer = self

    # ---- mixed precision / sharding ----------------------------------------------------------
    @property
    def shards_state(self) -> bool:
        """True when the optimizer state is partitioned over the data-parallel replicas."""
        return bool(state.cfg.shard_optimizer_state) and state.topology.rdp_size > 1

    def _local_params(self) -> List[torch.Tensor]:
        """The parameters this rank steps the gradients of (its pipeline stage's), in
        param_groups order."""
        model = state.model
        seen, out = set(), []
        local = None if model is None or model._pp_size == 1 else \
            {id(p) for p in model.local_parameters()}
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if id(p) not in seen and (local is None or id(p) in local):
                    seen.add(id(p))
                    out.append(p)
        return out

    def _mixed(self) -> bool:
        """fp32 masters are in play: fp16/bf16 configured, or reduced-precision parameters
        (e.g. created under smp.model_creation(dtype=...) in an fp32 config)."""
        if self.reduced_dtype is not None or self.loss_scaler is not None:
            return True
        if self._any_reduced is None:
            # Decided once and by every rank together: the step's overflow agreement is a
            # collective, so all stages must take the same path even if only one stage's
            # parameters are in a reduced dtype (a max over the job, as for found-inf flags).
            local = any(p.dtype in REDUCED for p in self._local_params())
            self._any_reduced = bool(agree_found_inf(1.0 if local else 0.0, CommGroup.WORLD))
        return self._any_reduced

    def _plan(self) -> Optional[ShardPlan]:
        if self.shards_state and self._shard is None:
            self._shard = ShardPlan([p for p in self._local_params() if p.requires_grad])
        return self._shard

    def _unscale_and_check(self) -> bool:
        """Unscale this step's gradients into fp32 and agree with every rank on overflow."""
        if self._unscaled:
            return self._found_inf
        self._unscaled = True
        if not self._mixed():
            self._found_inf = False
            return False
        inv = 1.0 / self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        local = self._masters.unscale_grads(self._local_params(), inv)
        # Every rank of the job, so that stages, replicas (and tensor-parallel shards) skip or
        # step together and keep the same loss scale.
        self._found_inf = bool(agree_found_inf(1.0 if local else 0.0, CommGroup.WORLD))
        return self._found_inf

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the (unscaled, fp32) master gradients by their global norm over the whole model
        (every pipeline stage; every tensor-parallel shard), as torch.nn.utils.clip_grad_norm_
        on the unpartitioned model would. Returns the norm (inf when the step overflowed, and
        then nothing is clipped: the step will be skipped). Call it on every rank."""
        require_init("DistributedOptimizer.clip_master_grads")
        if self._sdp_module() is not None:  # sharded: FSDP's exact norm over the shards
            self.__dict__["_clipped"] = True
            if self._sdp_unscale():
                return float("inf")
            return sdp.clip_grad_norm(self._sdp_module(), max_norm, norm_type)
        if self._unscale_and_check():
            return float("inf")
        params = self._local_params()
        grads = [g for g in (self._masters.grad(p) for p in params) if g is not None]
        # Each parameter counts once in the norm: over the MP group (pipeline stages x tensor-
        # parallel ranks) a tensor-parallel shard is a different piece on every TP rank, but any
        # other parameter is a copy on each TP rank, so only tp_rank 0 counts those. (Shards are
        # marked by tensor parallelism with `_smp_tp`, whose `dim` is not None.)
        counted = grads
        if state.topology.tp_size > 1 and state.topology.tp_rank != 0:
            counted = [g for p in params if (g := self._masters.grad(p)) is not None
                       and getattr(getattr(p, "_smp_tp", None), "dim", None) is not None]
        norm_type = float(norm_type)
        if norm_type == float("inf"):
            local = max((float(g.abs().max()) for g in counted), default=0.0)
            total = max(allgather(local, CommGroup.MP_GROUP)) if state.topology.mp_size > 1 \
                else local
        else:
            local = sum(float(torch.linalg.vector_norm(g, norm_type)) ** norm_type
                        for g in counted)
            # Data-parallel replicas hold copies of the same gradients: they are not added.
            parts = allgather(local, CommGroup.MP_GROUP) if state.topology.mp_size > 1 else [local]
            total = sum(parts) ** (1.0 / norm_type)
        coef = float(max_norm) / (total + 1e-6)
        if coef < 1.0:
            with torch.no_grad():
                for g in grads:
                    g.mul_(coef)
        return total

    def _sdp_module(self) -> Any:
        model = state.model
        return None if model is None else model.__dict__.get("_sdp_module")

    def _sdp_clip(self) -> None:
        """Sharded data parallelism clips the global gradient norm to sdp_gradient_clipping
        before every step (0: off), unless the script clipped this step's gradients itself."""
        limit = state.cfg.sdp_gradient_clipping
        if not self.__dict__.pop("_clipped", False) and limit > 0:
            sdp.clip_grad_norm(self._sdp_module(), limit)

    def _sdp_unscale(self) -> bool:
        """Sharded data parallelism with a loss scale (fp16/bf16): unscale this step's fp32
        gradient shards once and agree with every rank on overflow."""
        if self.loss_scaler is None:
            return False
        if not self._unscaled:
            self._unscaled = True
            local = sdp.unscale_and_check(self._local_params(), 1.0 / self.loss_scaler.scale)
            self._found_inf = bool(agree_found_inf(1.0 if local else 0.0, CommGroup.WORLD))
        return self._found_inf

    def _sdp_step(self, closure: Optional[Callable[[], float]]) -> Any:
        """The step of FSDP's fp32 shards: unscale and check (fp16/bf16), clip to
        sdp_gradient_clipping, step unless some rank overflowed."""
        try:
            self.overflow = self._sdp_unscale()
            if self.overflow:
                self.__dict__.pop("_clipped", None)
                logger.info("DistributedOptimizer: gradient overflow (inf/NaN) on some rank; "
                            "step skipped (loss scale %s)", self.loss_scaler.scale)
                result = None
            else:
                self._sdp_clip()
                result = self.optimizer.step(closure) if closure is not None \
                    else self.optimizer.step()
            if self.loss_scaler is not None:
                self.loss_scaler.update(self.overflow)
        finally:
            self._unscaled = False
        return result

    def step(self, closure: Optional[Callable[[], float]] = None):
        if self._sdp_module() is not None:
            return self._sdp_step(closure)
        plan = self._plan()
        mixed = self._mixed()
        if not mixed and plan is None:
            self._unscaled = False
            return self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        if closure is not None:
            raise SMPRuntimeError("DistributedOptimizer.step(closure): a closure is not supported "
                                  "with fp16/bf16 or shard_optimizer_state")
        try:
            if mixed:
                self.overflow = self._unscale_and_check()
            else:
                self.overflow = False
            if self.overflow:
                logger.info("DistributedOptimizer: gradient overflow (inf/NaN) on some rank; "
                            "step skipped (loss scale %s)",
                            self.loss_scaler.scale if self.loss_scaler else None)
            else:
                params = [p for p in self._local_params() if p.grad is not None]
                stepped = [p for p in params if plan is None or plan.owns(p)]
                skipped = [p for p in params if plan is not None and not plan.owns(p)]
                with self._masters.swapped(stepped if mixed else [], skipped):
                    self.optimizer.step()
                if plan is not None:
                    plan.broadcast_parameters()
            if self.loss_scaler is not None:
                self.loss_scaler.update(self.overflow)
        finally:
            self._unscaled = False
            self._masters.drop_grads()
        return None

    # The wrapped optimizer's step already runs torch's profiling record and step hooks: keep
    # torch from wrapping this one too (hooks would fire twice), and register hooks there.
    step.hooked = True  # type: ignore[attr-defined]

    def _after_load(self, _optimizer: torch.optim.Optimizer) -> None:
        plan = self._plan()
        if plan is not None:
            plan.drop_foreign_state(self.optimizer)
        upcast_state(self.optimizer, self._local_params())

    def _torch_state_dict(self, gather: bool = True) -> Dict[str, Any]:
        """The wrapped optimizer's state dict, with sharded state gathered over the DP group
        (`gather`, a collective) or marked as this replica's shard."""
        sd = self.optimizer.state_dict()
        plan = self._plan()
        if plan is not None:
            if gather:
                sd["state"] = plan.gather(sd["state"])
            else:
                sd[SHARD_DP_RANK_KEY] = plan.dp_rank
                sd[SHARD_DP_SIZE_KEY] = plan.dp_size
        if self.loss_scaler is not None:
            sd["_smp_loss_scaler"] = self.loss_scaler.state_dict()
        return sd

    def register_step_pre_hook(self, hook: Callable):
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable):
        return self.optimizer.register_step_post_hook(hook)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._unscaled = False
        self.__dict__.pop("_clipped", None)
        self._masters.drop_grads()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        """The full optimizer state, indexed like a torch optimizer over the unwrapped module's
        parameters. A collective over the PP group when pp > 1: call it on every pp rank. With
        sharded data parallelism it is gathered over every rank (call it on all) onto rank 0."""
        if self._sdp_module() is not None:
            return sdp.full_optim_state_dict(self._sdp_module(), self.optimizer)
        return state_dicts.optimizer_state_dict(self)

    def local_state_dict(self, gather_if_shard: bool = True) -> Dict[str, Any]:
        """This rank's optimizer state (`_smp_is_partial` marker, pp degree and rank included).
        With shard_optimizer_state, `gather_if_shard` collects the replicas' shards (a collective
        of the DP group: call it on every replica); False gives this replica's shard only.
        With sharded data parallelism: this rank's shard, marked with the degree and shard rank."""
        if self._sdp_module() is not None:
            return sdp.local_optim_state_dict(self.optimizer, state.model.sdp_layout)
        return state_dicts.optimizer_local_state_dict(self, gather_if_shard)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a full or partial state; applied after partitioning if the model is not yet."""
        scaler = state_dict.get("_smp_loss_scaler") if isinstance(state_dict, dict) else None
        if scaler is not None and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(scaler)
        if self._sdp_module() is not None:
            if sdp.SDP_KEY in state_dict:
                sdp.load_local_optim_state_dict(self.optimizer, state_dict, state.model.sdp_layout)
            else:
                sdp.load_full_optim_state_dict(self._sdp_module(), self.optimizer, state_dict)
            return
        state_dicts.optimizer_load_state_dict(self, state_dict)

    def __getstate__(self) -> Dict[str, Any]:
        # torch's version keeps only defaults/state/param_groups; the wrapped optimizer is needed.
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"
