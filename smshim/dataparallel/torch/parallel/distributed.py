"""`smdistributed.dataparallel.torch.parallel.distributed.DistributedDataParallel`.

Gradients are averaged over the workers in buckets, reduced asynchronously while backward runs
(see smshim/reducer/grad_reducer.py). Parameters and buffers start out as rank 0's.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as _dist

from smshim.runtime import launch as _runtime
from smshim.reducer.grad_reducer import DEFAULT_BUCKET_CAP_MB, GradReducer
from smshim.dataparallel.torch import distributed as _smddp

logger = logging.getLogger(__name__)

__all__ = ["DistributedDataParallel"]

_BROADCAST_BUCKET_BYTES = 250 * 2**20  # what torch DDP uses for its start-up broadcast


class DistributedDataParallel(torch.nn.Module):
    """Data parallelism: every rank holds a full replica; gradients are averaged over all ranks.

    `device_ids` and `output_device` are accepted for parity: the module must already be on the
    device this rank computes on (as smddp requires), and outputs stay where the module puts them.

    After the first synced backward each `param.grad` is a view into a flat communication bucket
    (torch DDP's `gradient_as_bucket_view=True`): no copy back after the allreduce and no second
    copy of the gradients in memory. Setting grads to None (`zero_grad()`) and in-place changes
    keep working; only `param.grad.detach_()` is refused by torch, as for any view.
    """

    def __init__(self, module: torch.nn.Module, device_ids: Optional[Sequence[Any]] = None,
                 output_device: Optional[Any] = None, broadcast_buffers: bool = True,
                 process_group: Any = None, bucket_cap_mb: Optional[float] = None) -> None:
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"DistributedDataParallel: module must be a torch.nn.Module, "
                            f"got {type(module).__name__}")
        if not _dist.is_initialized():
            # smddp scripts call dist.init_process_group() first; be lenient if they did not.
            _runtime.init_distributed()
        self.module = module
        self.device_ids = list(device_ids) if device_ids is not None else None
        self.output_device = output_device
        self.broadcast_buffers = broadcast_buffers
        pg = _smddp._pg(process_group)
        self.process_group = _dist.distributed_c10d._get_default_group() if pg is None else pg
        self.bucket_cap_mb = (DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None
                              else float(bucket_cap_mb))
        self.require_backward_grad_sync = True
        self.world_size = _dist.get_world_size(self.process_group)

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        buffers = [b for b in module.buffers()]
        if self.world_size > 1:
            _check_same_structure(module, self.process_group)
            states = [p.detach() for p in module.parameters()] + [b.detach() for b in buffers]
            if states:
                _dist._broadcast_coalesced(self.process_group, states, _BROADCAST_BUCKET_BYTES, 0)
        self._buffers_to_sync = buffers
        self.reducer = GradReducer([p for _, p in named], self.process_group,
                                   names=[n for n, _ in named], bucket_cap_mb=self.bucket_cap_mb,
                                   gradient_as_bucket_view=True)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            # Like torch DDP, only training forwards that will sync talk to the other ranks: an
            # evaluation under no_grad (often on rank 0 alone) or a no_sync forward must not.
            sync = self.require_backward_grad_sync
            if sync and self.broadcast_buffers and self.world_size > 1 and self._buffers_to_sync:
                _dist._broadcast_coalesced(self.process_group,
                                           [b.detach() for b in self._buffers_to_sync],
                                           _BROADCAST_BUCKET_BYTES, 0)
            self.reducer.prepare_for_backward(sync=sync)
            # A synced backward through the outputs joins the reduction even if it reaches no
            # parameter on this rank (then every rank raises, instead of the others hanging).
            return self.reducer.mark_outputs(self.module(*inputs, **kwargs))
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards of forwards run inside accumulate gradients locally, without communication."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """torch DDP's communication hook: `hook(state, bucket) -> Future[Tensor]`."""
        self.reducer.register_comm_hook(state, hook)


def _signature(module: torch.nn.Module) -> List[Tuple[str, str, Tuple[int, ...], str]]:
    sig = [("parameter", n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()]
    sig += [("buffer", n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()]
    return sig


def _check_same_structure(module: torch.nn.Module, pg: _dist.ProcessGroup) -> None:
    """Raise on every rank if any rank's parameters/buffers differ from rank 0's.

    A fixed-size digest is gathered first (cheap, and it cannot hang on differing sizes); only
    when digests differ are the full lists gathered to name the first difference.
    """
    sig = _signature(module)
    digest = int.from_bytes(hashlib.blake2b(repr(sig).encode(), digest_size=7).digest(), "little")
    device = _comm_device(pg)
    mine = torch.tensor([len(sig), digest], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(_dist.get_world_size(pg))]
    _dist.all_gather(gathered, mine, group=pg)
    if all(torch.equal(g, gathered[0]) for g in gathered):
        return
    sigs: List[Any] = [None] * len(gathered)
    _dist.all_gather_object(sigs, sig, group=pg)
    raise RuntimeError(_mismatch_message(sigs))


def _mismatch_message(sigs: List[List[Tuple[str, str, Tuple[int, ...], str]]]) -> str:
    ref = sigs[0]
    for r, sig in enumerate(sigs[1:], start=1):
        for k in range(max(len(ref), len(sig))):
            a = ref[k] if k < len(ref) else None
            b = sig[k] if k < len(sig) else None
            if a != b:
                def show(e):
                    return "nothing" if e is None else f"{e[0]} {e[1]!r} shape {list(e[2])} {e[3]}"
                return (f"DistributedDataParallel: the model differs across ranks at entry #{k}: "
                        f"rank 0 has {show(a)}, rank {r} has {show(b)}. Every rank must build the "
                        "same model (same parameters and buffers, in the same order, with the same "
                        "shapes) before wrapping it")
    return "DistributedDataParallel: the model differs across ranks"


def _comm_device(pg: _dist.ProcessGroup) -> torch.device:
    if _dist.get_backend(pg) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
