"""`smp.DistributedOptimizer`: the user's optimizer, stepping only this rank's parameters.

It is a real `torch.optim.Optimizer` (lr schedulers check that) that shares `param_groups`,
`state` and `defaults` with the wrapped optimizer, so a scheduler changing a group's lr changes
the wrapped optimizer's. Parameters held by other pipeline ranks have no gradient here (their
storage was freed at partitioning), and torch optimizers skip parameters without a gradient: only
local parameters are stepped.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional

import torch

from .errors import SMPRuntimeError, SMPUnsupportedError
from .state import require_init, state

logger = logging.getLogger(__name__)


class DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, optimizer: torch.optim.Optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, **dynamic_loss_args: Any) -> None:
        require_init("smp.DistributedOptimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if static_loss_scale != 1.0 or dynamic_loss_scale:
            raise SMPUnsupportedError(
                "static_loss_scale/dynamic_loss_scale are fp16 features, which smshim does not "
                "implement; use smp.amp.GradScaler or fp32")
        model = state.model
        if model is None:
            raise SMPRuntimeError("create the smp.DistributedModel before the DistributedOptimizer")
        in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [n for n, p in model.module.named_parameters()
                   if p.requires_grad and id(p) not in in_opt]
        if missing:
            raise RuntimeError(
                f"DistributedOptimizer: the optimizer does not hold the model parameter(s) "
                f"{missing[:5]}{' ...' if len(missing) > 5 else ''}; build it from model.parameters()")
        # Share, not copy: the Optimizer machinery (hooks, zero_grad, lr schedulers) works on
        # these attributes, and the wrapped optimizer must see every change.
        torch.optim.Optimizer.__init__(self, [{"params": [torch.zeros(0, requires_grad=True)]}], {})
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.defaults = optimizer.defaults
        self._pending_state_dict: Optional[Dict[str, Any]] = None
        state.optimizer = self

    def step(self, closure: Optional[Callable[[], float]] = None):
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        if state.topology.pp_size > 1:
            raise SMPUnsupportedError(
                "the full optimizer state_dict of a pipeline-partitioned model is not implemented "
                "yet; use local_state_dict()")
        return self.optimizer.state_dict()

    def local_state_dict(self, gather_if_shard: bool = True) -> Dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"
