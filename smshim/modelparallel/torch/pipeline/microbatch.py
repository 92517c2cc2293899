"""How `@smp.step` cuts its inputs into microbatches and joins the per-microbatch results.

`split_step_inputs` turns one call `fn(*args, **kwargs)` into `num_microbatches` calls, each on a
slice of the batch; `join_step_outputs` turns the bodies' return values back into one structure whose
tensor leaves are `StepOutput`s. Both are pure functions of their arguments (no process groups), so
the pipeline engine can call them on any rank.
"""

from __future__ import annotations

import collections
import collections.abc
import functools
import inspect
import logging
import weakref
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch

from smshim.modelparallel.torch.errors import SMPValidationError, TensorSplitError

__all__ = ["StepOutput", "split_step_inputs", "join_step_outputs"]

logger = logging.getLogger(__name__)


class StepOutput:
    """One value per microbatch, as returned by an `@smp.step` function for each tensor leaf.

    Also accepted as a step input: microbatch ``mb`` then receives ``outputs[mb]``.
    """

    def __init__(self, outputs: Iterable[Any]):
        self.outputs: List[Any] = list(outputs)

    # -- sequence protocol ---------------------------------------------------------------------
    def __getitem__(self, index: int) -> Any:
        return self.outputs[index]

    def __len__(self) -> int:
        return len(self.outputs)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.outputs)

    # -- reductions ----------------------------------------------------------------------------
    def _tensors(self, what: str) -> List[torch.Tensor]:
        if not self.outputs:
            raise ValueError(f"StepOutput.{what}() on an empty StepOutput (no microbatches)")
        # Plain Python numbers are allowed so that e.g. a StepOutput built by .map(float) still reduces.
        return [o if isinstance(o, torch.Tensor) else torch.as_tensor(o) for o in self.outputs]

    def stack(self) -> torch.Tensor:
        """The per-microbatch values stacked along a new dimension 0."""
        return torch.stack(self._tensors("stack"))

    def concat(self) -> torch.Tensor:
        """The per-microbatch tensors concatenated along dim 0 (0-dim tensors are stacked)."""
        tensors = self._tensors("concat")
        if any(t.dim() == 0 for t in tensors):
            return torch.stack(tensors)
        return torch.cat(tensors, dim=0)

    def reduce_mean(self) -> torch.Tensor:
        """Mean over microbatches (e.g. the step's loss from per-microbatch losses)."""
        stacked = self.stack()
        if not (stacked.is_floating_point() or stacked.is_complex()):
            # torch.mean refuses integer tensors; the mean of counts is still meaningful.
            stacked = stacked.to(torch.get_default_dtype())
        return stacked.mean(dim=0)

    def reduce_sum(self) -> torch.Tensor:
        """Sum over microbatches."""
        return self.stack().sum(dim=0)

    # -- transforms ----------------------------------------------------------------------------
    def map(self, fn: Callable[[Any], Any]) -> "StepOutput":
        """A StepOutput of ``fn`` applied to each microbatch's value."""
        return StepOutput(fn(o) for o in self.outputs)

    def detach(self) -> "StepOutput":
        """A StepOutput whose tensors are detached from the autograd graph."""
        return StepOutput(o.detach() if isinstance(o, torch.Tensor) else o for o in self.outputs)

    def __repr__(self) -> str:
        def short(o: Any) -> str:
            if not isinstance(o, torch.Tensor):
                return repr(o)
            if o.dim() == 0 and not o.is_complex():
                return f"tensor({o.item():.6g}, dtype={o.dtype})"
            return f"tensor(shape={tuple(o.shape)}, dtype={o.dtype})"

        return f"StepOutput(num_microbatches={len(self.outputs)}, outputs=[{', '.join(map(short, self.outputs))}])"


# ------------------------------------------------------------------------------------------------
# Containers: recurse into list/tuple/namedtuple/dict (and other mappings), rebuilding the same type.
# ------------------------------------------------------------------------------------------------

