"""`@smp.step`: split the inputs into microbatches, run the body once per microbatch in pipeline
order (on pp_rank 0; the other pipeline ranks serve it), and join the per-microbatch results into
`StepOutput`s that every rank of the pipeline group receives."""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional

import torch

from smshim.modelparallel.torch.errors import SMPRuntimeError
from smshim.modelparallel.torch.pipeline.microbatch import join_step_outputs, split_step_inputs
from smshim.modelparallel.torch.state import require_init, state
from smshim.modelparallel.torch.pipeline.context import ctx

BACKWARD_IN_STEP = (
    "loss.backward() was called inside an @smp.step function: smp runs the backward pass itself, "
    "per microbatch and across the pipeline. Call model.backward(loss) instead, where model is "
    "the smp.DistributedModel")
_guarded = False


def _guard_tensor_backward() -> None:
    """Make `tensor.backward()` inside a step body an error saying what to call (the most common
    porting slip; left alone it fails deep in the pipeline with torch's "does not require grad").
    smp's own backward goes through torch.autograd.backward, which this does not touch; outside a
    step the wrapper costs one thread-local lookup."""
    global _guarded
    if _guarded:
        return
    _guarded = True
    original = torch.Tensor.backward

    @functools.wraps(original)
    def backward(self, *args: Any, **kwargs: Any) -> Any:
        if ctx.in_step:
            raise SMPRuntimeError(BACKWARD_IN_STEP)
        return original(self, *args, **kwargs)

    torch.Tensor.backward = backward


def step(fn: Optional[Callable] = None, *, non_split_inputs: Optional[List[str]] = None,
         input_split_axes: Optional[Dict[str, int]] = None, detach_outputs: bool = True):
    """`@smp.step`, `@smp.step()` or `@smp.step(non_split_inputs=..., input_split_axes=...,
    detach_outputs=...)`."""
    if fn is None:
        return lambda f: step(f, non_split_inputs=non_split_inputs,
                              input_split_axes=input_split_axes, detach_outputs=detach_outputs)
    if not callable(fn):
        raise TypeError(f"@smp.step decorates a function, got {fn!r}")

    @functools.wraps(fn)
    def run_step(*args: Any, **kwargs: Any) -> Any:
        require_init("@smp.step")
        _guard_tensor_backward()
        model = state.model
        if model is None:
            raise SMPRuntimeError("@smp.step needs an smp.DistributedModel: create it before the "
                                  "first step")
        mb_inputs = split_step_inputs(fn, args, kwargs, state.cfg.microbatches,
                                      non_split_inputs, input_split_axes)
        results = model._run_step(fn, mb_inputs)
        out = join_step_outputs(results, detach_outputs)
        model._after_step()
        return out

    return run_step
