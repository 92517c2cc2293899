"""`tsm.state`: the job's degrees, ranks and process groups once `tsm.init()` has run.

One `State` object lives for the process (also importable as `torch.sagemaker.state_handler.state`);
`init()` fills it in place, so references scripts took earlier stay valid. Degree attributes are
plain writable fields (AWS's scripts set them to 1 when they skip `tsm.transform`).
In fallback mode (no TP/CP/EP and hybrid_shard_degree 0 or 1: stock FSDP behaviour) the docs say
`tp_process_group` and `rep_rank_process_group` are None; so they are here.
"""

from __future__ import annotations

from typing import Any, List, Optional

from smshim.torch_sagemaker import topology
from smshim.torch_sagemaker.config import Degrees, TsmConfig
from smshim.torch_sagemaker.rng import RngStateTracker


class Ranker:
    """Replica arithmetic: replica 0 is the "action" replica that writes sharded checkpoints."""

    def __init__(self, degrees: Degrees) -> None:
        self._d = degrees

    def get_rep_rank(self, global_rank: int) -> int:
        return topology.coords(self._d, global_rank).rep

    def get_rep_groups(self) -> List[List[int]]:
        """Every set of ranks that hold identical shards (one per shard position), in a fixed order."""
        return topology.replicate_groups(self._d)

    def get_dp_rank(self, global_rank: int) -> int:
        return global_rank // (self._d.tp * self._d.cp)


class State:
    def __init__(self) -> None:
        self.initialized = False
        self.config: Optional[TsmConfig] = None
        self.degrees: Optional[Degrees] = None
        self.mesh: Any = None
        self.rank = 0
        self.world_size = 1
        self.hybrid_shard_degree = 0
        self.tensor_parallel_degree = 1
        self.context_parallel_degree = 1
        self.expert_parallel_degree = 1
        self.tp_rank = 0
        self.cp_rank = 0
        self.ep_rank = 0
        self.dp_rank = 0
        self.dp_size = 1
        self.tp_process_group = None
        self.cp_process_group = None
        self.ep_process_group = None
        self.rep_rank_process_group = None
        self.world_process_group = None
        self.sm_activation_offloading = False
        self.activation_loading_horizon = 2
        self.fsdp_cache_flush_warnings = True
        self.allow_empty_shards = False
        self.random_seed = 12345
        self.ranker: Optional[Ranker] = None
        self.background_groups: dict = {}  # gloo twins by ranks, for background checkpoint writes
        self._rng_tracker = RngStateTracker()

    # Aliases scripts use interchangeably with the degree names.
    tp_size = property(lambda s: s.tensor_parallel_degree,
                       lambda s, v: setattr(s, "tensor_parallel_degree", v))
    cp_size = property(lambda s: s.context_parallel_degree,
                       lambda s, v: setattr(s, "context_parallel_degree", v))
    ep_size = property(lambda s: s.expert_parallel_degree,
                       lambda s, v: setattr(s, "expert_parallel_degree", v))

    def get_rng_state_tracker(self) -> RngStateTracker:
        return self._rng_tracker

    @property
    def fallback(self) -> bool:
        """Stock-FSDP mode: no model parallelism and hybrid_shard_degree 0 or 1."""
        d = self.degrees
        return d is None or (d.mp == 1 and d.cp == 1 and self.hybrid_shard_degree in (0, 1))

    def __repr__(self) -> str:
        if not self.initialized:
            return "tsm.state(not initialized: call tsm.init())"
        return (f"tsm.state(rank={self.rank}/{self.world_size}, hybrid_shard_degree="
                f"{self.hybrid_shard_degree}, tp={self.tp_size}, cp={self.cp_size}, ep={self.ep_size}, "
                f"shard={self.degrees.shard}, replicas={self.degrees.replicas})")


state = State()