def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def _rebuild_sequence(template: Any, items: List[Any]) -> Any:
    cls = type(template)
    if _is_namedtuple(template):
        return cls(*items)
    if cls is list or cls is tuple:
        return cls(items)
    try:
        return cls(items)
    except Exception:  # a subclass with an unusual constructor: keep the data, lose the subclass
        logger.debug("cannot rebuild %s from a list; using %s", cls.__name__, type(template).__mro__[1].__name__)
        return list(items) if isinstance(template, list) else tuple(items)


def _rebuild_mapping(template: Any, items: Dict[Any, Any]) -> Any:
    cls = type(template)
    if cls is dict:
        return items
    if isinstance(template, collections.defaultdict):
        return cls(template.default_factory, items)
    try:
        # OrderedDict, Hugging Face BatchEncoding / ModelOutput, UserDict all take a mapping.
        return cls(items)
    except Exception:
        logger.debug("cannot rebuild %s from a dict; using a plain dict", cls.__name__)
        return items


def _child_path(path: str, key: Any) -> str:
    return f"{path}[{key!r}]"


# ------------------------------------------------------------------------------------------------
# Splitting
# ------------------------------------------------------------------------------------------------

def _split_value(value: Any, num_mb: int, axis: int, path: str) -> List[Any]:
    """Every microbatch's share of ``value``, in microbatch order (``path`` names it in error
    messages)."""
    if isinstance(value, StepOutput):
        if len(value) != num_mb:
            raise TensorSplitError(
                f"step input {path} is a StepOutput with {len(value)} entries but the step runs "
                f"{num_mb} microbatches; a StepOutput can only be passed to a step with the same "
                f"number of microbatches (or list it in non_split_inputs to pass it whole)"
            )
        return list(value.outputs)
    smp_slice = _smp_slice_of(value)
    if smp_slice is not None and callable(smp_slice) and not isinstance(value, type):
        return [smp_slice(num_mb, mb, axis) for mb in range(num_mb)]
    if isinstance(value, torch.Tensor):
        return _split_tensor(value, num_mb, axis, path)
    kind = _container_kind(type(value))
    if kind is _SEQUENCE:
        parts = [_split_value(v, num_mb, axis, _child_path(path, i)) for i, v in enumerate(value)]
        return [_rebuild_sequence(value, [p[mb] for p in parts]) for mb in range(num_mb)]
    if kind is _MAPPING:
        parts = {k: _split_value(v, num_mb, axis, _child_path(path, k)) for k, v in value.items()}
        return [_rebuild_mapping(value, {k: p[mb] for k, p in parts.items()})
                for mb in range(num_mb)]
    return [value] * num_mb


_SEQUENCE, _MAPPING, _LEAF = "sequence", "mapping", "leaf"


@functools.lru_cache(maxsize=1024)
def _container_kind(cls: type) -> str:
    # Per class, once: an isinstance check against the Mapping ABC costs more than the rest of
    # splitting a step argument, and a step sees the same few classes every time.
    if issubclass(cls, (list, tuple)):
        return _SEQUENCE
    if issubclass(cls, collections.abc.Mapping):
        return _MAPPING
    return _LEAF


def _smp_slice_of(value: Any) -> Any:
    """``value.smp_slice`` or None. An nn.Module (the model is usually a step argument) is looked
    up on its class and instance dict: a plain getattr would go through Module.__getattr__, which
    builds an AttributeError message every step only to have it caught."""
    if isinstance(value, torch.nn.Module):
        if hasattr(type(value), "smp_slice") or "smp_slice" in value.__dict__:
            return value.smp_slice
        return None
    return getattr(value, "smp_slice", None)


