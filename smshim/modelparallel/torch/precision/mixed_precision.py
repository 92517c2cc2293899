"""Mixed precision (config `fp16` / `bf16`, `smp.model_creation(dtype=)`): the model's parameters
and compute are in the reduced dtype; the DistributedOptimizer steps fp32 master copies.

How the optimizer step uses the masters without a second parameter list: for each parameter it
steps, the parameter's `.data` is swapped for its fp32 master and its `.grad` for the unscaled
fp32 gradient, the wrapped torch optimizer steps, and the result is copied back into the
reduced-precision parameter. So the wrapped optimizer keeps indexing its state by the model's own
Parameter objects (state dicts, lr schedulers and partial checkpoints keep working unchanged),
and its state (Adam's moments, momentum) is created and kept in fp32. The swap happens between
@smp.step calls, when no pipeline thread touches the parameters.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

logger = logging.getLogger(__name__)

__all__ = ["REDUCED", "config_dtype", "cast_model", "creation_dtype", "MasterWeights"]

REDUCED = (torch.float16, torch.bfloat16)


def config_dtype(cfg) -> Optional[torch.dtype]:
    """The reduced dtype the smp config asks for, or None (fp32 training)."""
    if cfg.fp16:
        return torch.float16
    if cfg.bf16:
        return torch.bfloat16
    return None


def cast_model(module: nn.Module, dtype: Optional[torch.dtype]) -> None:
    """Cast the module's floating-point parameters and buffers to `dtype` (nn.Module.to leaves
    integer buffers alone). Done before partitioning, so every stage runs in that dtype."""
    if dtype is None:
        return
    if any(p.is_floating_point() and p.dtype != dtype for p in module.parameters()):
        logger.info("smp: casting the model's floating-point parameters and buffers to %s", dtype)
    module.to(dtype)


@contextlib.contextmanager
def creation_dtype(dtype: Optional[torch.dtype]) -> Iterator[None]:
    """Modules created inside get floating-point parameters of `dtype` (torch's default dtype is
    what nn.Linear & co. allocate with); the previous default comes back on exit."""
    if dtype is None:
        yield
        return
    if not dtype.is_floating_point:
        raise TypeError(f"smp.model_creation(dtype={dtype}): dtype must be a floating-point type")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class MasterWeights:
    """fp32 master copies of reduced-precision parameters and their unscaled fp32 gradients."""

    def __init__(self) -> None:
        self._weights: Dict[int, torch.Tensor] = {}
        self._grads: Dict[int, torch.Tensor] = {}

    def clear(self) -> None:
        """Forget the masters (after the model's weights were loaded from elsewhere): they are
        taken again from the parameters at the next step."""
        self._weights.clear()
        self._grads.clear()

    def weight(self, p: torch.Tensor) -> torch.Tensor:
        w = self._weights.get(id(p))
        if w is None or w.shape != p.shape:
            w = p.detach().to(torch.float32).clone()
            self._weights[id(p)] = w
        return w

    def has(self, p: torch.Tensor) -> bool:
        return id(p) in self._weights

    def unscale_grads(self, params: Iterable[torch.Tensor], inv_scale: float) -> bool:
        """fp32 gradients = the parameters' gradients times `inv_scale`; True if any is inf/NaN.
        fp32 parameters are unscaled in place (their gradient is the master gradient)."""
        found_inf = False
        self._grads.clear()
        for p in params:
            if p.grad is None:
                continue
            if p.dtype in REDUCED:
                g = p.grad.detach().to(torch.float32)
                if inv_scale != 1.0:
                    g.mul_(inv_scale)
                self._grads[id(p)] = g
            else:
                g = p.grad.detach()
                if inv_scale != 1.0:
                    g.mul_(inv_scale)
            if not found_inf and not bool(torch.isfinite(g).all()):
                found_inf = True
        return found_inf

    def grad(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """The unscaled fp32 gradient of `p` (after unscale_grads)."""
        g = self._grads.get(id(p))
        return g if g is not None else (p.grad if p.dtype not in REDUCED else None)

    def drop_grads(self) -> None:
        self._grads.clear()

    @contextlib.contextmanager
    def swapped(self, stepped: List[torch.Tensor], skipped: List[torch.Tensor]) -> Iterator[None]:
        """Inside: every reduced-precision parameter in `stepped` holds its fp32 master (data) and
        fp32 gradient; parameters in `skipped` have no gradient (torch optimizers skip them).
        On exit the masters are copied back into the parameters and everything is restored."""
        saved: List[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]] = []
        hidden: List[Tuple[torch.Tensor, Optional[torch.Tensor]]] = []
        try:
            for p in stepped:
                if p.dtype in REDUCED and id(p) in self._grads:
                    saved.append((p, p.data, p.grad))
                    p.data = self.weight(p)
                    p.grad = self._grads[id(p)]
            for p in skipped:
                hidden.append((p, p.grad))
                p.grad = None
            yield
        finally:
            with torch.no_grad():
                for p, low, grad in saved:
                    master = p.data
                    p.data = low
                    low.copy_(master)
                    p.grad = grad
            for p, grad in hidden:
                p.grad = grad


def upcast_state(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> None:
    """torch's Optimizer.load_state_dict casts floating state to each parameter's dtype; the state
    of a reduced-precision parameter belongs to its fp32 master, so cast it back to fp32."""
    for p in params:
        if p.dtype not in REDUCED or p not in optimizer.state:
            continue
        for k, v in optimizer.state[p].items():
            if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "step":
                optimizer.state[p][k] = v.to(torch.float32)
