"""Weight gradients of `nn.Linear` (and of Hugging Face's `Conv1D`, GPT-2's projections)
accumulated in place across a step's microbatches, computed off the pipeline's critical path.

Plain autograd gives every microbatch's backward of a linear layer a fresh weight gradient
(`dW = dY^T X`, a new weight-sized tensor) and then adds it to `.grad`: for a microbatch of a few
rows that is two passes over weight-sized memory for little arithmetic, and on a CPU it costs more
than the layer's forward. A pipeline runs every layer once per microbatch, so this is where small
microbatches lose most of their efficiency. Here a pipeline stage's linear layers run an autograd
function whose backward returns only the input gradient and keeps `dY` and `X`; the weight
gradients are computed later, when the rank has nothing else to run (the pipeline's bubbles, as
in zero-bubble schedules), a group of microbatches in one product added into one buffer per
weight, and the buffers become `.grad` when the rank's backward work for the step is over. The
same sum over microbatches (grouped: the rounding differs as between microbatch sizes, and is the
same every run), and the input gradient reaches the previous stage a weight gradient sooner. The
rows kept for a weight never outgrow the weight itself (past that, they are computed at once); a
microbatch with that many rows on its own takes autograd's path, whose backward is C++.

Used only where its flush is certain: a `nn.Linear` or `Conv1D` owned by this rank, run inside a
pipeline step (the step's end flushes before any gradient reduction). Everything else takes the
ordinary path: no grad, autocast, fp16/bf16 weights, double backward (`create_graph`), tensor
subclasses, weights with hooks of their own (their hooks expect one call per microbatch), and
small weights (fewer than `SMSHIM_FUSED_WGRAD_MIN_NUMEL` elements, 128 Ki by default: there the
path's Python costs more than it saves). `SMSHIM_FUSED_WGRAD=0` turns it off;
`SMSHIM_FUSED_WGRAD=eager` (and `deterministic_server`) computes each microbatch's weight
gradient in its backward, into the same buffer.
"""
from __future__ import annotations

import collections
import os
import threading
from typing import Callable, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

ENV = "SMSHIM_FUSED_WGRAD"
MIN_NUMEL_ENV = "SMSHIM_FUSED_WGRAD_MIN_NUMEL"
# Weights with fewer elements keep autograd's path: the fused path's Python (an autograd.Function
# and the bookkeeping, ~60-80 us per layer and microbatch on a busy CPU) costs more than the pass
# over a small weight it saves. Measured in one process, 8 microbatches of 8 or 32 rows, a
# d x 4d layer: d = 64 and 128 (16K, 64K elements) ran 1.2-1.4x slower fused, d = 256 (256K)
# 0.90-1.01x, d = 512 0.46-0.79x.
DEFAULT_MIN_NUMEL = 1 << 17
# Reduced-precision weights keep autograd's path: one rounding per microbatch's addition into a
# bf16/fp16 .grad, as single-process training does (addmm_ would round differently).
_FULL = (torch.float32, torch.float64)


def enabled_by_env() -> bool:
    return os.environ.get(ENV, "1") != "0"


def min_numel_by_env() -> int:
    """The smallest weight (in elements) the fused path takes (`SMSHIM_FUSED_WGRAD_MIN_NUMEL`)."""
    raw = os.environ.get(MIN_NUMEL_ENV)
    if raw is None or raw == "":
        return DEFAULT_MIN_NUMEL
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{MIN_NUMEL_ENV}={raw!r}: expected a number of weight elements >= 0 "
                         f"(default {DEFAULT_MIN_NUMEL}; 0 fuses every weight)")
    return value


def deferred_by_env() -> bool:
    """`SMSHIM_FUSED_WGRAD=eager` computes each microbatch's weight gradient in its backward."""
    return os.environ.get(ENV, "1") != "eager"