def _split_tensor(tensor: torch.Tensor, num_mb: int, axis: int, path: str) -> List[torch.Tensor]:
    if tensor.dim() == 0:
        return [tensor] * num_mb  # a scalar has no batch dimension: every microbatch sees it whole
    if not -tensor.dim() <= axis < tensor.dim():
        raise TensorSplitError(
            f"cannot split step input {path} along axis {axis}: the tensor has only {tensor.dim()} "
            f"dimension(s) (shape {tuple(tensor.shape)}); fix input_split_axes or list it in non_split_inputs"
        )
    size = tensor.size(axis)
    if size % num_mb != 0:
        raise TensorSplitError(
            f"cannot split step input {path} into {num_mb} microbatches: its size along axis {axis} "
            f"is {size} (shape {tuple(tensor.shape)}), which is not divisible by {num_mb}. Make the "
            f"batch size a multiple of the number of microbatches, e.g. DataLoader(..., drop_last=True) "
            f"so the last, smaller batch is dropped; or pass it whole with non_split_inputs, or choose "
            f"another axis with input_split_axes"
        )
    if num_mb == 1:
        return [tensor]  # the whole tensor: a full-size narrow() view would only cost time
    k = size // num_mb
    # A view per microbatch. Along axis 0 a slice, 0.6 of narrow()'s time (the step's head splits
    # every input before any microbatch starts); not split(), one op for all, whose views refuse
    # an in-place op with grad enabled (`x.add_(param)` in a step function).
    if axis % tensor.dim() == 0:
        return [tensor[mb * k:(mb + 1) * k] for mb in range(num_mb)]
    return [tensor.narrow(axis, mb * k, k) for mb in range(num_mb)]


def _normalise_names(non_split_inputs: Any, input_split_axes: Any) -> Tuple[frozenset, Dict[str, int]]:
    if non_split_inputs is None:
        names: frozenset = frozenset()
    elif isinstance(non_split_inputs, str):
        names = frozenset([non_split_inputs])  # a lone name is an easy slip for a one-element list
    else:
        try:
            names = frozenset(non_split_inputs)
        except TypeError:
            raise TypeError(
                f"non_split_inputs must be a list of argument names, got {type(non_split_inputs).__name__}"
            ) from None
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"non_split_inputs must contain argument names (str), got {n!r}")
    axes: Dict[str, int] = {}
    if input_split_axes is not None:
        if not isinstance(input_split_axes, Mapping):
            raise TypeError(
                f"input_split_axes must be a dict {{argument name: axis}}, got {type(input_split_axes).__name__}"
            )
        for n, a in input_split_axes.items():
            if not isinstance(n, str):
                raise TypeError(f"input_split_axes keys must be argument names (str), got {n!r}")
            if isinstance(a, bool) or not isinstance(a, int):
                raise TypeError(f"input_split_axes[{n!r}] must be an int axis, got {a!r}")
            axes[n] = a
    return names, axes


def _validate_names(fn: Callable, sig: Optional[inspect.Signature], names: Iterable[str], what: str) -> None:
    if sig is None:
        return
    params = sig.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        # Any name may arrive through **kwargs, so only the call itself could tell; accept it.
        return
    fn_name = getattr(fn, "__qualname__", repr(fn))
    for n in sorted(names):
        if n not in params:
            raise SMPValidationError(
                f"{what} names {n!r}, which is not an argument of step function {fn_name}"
                f"{sig}; valid names: {', '.join(params) or '(none)'}"
            )


def _signature(fn: Callable) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins / C callables have no introspectable signature
        return None


# Per step function: its signature and its argument plans by call shape. inspect.signature and
# Signature.bind cost more than splitting a small batch, and a step function is called with the
# same shape every step, so both are computed once (benchmarks/pp1_overhead.py measures this).
_fn_cache: "weakref.WeakKeyDictionary[Callable, Tuple[Optional[inspect.Signature], Dict[Any, Any]]]" = \
    weakref.WeakKeyDictionary()
_MAX_PLANS_PER_FN = 64  # bounds memory for a function called with ever-new keyword names
_NO_NAMES: frozenset = frozenset()
_NO_AXES: Dict[str, int] = {}


