"""Weight gradients of `nn.Linear` accumulated in place across a step's microbatches.

Plain autograd gives every microbatch's backward of a linear layer a fresh weight gradient
(`dW = dY^T X`, a new weight-sized tensor) and then adds it to `.grad`: for a microbatch of a few
rows that is two passes over weight-sized memory for little arithmetic, and on a CPU it costs more
than the layer's forward. A pipeline runs every layer once per microbatch, so this is where small
microbatches lose most of their efficiency. Here a pipeline stage's linear layers instead add
`dY^T X` straight into one buffer per weight (`addmm_`, one pass), and the buffers become `.grad`
when the rank's backward work for the step is over: the same sum over microbatches, in the same
order, without the copies.

Used only where its flush is certain: a `nn.Linear` owned by this rank, run inside a pipeline step
(the step's end flushes before any gradient reduction). Everything else takes the ordinary path:
no grad, autocast, fp16/bf16 weights, double backward (`create_graph`), tensor subclasses, and
weights with hooks of their own (their hooks expect one call per microbatch).
`SMSHIM_FUSED_WGRAD=0` turns it off.
"""

from __future__ import annotations

import os
import threading
from typing import Callable, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

ENV = "SMSHIM_FUSED_WGRAD"
# Reduced-precision weights keep autograd's path: one rounding per microbatch's addition into a
# bf16/fp16 .grad, as single-process training does (addmm_ would round differently).
_FULL = (torch.float32, torch.float64)


def enabled_by_env() -> bool:
    return os.environ.get(ENV, "1") != "0"


class WeightGradAccumulator:
    """A step's pending weight (and bias) gradients, keyed by parameter."""

    def __init__(self) -> None:
        self._pending: Dict[int, tuple] = {}  # id(param) -> (param, buffer)
        self._lock = threading.Lock()
        # Set for the length of a pipeline step, whose end flushes: a forward runs fused only
        # then (and so does its recomputation under activation checkpointing, in the same step).
        self.active = False

    def add(self, param: torch.Tensor,
            fn: Callable[[Optional[torch.Tensor]], Optional[torch.Tensor]]) -> None:
        """Accumulate into `param`'s gradient: `fn(target)` adds into `target` in place, or
        (target None) returns a new tensor holding the contribution."""
        with self._lock:
            grad = param.grad
            if grad is not None:  # an existing .grad (no zero_grad, or set_to_none=False)
                fn(grad)
                return
            entry = self._pending.get(id(param))
            if entry is None:
                self._pending[id(param)] = (param, fn(None))
            else:
                fn(entry[1])

    def flush(self) -> None:
        """Hand the pending buffers over as `.grad` (added to one that appeared meanwhile)."""
        # Under the lock: `add` may run meanwhile on another thread (pp_rank 0's glue code runs
        # outside the compute lock) and must not add into a .grad being set or added to here.
        with self._lock, torch.no_grad():
            pending, self._pending = self._pending, {}
            for param, buf in pending.values():
                if param.grad is None:
                    param.grad = buf
                else:
                    param.grad.add_(buf)

    def __bool__(self) -> bool:
        return bool(self._pending)


class _LinearAccumulating(torch.autograd.Function):
    @staticmethod
    def forward(ctx, acc: WeightGradAccumulator, x: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.acc = acc
        # The parameters themselves: under activation checkpointing the saved tensors come back
        # as recomputed aliases, whose .grad is not the parameter's.
        ctx.params = (weight, bias)
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        w_param, b_param = ctx.params
        need_x, need_w, need_b = ctx.needs_input_grad[1:4]
        grad_x = grad_out.matmul(weight) if need_x else None
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        if torch.is_grad_enabled():
            # create_graph: the gradients must be part of the graph; return them as autograd does.
            return (None, grad_x, g2.t().mm(x2) if need_w else None,
                    g2.sum(0) if need_b else None)
        if need_w:
            ctx.acc.add(w_param, lambda t: g2.t().mm(x2) if t is None else t.addmm_(g2.t(), x2))
        if need_b:
            ctx.acc.add(b_param, lambda t: g2.sum(0) if t is None else t.add_(g2.sum(0)))
        return None, grad_x, None, None


def _plain(param: Optional[torch.Tensor]) -> bool:
    """A parameter the fused path may take: a plain dense tensor with no hooks of its own."""
    if param is None:
        return True
    if type(param) not in (nn.Parameter, torch.Tensor) or param.is_sparse:
        return False
    if param._backward_hooks:
        return False
    hooks = param._post_accumulate_grad_hooks
    return not hooks or all(getattr(h, "_smshim_reducer", False) for h in hooks.values())


def fused_forward(module: nn.Linear, acc: WeightGradAccumulator
                  ) -> Callable[[torch.Tensor], torch.Tensor]:
    """An instance `forward` for `module`: fused while `acc` is active (inside a step)."""
    cls_forward = type(module).forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        w, b = module.weight, module.bias
        if (not acc.active or not torch.is_grad_enabled() or not w.requires_grad
                or torch.is_autocast_enabled() or not _plain(w) or not _plain(b)
                or type(x) is not torch.Tensor or x.dtype != w.dtype or w.dtype not in _FULL):
            return cls_forward(module, x)
        return _LinearAccumulating.apply(acc, x, w, b)

    forward.__name__ = "forward"
    return forward


def install(modules: Dict[str, nn.Module], owned: Callable[[str], bool],
            acc: WeightGradAccumulator) -> list:
    """Give this rank's plain `nn.Linear` modules the fused forward; returns them (to undo)."""
    if not enabled_by_env():
        return []
    done = []
    for name, module in modules.items():
        if type(module) is nn.Linear and "forward" not in module.__dict__ and owned(name):
            module.forward = fused_forward(module, acc)
            done.append(module)
    return done


def uninstall(modules: list) -> None:
    for module in modules:
        module.__dict__.pop("forward", None)