class WeightGradAccumulator:
    """A step's pending weight (and bias) gradients, keyed by parameter.

    With `deferred` (the default), a linear layer's backward only keeps `dY` and `X` for its
    weight gradient and returns the input gradient at once: the previous stage gets it sooner
    (the weight gradient is off the pipeline's critical path, as in zero-bubble schedules). Kept
    microbatches are grouped, in the order they came, until a group has `GROUP_ROWS` rows (a
    product of a few rows costs a pass over the weight-sized gradient each); `compute_one`
    computes the oldest complete group when the rank has nothing else to do, `flush` the rest.
    Groups depend only on the order and sizes of the microbatches, never on timing, so a run
    repeated gives the same bits. Rows kept for a weight never outgrow the weight itself: past
    that, its groups are computed at once."""

    GROUP_ROWS = 64

    def __init__(self, deferred: bool = True) -> None:
        self._pending: Dict[int, tuple] = {}  # id(param) -> (param, buffer)
        # Weight gradients not yet computed (products a^T b, see add_product): the group being
        # filled, per parameter, as id(param) -> [param, [a], [b], rows]; complete groups
        # (key, param, [a], [b]), oldest first; rows kept per parameter.
        self._open: Dict[int, list] = {}
        self._ready: "collections.deque[tuple]" = collections.deque()
        self._rows: collections.Counter = collections.Counter()
        self._queued: collections.Counter = collections.Counter()  # complete groups, per key
        self._lock = threading.Condition()
        self.deferred = deferred
        # Set for the length of a pipeline step, whose end flushes: a forward runs fused only
        # then (and so does its recomputation under activation checkpointing, in the same step).
        self.active = False

    def add(self, param: torch.Tensor,
            fn: Callable[[Optional[torch.Tensor]], Optional[torch.Tensor]]) -> None:
        """Accumulate into `param`'s gradient: `fn(target)` adds into `target` in place, or
        (target None) returns a new tensor holding the contribution."""
        with self._lock:
            self._add_locked(param, fn)

    def _add_locked(self, param: torch.Tensor,
                    fn: Callable[[Optional[torch.Tensor]], Optional[torch.Tensor]]) -> None:
        # Into a buffer of our own even where `.grad` exists (no zero_grad, or
        # set_to_none=False), never into `.grad` before `flush`: autograd may be adding into it
        # meanwhile, in another thread and without our lock (pp_rank 0's glue code using the
        # same weight, e.g. a tied one), and two in-place additions would lose one.
        entry = self._pending.get(id(param))
        if entry is None:
            self._pending[id(param)] = (param, fn(None))
        else:
            fn(entry[1])

    def add_product(self, param: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """Add `a^T b` (`a`, `b`: the same rows) to `param`'s gradient, now or (deferred) later:
        `dY^T X` for a `nn.Linear` weight (out x in), `X^T dY` for a Conv1D one (in x out)."""
        if not self.deferred:
            self.add(param, lambda t: _product(a, b, t))
            return
        key, rows = id(param), a.shape[0]
        bound = _bound(param)
        with self._lock:
            group = self._open.get(key)
            if group is None:
                group = self._open[key] = [param, [], [], 0]
            group[1].append(a)
            group[2].append(b)
            group[3] += rows
            self._rows[key] += rows
            complete = None
            if group[3] >= min(self.GROUP_ROWS, max(1, bound // 2)):
                del self._open[key]
                complete = (key, param, group[1], group[2])
            if self._rows[key] >= bound:
                # Compute this weight's complete groups now, oldest first (the one just
                # completed last; it is not queued, so the idle-time thread is not woken for it).
                if self._queued[key]:
                    mine = [g for g in self._ready if g[0] == key]
                    self._ready = collections.deque(g for g in self._ready if g[0] != key)
                    del self._queued[key]
                    for g in mine:
                        self._compute_locked(g)
                if complete is not None:
                    self._compute_locked(complete)
            elif complete is not None:
                self._ready.append(complete)
                self._queued[key] += 1
                self._lock.notify_all()

    def _compute_locked(self, group: tuple) -> None:
        key, param, as_, bs = group
        a = as_[0] if len(as_) == 1 else torch.cat(as_)
        b = bs[0] if len(bs) == 1 else torch.cat(bs)
        self._rows[key] -= a.shape[0]
        with torch.no_grad(), _without_autocast(a):  # (a flush may run under the caller's)
            self._add_locked(param, lambda t: _product(a, b, t))

    def wait_for_work(self, timeout: float) -> bool:
        """Wait (at most `timeout` s) until a complete group of kept products is there."""
        with self._lock:
            if not self._ready:
                self._lock.wait(timeout)
            return bool(self._ready)

    def compute_one(self) -> bool:
        """Compute the oldest complete group; False if there is none."""
        with self._lock:
            if not self._ready:
                return False
            group = self._ready.popleft()
            self._queued[group[0]] -= 1
            self._compute_locked(group)
            return True

    def flush(self) -> None:
        """Compute what is kept and hand the pending buffers over as `.grad` (added to one that
        was there before the step or that autograd made meanwhile)."""
        # Under the lock: `add` may run meanwhile on another thread (pp_rank 0's glue code runs
        # outside the compute lock) and must not add into a .grad being set or added to here.
        with self._lock, torch.no_grad():
            while self._ready:
                self._compute_locked(self._ready.popleft())
            self._queued.clear()
            for key, (param, as_, bs, _) in list(self._open.items()):
                self._compute_locked((key, param, as_, bs))
            self._open.clear()
            pending, self._pending = self._pending, {}
            for param, buf in pending.values():
                if param.grad is None:
                    param.grad = buf
                else:
                    param.grad.add_(buf)

    def __bool__(self) -> bool:
        return bool(self._pending) or bool(self._open) or bool(self._ready)


def _bound(weight: torch.Tensor) -> int:
    """Rows of `dY` and `X` kept for `weight` at most: a row of both holds sum(shape) numbers,
    the weight numel(), so the kept rows never outgrow the weight."""
    return max(1, weight.numel() // sum(weight.shape))


def _without_autocast(t: torch.Tensor) -> torch.autocast:
    """Autocast off for `t`'s device. The fused path runs only where autocast was off in the
    forward, but a Python backward (unlike autograd's own) and the step's flush run under
    whatever autocast the calling thread has on (a backward called inside an autocast region
    around a forward that turned it off), which would cast the products to the half type."""
    return torch.autocast(t.device.type, enabled=False)


def _product(a: torch.Tensor, b: torch.Tensor, target: Optional[torch.Tensor]) -> torch.Tensor:
    """`a^T b`, added into `target` in place, or (target None) as a new tensor."""
    return a.t().mm(b) if target is None else target.addmm_(a.t(), b)


def _keep_for_backward(ctx, acc: WeightGradAccumulator, x: torch.Tensor, weight: torch.Tensor,
                       bias: Optional[torch.Tensor]) -> None:
    ctx.acc = acc
    # The parameters themselves: under activation checkpointing the saved tensors come back as
    # recomputed aliases, whose .grad is not the parameter's.
    ctx.params = (weight, bias)
    ctx.save_for_backward(x, weight)


def _parameter_grads(ctx, grad_x: Optional[torch.Tensor], a: torch.Tensor, b: torch.Tensor,
                     g2: torch.Tensor) -> tuple:
    """The backward's return value, the weight gradient `a^T b` and the bias gradient (`g2`
    summed over rows) left to the accumulator; under `create_graph` returned, as autograd
    would, to be part of the graph."""
    w_param, b_param = ctx.params
    need_w, need_b = ctx.needs_input_grad[2:4]
    if torch.is_grad_enabled():
        return (None, grad_x, a.t().mm(b) if need_w else None, g2.sum(0) if need_b else None)
    if need_w:
        ctx.acc.add_product(w_param, a, b)
    if need_b:
        ctx.acc.add(b_param, lambda t: g2.sum(0) if t is None else t.add_(g2.sum(0)))
    return None, grad_x, None, None


class _LinearAccumulating(torch.autograd.Function):
    @staticmethod
    def forward(ctx, acc: WeightGradAccumulator, x: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
        _keep_for_backward(ctx, acc, x, weight, bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        with _without_autocast(x):
            grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[1] else None
            g2 = grad_out.reshape(-1, grad_out.shape[-1])
            return _parameter_grads(ctx, grad_x, g2, x.reshape(-1, x.shape[-1]), g2)


class _Conv1DAccumulating(torch.autograd.Function):
    """Hugging Face's `Conv1D` (GPT-2's projections): a linear layer whose weight is stored
    in x out, computed as its own forward computes it (`addmm(bias, x, W)`)."""

    @staticmethod
    def forward(ctx, acc: WeightGradAccumulator, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor) -> torch.Tensor:
        _keep_for_backward(ctx, acc, x, weight, bias)
        out = torch.addmm(bias, x.view(-1, x.size(-1)), weight)
        return out.view(x.size()[:-1] + (weight.shape[1],))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        with _without_autocast(x):
            g2 = grad_out.reshape(-1, grad_out.shape[-1])
            grad_x = g2.mm(weight.t()).view(x.shape) if ctx.needs_input_grad[1] else None
            return _parameter_grads(ctx, grad_x, x.reshape(-1, x.shape[-1]), g2, g2)


def _is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's `transformers.pytorch_utils.Conv1D` (recognised without importing it)."""
    cls = type(module)
    return (cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.")
            and isinstance(getattr(module, "bias", None), torch.Tensor)
            and getattr(module, "weight", None) is not None and module.weight.dim() == 2)


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


def fused_forward(module: nn.Module, acc: WeightGradAccumulator
                  ) -> Callable[[torch.Tensor], torch.Tensor]:
    """An instance `forward` for `module` (a `nn.Linear` or a Conv1D): fused while `acc` is
    active (inside a step)."""
    cls_forward = type(module).forward
    fn = _LinearAccumulating if type(module) is nn.Linear else _Conv1DAccumulating

    def forward(x: torch.Tensor) -> torch.Tensor:
        w, b = module.weight, module.bias
        if (not acc.active or not torch.is_grad_enabled() or not w.requires_grad
                or torch.is_autocast_enabled(w.device.type) or not _plain(w) or not _plain(b)
                or type(x) is not torch.Tensor or x.dtype != w.dtype or w.dtype not in _FULL
                or x.numel() >= _bound(w) * x.shape[-1]):
            # (The last: a microbatch with as many rows as the weight may keep has its product
            # computed at once, where the pass over the weight saved is small against the
            # product itself and this path's Python costs more: autograd's is in C++.)
            return cls_forward(module, x)
        return fn.apply(acc, x, w, b)

    forward.__name__ = "forward"
    return forward


def install(modules: Dict[str, nn.Module], owned: Callable[[str], bool],
            acc: WeightGradAccumulator) -> list:
    """Give this rank's plain `nn.Linear` and Conv1D modules whose weights have at least
    `SMSHIM_FUSED_WGRAD_MIN_NUMEL` elements the fused forward; returns them (to undo)."""
    if not enabled_by_env():
        return []
    min_numel = min_numel_by_env()
    done = []
    for name, module in modules.items():
        if ((type(module) is nn.Linear or _is_conv1d(module))
                and "forward" not in module.__dict__ and owned(name)
                and module.weight.numel() >= min_numel):
            module.forward = fused_forward(module, acc)
            done.append(module)
    return done


def uninstall(modules: list) -> None:
    for module in modules:
        module.__dict__.pop("forward", None)
