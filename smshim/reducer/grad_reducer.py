"""Bucketed, overlapped gradient averaging over a process group.

Used by `smdistributed.dataparallel.torch.parallel.DistributedDataParallel` and by the
model-parallel engine (averaging each pipeline partition's gradients over its data-parallel
group). The design is torch DDP's:

* parameters are packed, in reverse registration order (roughly the order backward produces their
  gradients), into flat per-(dtype, device) buckets: a small first bucket so communication starts
  early, then buckets of `bucket_cap_mb`;
* a post-accumulate-grad hook per parameter counts the bucket's gradients in; the last one copies
  them into the bucket, pre-divided by the group size (with `gradient_as_bucket_view`, `param.grad`
  already is a view of the bucket from the first step on, and only the division is left);
* a full bucket whose predecessors have all been launched (so every rank issues its collectives in
  the same order) is allreduced asynchronously while backward goes on;
* at the end of backward (an autograd engine callback) or on an explicit `finalize()`, the rest is
  launched, everything is waited for and the averages are copied back into `param.grad` (nothing
  to copy with `gradient_as_bucket_view`).

Unused parameters are agreed on without an extra collective: every bucket buffer carries one flag
slot per parameter after the gradients ("this rank has no gradient for it"), summed by the same
allreduce (with a comm hook, which must see gradients only, by one small extra allreduce). So every
rank learns which parameters some rank lacked and raises the same error; with
`find_unused_parameters=True` a parameter no rank used keeps `grad=None` (as on a single process,
so optimizers skip it) while one used elsewhere gets the average with zeros here.

Two ways to drive a round, for the two users:
* DDP: `prepare_for_backward(sync=...)` in every forward; the backward that follows reduces and
  finishes itself (`finalize_at_backward_end=True`). `sync=False` is `no_sync()` accumulation.
* pipeline engine: `prepare_for_backward(finalize_at_backward_end=False)` before the backward whose
  gradients should be reduced as they appear (e.g. the last microbatch), then `finalize()` at the
  end of the step; or no arming at all and just `finalize()`, which reduces every `param.grad`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

logger = logging.getLogger(__name__)

__all__ = ["GradBucket", "GradReducer", "DEFAULT_BUCKET_CAP_MB", "DEFAULT_FIRST_BUCKET_MB"]

DEFAULT_BUCKET_CAP_MB = 25.0
DEFAULT_FIRST_BUCKET_MB = 1.0  # torch DDP's dist._DEFAULT_FIRST_BUCKET_BYTES

CommHook = Callable[[Any, "GradBucket"], torch.futures.Future]


class GradBucket:
    """What a communication hook receives; the interface of torch's `dist.GradBucket`."""

    def __init__(self, index: int, buffer: torch.Tensor, gradients: List[torch.Tensor],
                 parameters: List[torch.Tensor], is_last: bool) -> None:
        self._index, self._buffer, self._grads = index, buffer, gradients
        self._params, self._is_last = parameters, is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flattened gradients of this bucket (one 1-D tensor)."""
        return self._buffer

    def gradients(self) -> List[torch.Tensor]:
        """Per-parameter views of `buffer()`, shaped like the parameters."""
        return self._grads

    def parameters(self) -> List[torch.Tensor]:
        return self._params

    def is_last(self) -> bool:
        return self._is_last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)


class _Bucket:
    """One flat buffer: [gradients of its parameters | one 'missing here' flag per parameter]."""

    def __init__(self, index: int, members: List[int], params: Sequence[torch.Tensor]) -> None:
        self.index = index
        self.members = members  # indices into the reducer's parameter list
        first = params[members[0]]
        self.dtype, self.device = first.dtype, first.device
        numels = [params[i].numel() for i in members]
        self.numel = sum(numels)
        self.buffer = torch.zeros(self.numel + len(members), dtype=self.dtype, device=self.device)
        self.grads = self.buffer[: self.numel]
        self.flags = self.buffer[self.numel:]
        self.views: List[torch.Tensor] = []
        offset = 0
        for i, n in zip(members, numels):
            self.views.append(self.grads[offset: offset + n].view(params[i].shape))
            offset += n
        self.pending = len(members)  # gradients still to arrive this round
        # Divide-while-copying per tensor pays off only when the per-call cost is amortised.
        self.fused_scale = self.numel >= 65536 * len(members)
        self.flags_dirty = False
        self.work: Any = None  # Work (default allreduce) or Future (comm hook)


class GradReducer:
    """Average the gradients of `params` over `process_group`, overlapping with backward.

    Args:
        params: the parameters to reduce (those without requires_grad are skipped). Their set and
            order must be identical on every rank of the group (callers check it).
        process_group: a torch process group; None = the default group.
        names: display names for the parameters (same length as `params`), used in errors.
        bucket_cap_mb: bucket size (MiB) after the first bucket.
        first_bucket_mb: size of the first bucket, which carries the last layers' gradients.
        gradient_as_bucket_view: make `param.grad` views of the bucket buffers (saves a copy and
            the memory of the gradients).
        find_unused_parameters: a parameter without a gradient in a synced backward counts as
            zeros (instead of an error naming it).
    """

    def __init__(self, params: Iterable[torch.Tensor],
                 process_group: Optional[dist.ProcessGroup] = None, *,
                 names: Optional[Sequence[str]] = None,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
                 first_bucket_mb: float = DEFAULT_FIRST_BUCKET_MB,
                 gradient_as_bucket_view: bool = False,
                 find_unused_parameters: bool = False) -> None:
        all_params = list(params)
        if names is not None and len(names) != len(all_params):
            raise ValueError(f"GradReducer: {len(names)} names for {len(all_params)} parameters")
        seen: set = set()
        self.params: List[torch.Tensor] = []
        self.names: List[str] = []
        for k, p in enumerate(all_params):
            if not p.requires_grad or id(p) in seen:
                continue
            if not p.is_leaf:
                raise ValueError(f"GradReducer: {_name(names, k, p)} is not a leaf tensor; only "
                                 "parameters (leaves) accumulate gradients")
            seen.add(id(p))
            self.params.append(p)
            self.names.append(_name(names, k, p))
        if bucket_cap_mb <= 0 or first_bucket_mb <= 0:
            raise ValueError(f"GradReducer: bucket_cap_mb={bucket_cap_mb} and "
                             f"first_bucket_mb={first_bucket_mb} must be positive")
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group) if dist.is_initialized() else 1
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.find_unused_parameters = find_unused_parameters
        self._scale = 1.0 / self.world_size
        self._local_only = self.world_size == 1  # no communication at all
        self._hook: Optional[CommHook] = None
        self._hook_state: Any = None
        self.buckets = self._build_buckets(bucket_cap_mb, first_bucket_mb)
        self._bucket_of: List[_Bucket] = [None] * len(self.params)  # type: ignore[list-item]
        self._slot: List[int] = [0] * len(self.params)
        for b in self.buckets:
            for s, i in enumerate(b.members):
                self._bucket_of[i], self._slot[i] = b, s
        if gradient_as_bucket_view:
            for i, p in enumerate(self.params):
                if p.grad is not None:
                    view = self._view(i)
                    view.copy_(p.grad)
                    p.grad = view
        # Round state.
        self._round = 0  # synced rounds finished so far (named in errors as "synced backward #n")
        self._missing_here = 0  # parameters this rank staged as lacking in the current round
        self._ready = [False] * len(self.params)
        self._armed = False
        self._auto_finalize = True
        self._callback_queued = False
        self._next = 0  # next bucket to launch: buckets go out strictly in index order
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                         for i, p in enumerate(self.params)]
        logger.debug("GradReducer: %d parameters in %d buckets, world size %d",
                     len(self.params), len(self.buckets), self.world_size)

    # ----------------------------------------------------------------------------- public API

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Replace the default allreduce: `hook(state, bucket) -> Future[Tensor]`, as in torch DDP.

        As in torch DDP, the hook owns the averaging: its result is used as-is (torch's
        `default_hooks.allreduce_hook` divides by the group size itself).
        """
        if self._hook is not None:
            raise RuntimeError("register_comm_hook: a communication hook is already registered; "
                               "it can be registered only once")
        if not callable(hook):
            raise TypeError(f"register_comm_hook: hook={hook!r} is not callable")
        self._hook, self._hook_state = hook, state
        self._local_only = False  # a hook runs even on one process, as in torch DDP

    def prepare_for_backward(self, sync: bool = True,
                             finalize_at_backward_end: bool = True) -> None:
        """Arm (sync=True) or disarm the reduction of the next backward's gradients.

        With `finalize_at_backward_end`, the armed backward waits for its reductions before it
        returns; otherwise the caller must call `finalize()`.
        """
        if any(b.work is not None for b in self.buckets):
            logger.warning("GradReducer: a previous synced backward did not finish its reduction "
                           "(it raised?); discarding it")
        self._reset_round()
        self._armed = bool(sync)
        self._auto_finalize = finalize_at_backward_end

    @property
    def armed(self) -> bool:
        return self._armed

    def mark_outputs(self, outputs: Any) -> Any:
        """Hook the tensors in `outputs` that require grad so that a backward through them queues
        the end-of-backward reduction even if it reaches no parameter; returns `outputs` as is.

        Without it, a rank whose backward reaches no parameter fires no gradient hook, so it would
        never join the round's allreduces and the other ranks would wait until the timeout; with
        it, that rank reduces zeros flagged as missing and every rank raises the same error.
        (A tensor hook rather than torch DDP's identity autograd node: the outputs stay the
        user's own tensors, free to be modified in place, with no copy.)"""
        if not (self._armed and self._auto_finalize):
            return outputs
        for t in tree_flatten(outputs)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._output_grad_hook)
        return outputs

    def finalize(self) -> None:
        """Reduce everything not reduced yet, wait, and leave the averages in `param.grad`.

        After an armed backward this completes it; without one it reduces every `param.grad`
        (a parameter whose grad is None then counts as unused). Raises, on every rank, if some
        rank lacked a gradient and `find_unused_parameters` is False.
        """
        armed = self._armed
        self._round += 1
        try:
            if self._local_only:
                missing = [i for i in range(len(self.params)) if self._lacks_grad(i, armed)]
                if missing and not self.find_unused_parameters:
                    raise RuntimeError(self._unused_message({i: 1 for i in missing}))
                return
            ready = self._ready
            for b in self.buckets[self._next:]:
                # Large-tensor buckets already hold their arrived gradients (see _on_grad_ready).
                todo = [s for s, i in enumerate(b.members) if not (b.fused_scale and ready[i])]
                lacking = [s for s in todo
                           if not ready[b.members[s]] and self._lacks_grad(b.members[s], armed)]
                self._stage(b, todo, lacking)
                self._launch(b)
            self._next = len(self.buckets)
            hook_flags = self._hook_flags() if self._hook is not None else None
            for b in self.buckets:
                self._complete(b)
            self._settle_unused(hook_flags)
        finally:
            self._reset_round()

    def remove(self) -> None:
        """Detach the autograd hooks (the reducer is unusable afterwards)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # ----------------------------------------------------------------------------- internals

    def _build_buckets(self, cap_mb: float, first_mb: float) -> List[_Bucket]:
        buckets: List[_Bucket] = []
        members: List[int] = []
        size, limit, key = 0, min(first_mb, cap_mb) * 2**20, None
        for i in reversed(range(len(self.params))):
            p = self.params[i]
            k = (p.dtype, p.device)
            if members and k != key:  # a buffer holds one dtype on one device
                buckets.append(_Bucket(len(buckets), members, self.params))
                members, size, limit = [], 0, cap_mb * 2**20
            key = k
            members.append(i)
            size += p.numel() * p.element_size()
            if size >= limit:
                buckets.append(_Bucket(len(buckets), members, self.params))
                members, size, limit = [], 0, cap_mb * 2**20
        if members:
            buckets.append(_Bucket(len(buckets), members, self.params))
        return buckets

    def _view(self, i: int) -> torch.Tensor:
        return self._bucket_of[i].views[self._slot[i]]

    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            self._on_grad_ready(i)
        # The pipeline's fused weight gradients (modelparallel weight_grad.py) may skip this hook:
        # under the pipeline the reducer is never armed and reduces `.grad` at the step's end.
        hook._smshim_reducer = True  # type: ignore[attr-defined]
        return hook

    def _reset_round(self) -> None:
        self._missing_here = 0
        self._ready = [False] * len(self.params)
        self._armed = False
        self._callback_queued = False
        self._next = 0
        for b in self.buckets:
            b.pending = len(b.members)
            b.work = None
            if b.flags_dirty:
                b.flags.zero_()
                b.flags_dirty = False

    def _on_grad_ready(self, i: int) -> None:
        # Runs once per parameter per backward: kept lean (the many-small-tensors case pays it).
        if not self._armed:
            return  # no_sync / unarmed backward: gradients just accumulate locally
        ready = self._ready
        if ready[i]:
            raise RuntimeError(
                f"parameter {self.names[i]!r} received its gradient twice in one synced backward: "
                "call forward before each backward (or, for several backward calls per step, "
                "reduce with finalize() at the end)")
        ready[i] = True
        if not self._callback_queued and self._auto_finalize:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_in_backward)
        if self._local_only:
            return  # nothing to communicate; only unused parameters are checked at the end
        b = self._bucket_of[i]
        if b.fused_scale:
            # Large tensors: copy each as it arrives, while backward still computes (as torch does),
            # so that only the last one is left when the bucket fills.
            self._stage(b, (self._slot[i],), ())
        b.pending -= 1
        if b.pending == 0 and b.index == self._next:
            buckets = self.buckets
            while self._next < len(buckets) and buckets[self._next].pending == 0:
                b = buckets[self._next]
                if not b.fused_scale:
                    self._stage(b, range(len(b.members)), ())
                self._launch(b)
                self._next += 1

    def _output_grad_hook(self, _grad: torch.Tensor) -> None:
        # A backward reached the module's outputs: make sure the reduction runs at its end.
        if self._armed and self._auto_finalize and not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_in_backward)

    def _finalize_in_backward(self) -> None:
        if self._armed:
            self.finalize()

    def _lacks_grad(self, i: int, armed: bool) -> bool:
        """Whether parameter i contributes nothing this round."""
        if armed and not self.find_unused_parameters:
            return not self._ready[i]  # its hook did not fire: unused in this backward
        return self.params[i].grad is None

    def _stage(self, b: _Bucket, slots: Iterable[int], lacking: Sequence[int]) -> None:
        """Put the gradients of bucket b's `slots` into it, pre-divided by the group size (unless a
        comm hook averages); zeros and a flag for the slots in `lacking` (no gradient here).

        Buckets of many small tensors are always staged whole (one batched copy and one division
        beat a Python-level call per tensor); large-tensor buckets slot by slot, dividing while
        copying (one pass over the data)."""
        params, views, members = self.params, b.views, b.members
        scale = self._hook is None
        for s in lacking:
            views[s].zero_()
            b.flags[s] = 1
            b.flags_dirty = True
        self._missing_here += len(lacking)
        grads = [(s, params[members[s]].grad) for s in slots if s not in lacking]
        # "stale": gradients living outside the bucket (no view mode, first step, grads set None).
        stale = [(s, g) for s, g in grads if g is not None and g is not views[s]]
        if b.fused_scale:
            for s, g in grads:
                if g is None:
                    continue
                if g is views[s]:
                    if scale:
                        g.mul_(self._scale)
                elif scale:
                    torch.mul(g, self._scale, out=views[s])
                else:
                    views[s].copy_(g)
        else:
            if stale:
                torch._foreach_copy_([views[s] for s, _ in stale], [g for _, g in stale])
            if scale:
                b.grads.mul_(self._scale)
        if self.gradient_as_bucket_view:
            for s, _ in stale:
                params[members[s]].grad = views[s]

    def _launch(self, b: _Bucket) -> None:
        if self._hook is None:
            b.work = dist.all_reduce(b.buffer, group=self.process_group, async_op=True)
        else:
            bucket = GradBucket(b.index, b.grads, b.views, [self.params[i] for i in b.members],
                                b.index == len(self.buckets) - 1)
            b.work = self._hook(self._hook_state, bucket)
            if not callable(getattr(b.work, "wait", None)):
                raise TypeError(f"communication hook returned {type(b.work).__name__}, "
                                "expected a torch.futures.Future")

    def _complete(self, b: _Bucket) -> None:
        """Wait for bucket b and copy its averages into the gradients."""
        try:
            result = b.work.wait()
        except RuntimeError as e:
            raise RuntimeError(
                f"DistributedDataParallel: the gradient allreduce of synced backward "
                f"#{self._round} (bucket {b.index}) failed on rank {_global_rank()}: {e}. Another "
                "rank probably failed or exited: see its error") from e
        if self._hook is not None:
            if isinstance(result, (list, tuple)):
                result = result[0]
            if result.data_ptr() != b.grads.data_ptr():
                b.grads.copy_(result.reshape(-1))
        b.work = None
        if self.gradient_as_bucket_view:
            return  # p.grad already is the bucket view (or None for an unused parameter)
        grads, views = [], []
        for s, i in enumerate(b.members):
            g = self.params[i].grad
            if g is not None:
                grads.append(g)
                views.append(b.views[s])
        if grads:
            torch._foreach_copy_(grads, views)

    def _all_flags(self) -> torch.Tensor:
        """Every bucket's flags in one float32 tensor (buckets may differ in dtype and device)."""
        if not self.buckets:
            return torch.zeros(0)
        device = self.buckets[0].device
        return torch.cat([b.flags.to(device=device, dtype=torch.float32) for b in self.buckets])

    def _hook_flags(self) -> torch.Tensor:
        """With a comm hook the buffer seen by the hook holds gradients only: sum flags apart."""
        flags = self._all_flags()
        dist.all_reduce(flags, group=self.process_group)
        return flags

    def _settle_unused(self, hook_flags: Optional[torch.Tensor]) -> None:
        """Act on the summed flags: error on every rank, or settle the grads of unused params."""
        flags = self._all_flags() if hook_flags is None else hook_flags
        if not bool(flags.any()):  # the common case: one small check per round
            return
        order = [i for b in self.buckets for i in b.members]
        counts: Dict[int, int] = {i: int(round(float(c))) for i, c in zip(order, flags.tolist())
                                  if c != 0}
        for b in self.buckets:
            b.flags_dirty = True  # reduced flags stay in the buffers: cleared at the next round
        if not self.find_unused_parameters:
            raise RuntimeError(self._unused_message(counts, self._missing_per_rank()))
        for i, count in counts.items():
            p = self.params[i]
            if count >= self.world_size:
                continue  # no rank used it: grad stays None, as on one process
            if p.grad is None:
                view = self._view(i)
                p.grad = view if self.gradient_as_bucket_view else view.clone()

    def _missing_per_rank(self) -> Dict[int, int]:
        """Error path only (every rank is on it): global rank -> parameters it had no gradient for."""
        mine = torch.tensor([self._missing_here], dtype=torch.int64, device=self.buckets[0].device)
        got = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(got, mine, group=self.process_group)
        out = {}
        for r, t in enumerate(got):
            g = r if self.process_group is None else dist.get_global_rank(self.process_group, r)
            out[g] = int(t.item())
        return out

    def _unused_message(self, counts: Dict[int, int],
                        per_rank: Optional[Dict[int, int]] = None) -> str:
        listed = ", ".join(
            f"{self.names[i]!r}" + (f" (no gradient on {c} of {self.world_size} ranks)"
                                    if self.world_size > 1 else "")
            for i, c in sorted(counts.items()))
        where = ""
        if per_rank:
            n = len(self.params)
            parts = [f"rank {r}: " + ("its backward reached no parameter" if m == n
                                      else f"no gradient for {m} of {n} parameters")
                     for r, m in sorted(per_rank.items()) if m]
            where = f" ({'; '.join(parts)})"
        return (f"DistributedDataParallel: in synced backward #{self._round} (step "
                f"{self._round}), parameters received no gradient{where}: {listed}. Make every "
                f"parameter take part in the loss on every rank, remove the unused ones, or use "
                f"find_unused_parameters=True")


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _name(names: Optional[Sequence[str]], k: int, p: torch.Tensor) -> str:
    if names is not None:
        return names[k]
    return f"parameter #{k} {tuple(p.shape)}"