def _cached(fn: Callable) -> Tuple[Optional[inspect.Signature], Optional[Dict[Any, Any]]]:
    """(signature, plan cache) of ``fn``; the cache is None when ``fn`` cannot be weakly
    referenced or hashed (then nothing is cached)."""
    try:
        entry = _fn_cache.get(fn)
        if entry is None:
            entry = _fn_cache.setdefault(fn, (_signature(fn), {}))
        return entry
    except TypeError:
        return _signature(fn), None


def split_step_inputs(
    fn: Callable,
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    num_microbatches: int,
    non_split_inputs: Optional[Iterable[str]] = None,
    input_split_axes: Optional[Mapping[str, int]] = None,
) -> List[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
    """Split one call of step function ``fn`` into per-microbatch ``(args, kwargs)`` pairs.

    Arguments are bound to ``fn``'s signature so each has a name: ``non_split_inputs`` (names passed
    whole to every microbatch) and ``input_split_axes`` (name -> axis, default 0) refer to these names.
    For ``*args``/``**kwargs`` parameters both the parameter's own name and (for ``**kwargs``) each
    keyword's name are recognised (with ``**kwargs`` in the signature any name is accepted, since it
    may arrive there). Each returned pair keeps the call's form: positional arguments stay
    positional, keywords stay keywords. Raises `TensorSplitError` before returning anything if some
    input cannot be split.
    """
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
    kwargs = dict(kwargs or {})
    if non_split_inputs is None and input_split_axes is None:
        names, axes, axes_key = _NO_NAMES, _NO_AXES, ()
    else:
        names, axes = _normalise_names(non_split_inputs, input_split_axes)
        axes_key = tuple(sorted(axes.items()))
    sig, plans = _cached(fn)
    # A plan depends only on the call's shape (how many positionals, which keywords), never on
    # the values, so a cached one is exactly what _plan (incl. its bind() check) would return.
    key = (len(args), tuple(kwargs), names, axes_key)
    planned = plans.get(key) if plans is not None else None
    if planned is None:
        _validate_names(fn, sig, names, "non_split_inputs")
        _validate_names(fn, sig, axes, "input_split_axes")
        planned = _plan(fn, sig, args, kwargs, names, axes)
        if plans is not None:
            if len(plans) >= _MAX_PLANS_PER_FN:
                plans.clear()
            plans[key] = planned
    pos_plan, kw_plan = planned
    # Each input split once into all its shares (its checks made once), then dealt out.
    pos = [None if whole else _split_value(v, num_microbatches, axis, path)
           for v, (path, whole, axis) in zip(args, pos_plan)]
    kws = [None if whole else _split_value(v, num_microbatches, axis, path)
           for v, (path, whole, axis) in zip(kwargs.values(), kw_plan)]
    return [
        (
            tuple([v if shares is None else shares[mb] for v, shares in zip(args, pos)]),
            {k: v if shares is None else shares[mb]
             for (k, v), shares in zip(kwargs.items(), kws)},
        )
        for mb in range(num_microbatches)
    ]


_Plan = Tuple[str, bool, int]  # (path for messages, pass whole, split axis)


def _plan(fn: Callable, sig: Optional[inspect.Signature], args: Tuple[Any, ...], kwargs: Dict[str, Any],
          names: frozenset, axes: Mapping[str, int]) -> Tuple[List[_Plan], List[_Plan]]:
    """Name every positional and keyword argument of the call; the call keeps its own form
    (positional stays positional) so the body sees exactly the call the user wrote, per microbatch."""
    def plan(path: str, *lookup: str) -> _Plan:
        # ``lookup`` is the argument's own name, then the *args/**kwargs name that caught it, if any.
        whole = any(n in names for n in lookup)
        axis = next((axes[n] for n in lookup if n in axes), 0)
        return path, whole, axis

    if sig is None:
        # No signature to bind to: positional arguments are known as args[i], keywords by themselves.
        return [plan(f"args[{i}]") for i in range(len(args))], [plan(k, k) for k in kwargs]

    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(
            f"arguments do not match step function {getattr(fn, '__qualname__', fn)}{sig}: {e}"
        ) from None
    P = inspect.Parameter
    params = list(sig.parameters.values())
    positional = [p.name for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    var_pos = next((p.name for p in params if p.kind is P.VAR_POSITIONAL), None)
    var_kw = next((p.name for p in params if p.kind is P.VAR_KEYWORD), None)
    keywordable = {p.name for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}

    pos_plan = []
    for i in range(len(args)):
        if i < len(positional):
            pos_plan.append(plan(positional[i], positional[i]))
        else:  # bind() succeeded, so the extra positionals go to *args
            pos_plan.append(plan(f"{var_pos}[{i - len(positional)}]", var_pos))
    kw_plan = [plan(k, k) if k in keywordable else plan(k, k, var_kw) for k in kwargs]
    return pos_plan, kw_plan


# ------------------------------------------------------------------------------------------------
# Joining
# ------------------------------------------------------------------------------------------------

def _describe(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if _is_namedtuple(value):
        return f"a {type(value).__name__} namedtuple"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of length {len(value)}"
    if isinstance(value, collections.abc.Mapping):
        return f"a {type(value).__name__} with keys {list(value.keys())}"
    return f"a {type(value).__name__}"


def _kind(value: Any) -> Any:
    """What must agree across microbatches at one node of the output structure."""
    if value is None:
        return "none"
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, (list, tuple)):
        return ("seq", type(value), len(value))
    if isinstance(value, collections.abc.Mapping):
        return ("map", type(value), frozenset(value.keys()))
    return "leaf"


def _join(values: List[Any], detach: bool, path: str) -> Any:
    kinds = [_kind(v) for v in values]
    first = kinds[0]
    # None and plain leaves may mix (e.g. an optional float); everything else must match exactly.
    loose = {"none", "leaf"}
    for mb, k in enumerate(kinds[1:], start=1):
        if k != first and not (first in loose and k in loose):
            detail = ""
            if isinstance(first, tuple) and isinstance(k, tuple) and first[:2] == k[:2] == ("map", k[1]):
                extra, missing = sorted(map(repr, k[2] - first[2])), sorted(map(repr, first[2] - k[2]))
                detail = "".join([f"; extra key(s) {', '.join(extra)}" if extra else "",
                                  f"; missing key(s) {', '.join(missing)}" if missing else ""])
            raise SMPValidationError(
                f"the step function returned differently structured values across microbatches: at "
                f"{path}, microbatch 0 returned {_describe(values[0])} but microbatch {mb} returned "
                f"{_describe(values[mb])}{detail}; every microbatch must return the same structure"
            )
    template = values[0]
    if first == "tensor":
        return StepOutput(v.detach() if detach else v for v in values)
    if all(k == "none" for k in kinds):
        return None
    if first in loose:
        return list(values)
    if first[0] == "seq":
        return _rebuild_sequence(
            template, [_join([v[i] for v in values], detach, _child_path(path, i)) for i in range(len(template))]
        )
    return _rebuild_mapping(
        template, {key: _join([v[key] for v in values], detach, _child_path(path, key)) for key in template.keys()}
    )


def join_step_outputs(per_microbatch: List[Any], detach: bool) -> Any:
    """Join the step body's per-microbatch return values into one structure.

    Tensor leaves become `StepOutput`s (detached when ``detach``), other leaves per-microbatch lists,
    and containers keep their type. Raises SMPValidationError (a ValueError) naming the first
    microbatch whose structure differs from microbatch 0's, and where and how it differs.
    """
    per_microbatch = list(per_microbatch)
    if not per_microbatch:
        raise ValueError("join_step_outputs needs the return value of at least one microbatch")
    return _join(per_microbatch, detach, "output")
