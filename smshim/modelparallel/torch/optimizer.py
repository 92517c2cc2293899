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
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional

import torch

from . import state_dicts
from .errors import SMPRuntimeError, SMPUnsupportedError
from .state import require_init, state

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
                f"{missing[:5]}{' ...' if len(missing) > 5 else ''}; build it from "
                "model.parameters()")
        # torch's __init__ sets up the hook dictionaries; the placeholder group it needs is kept
        # aside (see _shared) and never used once `.optimizer` is set.
        torch.optim.Optimizer.__init__(self, [{"params": [torch.zeros(0, requires_grad=True)]}], {})
        self.optimizer = optimizer
        state.optimizer = self

    def step(self, closure: Optional[Callable[[], float]] = None):
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    # The wrapped optimizer's step already runs torch's profiling record and step hooks: keep
    # torch from wrapping this one too (hooks would fire twice), and register hooks there.
    step.hooked = True  # type: ignore[attr-defined]

    def register_step_pre_hook(self, hook: Callable):
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable):
        return self.optimizer.register_step_post_hook(hook)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        """The full optimizer state, indexed like a torch optimizer over the unwrapped module's
        parameters. A collective over the PP group when pp > 1: call it on every pp rank."""
        return state_dicts.optimizer_state_dict(self)

    def local_state_dict(self, gather_if_shard: bool = True) -> Dict[str, Any]:
        """This rank's optimizer state (`_smp_is_partial` marker, pp degree and rank included).
        `gather_if_shard` has no effect: smshim does not shard optimizer state."""
        return state_dicts.optimizer_local_state_dict(self)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a full or partial state; applied after partitioning if the model is not yet."""
        state_dicts.optimizer_load_state_dict(self, state_dict)

    def __getstate__(self) -> Dict[str, Any]:
        # torch's version keeps only defaults/state/param_groups; the wrapped optimizer is needed.
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"
