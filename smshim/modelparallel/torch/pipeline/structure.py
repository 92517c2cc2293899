"""Nested arguments and results as a template plus a flat list of tensors.

A module call's arguments and a module's outputs are arbitrary nests of list / tuple / namedtuple
/ dict (Hugging Face's ModelOutput too) with tensors and other objects as leaves. To send one, the
tensors go as tensors and the rest (the template, with a `_Slot` where each tensor was) is pickled.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, Dict, List, Tuple

import torch


class _Slot:
    """Stands for the i-th tensor in a flattened structure."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self):
        return (_Slot, (self.index,))


# The template of one tensor (most modules' outputs), shared: nothing changes a slot.
_SLOT_0 = _Slot(0)


def _map_leaves(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """Rebuild nested list/tuple/namedtuple/dict (subclasses too) with `fn` applied to leaves."""
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_leaves(x, fn) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_leaves(x, fn) for x in obj)
    if isinstance(obj, dict):
        # A dict subclass (e.g. Hugging Face's ModelOutput) is rebuilt without calling its
        # __init__, whose signature is its own.
        out = {} if type(obj) is dict else type(obj).__new__(type(obj))
        if type(obj) is not dict:
            dict.__init__(out)
        for k, v in obj.items():
            out[k] = _map_leaves(v, fn)
        return out
    return fn(obj)


def flatten(obj: Any) -> Tuple[Any, List[torch.Tensor]]:
    """Replace every tensor in nested containers by a slot; return (template, tensors)."""
    # The common cases without the walk (every module call goes through here, on both ends):
    # one tensor (a module's output), and a call's (args, kwargs) with tensor arguments only.
    if isinstance(obj, torch.Tensor):
        return _SLOT_0, [obj]
    if _plain_call(obj):
        return flatten_call(obj[0], obj[1])
    return _walk(obj)


def flatten_call(args: tuple, kwargs: dict) -> Tuple[Any, List[torch.Tensor]]:
    """`flatten((args, kwargs))` for a module call's arguments: tensors only, with the shared
    template of their number, in one Python call (pp_rank 0 makes one for every call to a
    module on another rank); anything else walked."""
    if not kwargs and type(args) is tuple:
        for a in args:
            if not isinstance(a, torch.Tensor):
                break
        else:
            return _PLAIN_BY_ARITY.get(len(args)) or _plain_template(len(args)), list(args)
    return _walk((args, kwargs))


def _walk(obj: Any) -> Tuple[Any, List[torch.Tensor]]:
    """`flatten` leaf by leaf."""
    tensors: List[torch.Tensor] = []

    def to_slot(leaf):
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            return _Slot(len(tensors) - 1)
        return leaf

    return _map_leaves(obj, to_slot), tensors


def fill(template: Any, tensors: List[torch.Tensor]) -> Any:
    """Inverse of `flatten`."""
    if type(template) is _Slot:
        return tensors[template.index]
    # The shared template of n tensor arguments (flatten's and loads_template's for every
    # such call); any other template is rebuilt leaf by leaf.
    if id(template) in _PLAIN_BYTES:
        return tuple(tensors), {}
    return _map_leaves(template, lambda leaf: tensors[leaf.index] if isinstance(leaf, _Slot) else leaf)


def _plain_call(obj: Any) -> bool:
    """`obj` is a call's (args, kwargs) with a plain args tuple and no keywords."""
    return (type(obj) is tuple and len(obj) == 2 and type(obj[0]) is tuple
            and type(obj[1]) is dict and not obj[1])


# A call's template travels pickled. The common one, n tensor arguments and no keywords, is the
# same for every microbatch: one object per n on both ends (never changed: `fill` builds a call
# from it), pickled once, unpickled once per bytes (other templates may hold objects a module
# could change, so they are unpickled anew).
_PLAIN_BY_ARITY: Dict[int, Any] = {}
_PLAIN_BYTES: Dict[int, bytes] = {}  # id of a template in _PLAIN_BY_ARITY (alive for good) -> pickle
_PLAIN_TEMPLATES: Dict[bytes, Any] = {}


def _plain_template(n: int) -> Any:
    """The shared template ((slot 0, ..., slot n-1), {})."""
    template = _PLAIN_BY_ARITY.get(n)
    if template is None:
        # (setdefault: of two threads here at once, one template wins and only it is known)
        template = _PLAIN_BY_ARITY.setdefault(n, (tuple(_Slot(i) for i in range(n)), {}))
        data = pickle.dumps(template, protocol=pickle.HIGHEST_PROTOCOL)
        _PLAIN_TEMPLATES.setdefault(data, template)
        _PLAIN_BYTES[id(template)] = data
    return template


def _plain_arity(template: Any) -> int:
    """n if `template` is ((slot 0, ..., slot n-1), {}), else -1."""
    if not _plain_call(template):
        return -1
    args = template[0]
    for i, a in enumerate(args):
        if type(a) is not _Slot or a.index != i:
            return -1
    return len(args)


def dumps_template(template: Any) -> bytes:
    data = _PLAIN_BYTES.get(id(template))
    if data is not None:
        return data
    n = _plain_arity(template)
    if n < 0:
        return pickle.dumps(template, protocol=pickle.HIGHEST_PROTOCOL)
    return _PLAIN_BYTES[id(_plain_template(n))]


def loads_template(data: bytes) -> Any:
    template = _PLAIN_TEMPLATES.get(data)
    if template is not None:
        return template
    template = pickle.loads(data)
    n = _plain_arity(template)
    if n >= 0:
        template = _PLAIN_TEMPLATES.setdefault(data, _plain_template(n))
    return template
