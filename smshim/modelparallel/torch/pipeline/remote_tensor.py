"""Lazy handles for tensors that live on another pipeline rank.

When pp_rank 0's forward code calls a module owned by rank j, the result stays on rank j and the
call returns `RemoteTensor`s: real `torch.Tensor` objects (so autograd, `isinstance` and `.shape`
work) that hold no data, only where the data is. Handing one to another module of rank j costs no
transfer; handing it to a module on rank k makes j send it straight to k. Anything that reads the
values (a torch op in the glue code, `.item()`, an `if`, printing) goes through
`__torch_dispatch__`, which fetches the data once and runs the op on it, so models that read
their intermediate values still work unchanged.

Gradients travel the same way: the backward of a remote call returns RemoteTensors for its
inputs' gradients, which stay on the rank that computed them until a consumer needs them. When
autograd adds two of them (a value used twice), the sum stays lazy too (`terms`), and whoever
consumes it adds the terms where it runs.

A `_Cell` is the shared state of a handle and its aliases (`detach()` returns a new wrapper on the
same cell): which rank owns the value and under which key, or the terms of a lazy sum, and the
data once fetched. Fetching is the server's job (`resolver`).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, Tuple, Union

import torch
from torch.utils._pytree import tree_map

from smshim.modelparallel.torch.errors import SMPRuntimeError

aten = torch.ops.aten

Key = Tuple[Any, ...]


class _Cell:
    __slots__ = ("owner", "key", "terms", "value", "pushed", "sent_to", "_what", "microbatch",
                 "resolver", "lock", "fetching", "step", "producer", "used", "on_reuse")

    def __init__(self, owner: int, key: Optional[Key], what: Union[str, tuple], microbatch: int,
                 resolver: Callable[["_Cell"], torch.Tensor], pushed: bool = False,
                 terms: Optional[List[Union["_Cell", torch.Tensor]]] = None,
                 step: int = -1, producer: Optional[Callable[[], Any]] = None) -> None:
        self.owner = owner          # pp rank holding the value (-1 for a lazy sum)
        self.key = key              # the value's key in its owner's ValueStore
        self.terms = terms          # a lazy sum: cells and real tensors to add
        self.value: Optional[torch.Tensor] = None  # the data, once here
        self.pushed = pushed        # the owner sends it unasked (no fetch request needed)
        self.sent_to: set = set()   # ranks already asked to receive it (each gets it once)
        # For messages: "forward output 0 of module 'x'", or a format and its arguments, which
        # only an error formats (a call's handles are made by the thousand, read rarely).
        self._what = what
        self.microbatch = microbatch
        self.resolver = resolver
        self.lock = threading.Lock()
        self.fetching: object = False  # asked for: "later" (PREFETCH) or True (FETCH)
        self.step = step
        # A call's output on pp_rank 0: a weak reference to the call, for the next call of its
        # chain to find (calls.py, `_Chain`); whether a call or an op used it; and, once the
        # next call of the chain took it, what any further use must do.
        self.producer = producer
        self.used = False
        self.on_reuse: Optional[Callable[[], None]] = None

    @property
    def what(self) -> str:
        what = self._what
        return what if isinstance(what, str) else what[0].format(*what[1:])

    def resolve(self) -> torch.Tensor:
        if self.value is None:
            self.value = self.resolver(self)
        return self.value


class RemoteTensor(torch.Tensor):
    """A tensor whose data is on another pipeline rank (see the module docstring)."""

    _cell: _Cell

    @staticmethod
    def __new__(cls, cell: _Cell, shape, dtype: torch.dtype, device: torch.device,
                requires_grad: bool = False) -> "RemoteTensor":
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device,
                                                requires_grad=requires_grad)
        t._cell = cell
        return t

    def materialize(self) -> torch.Tensor:
        """The data, fetched from its owner on first use."""
        return self._cell.resolve()

    # Python-level readers that do not go through the dispatcher.
    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # noqa: D105
        return f"RemoteTensor({self.materialize()!r})"

    def numpy(self, *args: Any, **kwargs: Any):
        return self.materialize().numpy(*args, **kwargs)

    def tolist(self):
        return self.materialize().tolist()

    def __array__(self, dtype=None):
        arr = self.materialize().numpy()
        return arr if dtype is None else arr.astype(dtype)

    def __reduce_ex__(self, protocol):
        return self.materialize().__reduce_ex__(protocol)

    # A gradient hook needs the gradient to pass through this handle in pp_rank 0's autograd,
    # which a chain of calls on one stage does not do (calls.py, `_Chain`).
    def register_hook(self, hook):
        _hooked(self._cell)
        return super().register_hook(hook)

    def retain_grad(self) -> None:
        _hooked(self._cell)
        return super().retain_grad()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            src = args[0]
            return RemoteTensor(src._cell, src.shape, src.dtype, src.device)
        if func is aten.add.Tensor and not kwargs and len(args) == 2 and _summable(*args):
            # Autograd accumulating the gradients of a value used twice: keep the sum lazy.
            a, b = args
            cell = _Cell(-1, None, "sum of gradients", _mb(a, b), _resolve_sum,
                         terms=_terms(a) + _terms(b), step=_step(a, b))
            return RemoteTensor(cell, a.shape, a.dtype, a.device)
        written = _written_args(func)
        for a in args:
            if isinstance(a, RemoteTensor):
                _used(a._cell)

        def unwrap(x):
            return x.materialize() if isinstance(x, RemoteTensor) else x

        if any(type(a) in (list, tuple) and any(isinstance(x, RemoteTensor) for x in a)
               for a in (*args, *kwargs.values())):  # (aten.cat's list of tensors, say)
            out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        else:
            # Flat arguments (most ops: autograd summing a gradient, a backward's matmul)
            # without pytree's walk, which cost more than the op on a small tensor.
            out = func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in kwargs.items()})
        for i in written:
            if i < len(args) and isinstance(args[i], RemoteTensor):
                # Modified in place here: from now on this copy is the value (sent inline).
                args[i]._cell.owner, args[i]._cell.key, args[i]._cell.terms = -1, None, None
                if out is args[i]._cell.value:
                    out = args[i]
        return out


def _used(cell: _Cell) -> None:
    """A call or an op used a handle (see `_Cell.used`)."""
    cell.used = True
    if cell.on_reuse is not None:
        reuse, cell.on_reuse = cell.on_reuse, _reused_already  # (it stays linked: `_hooked`)
        reuse()


def _reused_already() -> None:
    pass


def _hooked(cell: _Cell) -> None:
    """A gradient hook on a handle: the next call must not link to it (see `_Cell.used`); too
    late if one did."""
    if cell.on_reuse is not None:
        raise SMPRuntimeError(
            f"a gradient hook on the {cell.what} (microbatch {cell.microbatch}), after the next "
            "module on its rank took it: smshim backpropagates such a chain of calls on that "
            "rank, and the gradient does not pass through this tensor on pp_rank 0. Register "
            "the hook before passing the tensor on, or set SMSHIM_MERGE_CHAINS=0")
    cell.used = True


def _summable(a: Any, b: Any) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and (isinstance(a, RemoteTensor) or isinstance(b, RemoteTensor))
            and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
            and not (_has_value(a) and _has_value(b)))


def _has_value(t: torch.Tensor) -> bool:
    return not isinstance(t, RemoteTensor) or t._cell.value is not None


def _mb(a: Any, b: Any) -> int:
    for t in (a, b):
        if isinstance(t, RemoteTensor):
            return t._cell.microbatch
    return -1


def _step(a: Any, b: Any) -> int:
    for t in (a, b):
        if isinstance(t, RemoteTensor):
            return t._cell.step
    return -1


def _terms(t: torch.Tensor) -> List[Union[_Cell, torch.Tensor]]:
    if not isinstance(t, RemoteTensor):
        return [t]
    cell = t._cell
    if cell.value is not None:
        return [cell.value]
    if cell.terms is not None:
        return list(cell.terms)
    return [cell]


def _resolve_sum(cell: _Cell) -> torch.Tensor:
    total = None
    for term in cell.terms:
        v = term.resolve() if isinstance(term, _Cell) else term
        total = v if total is None else total + v
    return total


def _written_args(func) -> List[int]:
    """Positions of the arguments an op writes to (in-place and out= ops)."""
    written = _WRITTEN.get(func)
    if written is None:
        schema = getattr(func, "_schema", None)
        written = _WRITTEN[func] = [] if schema is None else [
            i for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write]
    return written


_WRITTEN: dict = {}  # op -> _written_args(op)
