"""`smp.amp.GradScaler`: torch's GradScaler, with the inf/NaN check combined over the PP group.

Under pipeline parallelism each stage holds different parameters, so one stage can see an inf
gradient while the others do not. If each stage decided alone, some would step and some would not,
and their loss scales would drift apart (the gradients every stage sees are scaled by pp_rank 0's
scale). So the found-inf flag is maxed over the PP group before anyone decides: every stage skips
together and updates its scale identically.

Only pp_rank 0 computes the loss, so only it calls `scale()`; on the other ranks the scale is
initialised lazily (to the same `init_scale`) the first time unscale_/step/update needs it.
Works on CPU (torch.amp.GradScaler("cpu")) and on CUDA.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from smshim.modelparallel.torch.comm import CommGroup
from smshim.modelparallel.torch.precision.loss_scaler import agree_found_inf
from smshim.modelparallel.torch.state import state

__all__ = ["GradScaler"]


class GradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler whose found-inf check is combined over the PP group."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True,
                 device: Optional[str] = None) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)

    def _ensure_scale(self) -> None:
        if self._enabled and self._scale is None:
            dev = torch.device(self._device)
            if dev.type == "cuda" and dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            self._lazy_init_scale_growth_tracker(dev)

    def _unscale_grads_(self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> Dict[torch.device, torch.Tensor]:
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if not state.initialized or state.topology.pp_size == 1:
            return per_device
        local = max((float(t.item()) for t in per_device.values()), default=0.0)
        combined = agree_found_inf(local, CommGroup.PP_GROUP)
        if not per_device:  # this stage has no gradients: it still has to agree
            per_device = {found_inf.device: found_inf}
        for t in per_device.values():
            t.fill_(combined)
        return per_device

    def unscale_(self, optimizer: Any) -> None:
        self._ensure_scale()
        super().unscale_(optimizer)

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        self._ensure_scale()
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: Any = None) -> None:
        self._ensure_scale()
        super().update(new_scale)
