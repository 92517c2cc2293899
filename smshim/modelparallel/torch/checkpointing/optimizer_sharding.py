"""`shard_optimizer_state` (ZeRO stage 1) on smshim's own data-parallel reducer.

Gradients are still averaged over the data-parallel replicas (ddp), so every replica holds the
same gradients for its pipeline stage's parameters. Each of those parameters gets one owner among
the d replicas (greedy by size, the same plan on every replica because their local parameters are
the same); a replica steps only the parameters it owns, so torch optimizers (which create state
lazily, for parameters that have a gradient) keep state for about 1/d of them. After the step
every owner broadcasts its updated parameters to the other replicas (one flat buffer per owner
and dtype), which leaves the replicas identical, as unsharded training would.

This is the same idea as torch.distributed.optim.ZeroRedundancyOptimizer; it is done here rather
than with that class because ZeroRedundancyOptimizer builds its own optimizer over a parameter
subset, which would change the wrapped optimizer's param_groups (lr schedulers, the parameter
indexing of smp's state dicts) and does not know about pipeline stages whose parameters are freed.

State dicts: `gather()` collects the owners' state into one dict over the DP group (a collective),
which is what an unsharded optimizer would hold; loading keeps only the owned parameters' state,
so a gathered (or merged, see checkpoint.py) state loads at any data-parallel degree.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Sequence

import torch
import torch.distributed as dist

from smshim.modelparallel.torch.comm import CommGroup, allgather
from smshim.modelparallel.torch.state import state

logger = logging.getLogger(__name__)

__all__ = ["ShardPlan", "SHARD_DP_RANK_KEY", "SHARD_DP_SIZE_KEY", "merge_shards"]

SHARD_DP_RANK_KEY = "_smp_shard_dp_rank"
SHARD_DP_SIZE_KEY = "_smp_shard_dp_size"


class ShardPlan:
    """Which DP replica steps (and keeps the optimizer state of) each local parameter."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        # The replicas are the reduced-data-parallel group: with tensor parallelism the DP group
        # also spans tensor-parallel ranks, whose parameters are different shards (rdp = dp with
        # tp = 1).
        topo = state.topology
        self.dp_size, self.dp_rank = topo.rdp_size, topo.rdp_rank
        self.members: List[int] = topo.group(CommGroup.RDP_GROUP)
        self.group = state.process_group(CommGroup.RDP_GROUP)
        self.params = list(params)
        # Largest first onto the least loaded replica; ties go to the lower index, so the plan
        # depends only on the parameter list (identical on every replica).
        load = [0] * self.dp_size
        self.owner: Dict[int, int] = {}
        order = sorted(range(len(self.params)), key=lambda i: (-self.params[i].numel(), i))
        for i in order:
            r = min(range(self.dp_size), key=lambda k: (load[k], k))
            self.owner[id(self.params[i])] = r
            load[r] += self.params[i].numel()
        self.owned = [p for p in self.params if self.owner[id(p)] == self.dp_rank]
        self.others = [p for p in self.params if self.owner[id(p)] != self.dp_rank]
        logger.info("shard_optimizer_state: dp rank %d of %d steps %d of %d local parameters "
                    "(%d of %d elements)", self.dp_rank, self.dp_size, len(self.owned),
                    len(self.params), sum(p.numel() for p in self.owned),
                    sum(p.numel() for p in self.params))

    def owns(self, p: torch.Tensor) -> bool:
        return self.owner.get(id(p), self.dp_rank) == self.dp_rank

    def broadcast_parameters(self) -> None:
        """Every owner sends its freshly stepped parameters to the other replicas."""
        with torch.no_grad():
            for r in range(self.dp_size):
                mine = [p for p in self.params if self.owner[id(p)] == r]
                by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
                for p in mine:
                    by_dtype.setdefault(p.dtype, []).append(p)
                for dtype in sorted(by_dtype, key=str):
                    ps = by_dtype[dtype]
                    flat = torch.cat([p.data.reshape(-1) for p in ps])
                    dist.broadcast(flat, self.members[r], group=self.group)
                    if r != self.dp_rank:
                        offset = 0
                        for p in ps:
                            n = p.numel()
                            p.data.copy_(flat[offset:offset + n].view_as(p.data))
                            offset += n

    def drop_foreign_state(self, optimizer: torch.optim.Optimizer) -> None:
        """After a load: keep only the state of the parameters this replica steps."""
        for p in self.others:
            optimizer.state.pop(p, None)

    def gather(self, local_state: Dict[int, Any]) -> Dict[int, Any]:
        """The union of the replicas' optimizer states (indexed by parameter index): what one
        unsharded optimizer would hold. A collective of the replicas (RDP group)."""
        merged: Dict[int, Any] = {}
        for part in allgather(local_state, CommGroup.RDP_GROUP):
            for i, v in part.items():
                merged.setdefault(i, v)
        return {i: merged[i] for i in sorted(merged)}


def merge_shards(shards: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One optimizer state dict from the per-replica shards `local_state_dict(
    gather_if_shard=False)` wrote (smp.save(..., v3=True)); it loads at any DP degree."""
    base = dict(shards[0])
    state_: Dict[Any, Any] = {}
    for sd in shards:
        for i, v in sd.get("state", {}).items():
            state_.setdefault(i, v)
    base["state"] = {i: state_[i] for i in sorted(state_)}
    base.pop(SHARD_DP_RANK_KEY, None)
    base.pop(SHARD_DP_SIZE_KEY, None)
    return base
