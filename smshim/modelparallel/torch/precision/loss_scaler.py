"""Loss scaling for `smp.DistributedOptimizer(static_loss_scale=, dynamic_loss_scale=,
**dynamic_loss_args)`, and the one place where ranks agree on whether a step overflowed.

Why agreement matters: under pipeline parallelism each stage holds different parameters, so one
stage can see an inf gradient while the others do not. If each decided alone, some stages would
step and some would not, and their loss scales would drift apart (every stage's gradients are
scaled by the scale pp_rank 0 used for the loss). So the flag is maxed over a group before anyone
decides. `smp.amp.GradScaler` combines over the PP group; DistributedOptimizer over every rank of
the job (pipeline stages, data-parallel replicas and tensor-parallel shards at once).

Dynamic scaling follows the documented smp v1 / FP16_Optimizer behaviour: on overflow the step
is skipped and the scale divided by `scale_factor` (not below `min_scale`), except that with
`delayed_shift` = k > 1 the first k - 1 overflows in a row only use up that hysteresis; after
`scale_window` steps without overflow the scale is multiplied by `scale_factor`.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

from smshim.modelparallel.torch.comm import CommGroup, allgather
from smshim.modelparallel.torch.state import state

logger = logging.getLogger(__name__)

__all__ = ["agree_found_inf", "LossScaler", "make_loss_scaler"]


def agree_found_inf(local: float, group: int = CommGroup.WORLD) -> float:
    """The largest found-inf flag (0.0 or 1.0) over `group`; a collective of that group.
    Without smp initialised, or alone in the group, the local flag."""
    if not state.initialized or len(state.topology.group(group)) == 1:
        return float(local)
    return max(float(x) for x in allgather(float(local), group))


class LossScaler:
    """A static loss scale (`dynamic=False`) or a dynamic one. `scale` multiplies the loss's
    gradient in `model.backward`; `update(overflow)` runs once per optimizer step."""

    DYNAMIC_ARGS = ("init_scale", "scale_factor", "scale_window", "min_scale", "delayed_shift",
                    "consecutive_hysteresis")

    def __init__(self, static_scale: float = 1.0, dynamic: bool = False,
                 init_scale: float = 2.0 ** 32, scale_factor: float = 2.0,
                 scale_window: int = 1000, min_scale: float = 1.0, delayed_shift: int = 1,
                 consecutive_hysteresis: bool = False) -> None:
        if dynamic:
            if init_scale <= 0 or scale_factor <= 1 or scale_window < 1 or min_scale <= 0 \
                    or delayed_shift < 1:
                raise ValueError(
                    f"dynamic_loss_args: init_scale={init_scale} (> 0), scale_factor={scale_factor}"
                    f" (> 1), scale_window={scale_window} (>= 1), min_scale={min_scale} (> 0), "
                    f"delayed_shift={delayed_shift} (>= 1): a value is out of range")
        elif static_scale <= 0:
            raise ValueError(f"static_loss_scale={static_scale} must be > 0")
        self.dynamic = dynamic
        self.scale = float(init_scale if dynamic else static_scale)
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.delayed_shift = int(delayed_shift)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.hysteresis = self.delayed_shift
        self.iteration = 0
        self.last_overflow_iteration = -1

    def update(self, overflow: bool) -> None:
        """After a step: a static scale never changes; a dynamic one backs off on overflow and
        grows after `scale_window` clean steps."""
        if self.dynamic:
            if overflow:
                if self.delayed_shift == 1 or self.hysteresis == 1:
                    self.scale = max(self.scale / self.scale_factor, self.min_scale)
                else:
                    self.hysteresis -= 1
                self.last_overflow_iteration = self.iteration
            else:
                if self.consecutive_hysteresis:
                    self.hysteresis = self.delayed_shift
                if (self.iteration - self.last_overflow_iteration) % self.scale_window == 0:
                    if not self.consecutive_hysteresis:
                        self.hysteresis = self.delayed_shift
                    self.scale *= self.scale_factor
        self.iteration += 1

    def state_dict(self) -> Dict[str, Any]:
        return {"scale": self.scale, "iteration": self.iteration, "hysteresis": self.hysteresis,
                "last_overflow_iteration": self.last_overflow_iteration}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.scale = float(sd["scale"])
        self.iteration = int(sd["iteration"])
        self.hysteresis = int(sd["hysteresis"])
        self.last_overflow_iteration = int(sd["last_overflow_iteration"])

    def __repr__(self) -> str:
        return f"LossScaler(scale={self.scale}, dynamic={self.dynamic})"


def make_loss_scaler(static_loss_scale: Optional[float], dynamic_loss_scale: bool,
                     dynamic_loss_args: Dict[str, Any]) -> LossScaler:
    """The scaler DistributedOptimizer's arguments describe. Scripts pass the arguments either
    as keywords or as one `dynamic_loss_args={...}` dict (the AWS GPT-2 script does the latter)."""
    args = dict(dynamic_loss_args)
    nested = args.pop("dynamic_loss_args", None)
    if nested:
        args.update(nested)
    unknown = sorted(set(args) - set(LossScaler.DYNAMIC_ARGS))
    if unknown:
        raise TypeError(f"DistributedOptimizer: unknown dynamic_loss_args {unknown}; allowed: "
                        f"{', '.join(LossScaler.DYNAMIC_ARGS)}")
    if not dynamic_loss_scale and args:
        logger.warning("DistributedOptimizer: dynamic_loss_args %s are unused without "
                       "dynamic_loss_scale=True", sorted(args))
        args = {}
    static = 1.0 if static_loss_scale is None else float(static_loss_scale)
    return LossScaler(static, dynamic_loss_scale, **args)
