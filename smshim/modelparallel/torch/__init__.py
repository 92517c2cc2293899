"""`smdistributed.modelparallel.torch` (import as `smp`): SageMaker model parallelism v1.

This folder is the public face. Its ground modules (errors, config, topology, state, comm) are
what every part below stands on; its API (this file, model, optimizer, step, amp, nn/) is built
from the parts in the subfolders: `pipeline/` (the engine), `tensor_parallel/`, `precision/`,
`checkpointing/`. Imports point from the API down to the parts and from the parts down to the
ground, never back up (tests/test_imports.py).

This file holds initialisation, ranks and groups, object communication and the Adv entry points;
the API built on the engine (step, DistributedModel, DistributedOptimizer, partitioning,
checkpoints) is imported at the end.

`smp.init(config)` merges `config` with SM_HP_MP_PARAMETERS (the environment wins), validates it
(config.py: every rank raises the same error before any collective), brings up the default process
group (smshim.runtime.launch; `ddp_dist_backend` picks gloo/nccl), computes this rank's placement
(topology.py) and creates, on every rank in the same order, one dedicated gloo group for smp's
object collectives and a torch process group for each group kind (groups with identical members
share one ProcessGroup; WORLD is the default group). They exist whether or not `ddp` is set.
smp.send/broadcast messages go through the job's c10d store (see comm.py).

Importing this module calls `init()` when SM_HP_MP_PARAMETERS is set and the process was started by
a launcher (mpirun, torchrun, `smshim run`), unless SMP_MANUAL_INIT=1. A second `init()` only logs.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.util
import os
import threading
from typing import Any, ContextManager, Dict, Iterator, List, Mapping, Optional

import torch
import torch.distributed as dist

from smshim.runtime import launch as _runtime
from smshim.modelparallel import __version__  # noqa: F401  (smp.__version__ as in SageMaker)
from smshim.modelparallel.torch import amp, nn
from smshim.modelparallel.torch.precision import mixed_precision  # noqa: F401  (smp.amp, smp.nn)
from smshim.modelparallel.torch.comm import (
    CommGroup,
    RankType,
    allgather,
    barrier,
    broadcast,
    dp_barrier,
    drain_at_exit,
    mp_barrier,
    pp_barrier,
    rdp_barrier,
    recv_from,
    send,
    tp_barrier,
)
from smshim.modelparallel.torch.config import ENV_VAR, SMPConfig, resolve_config
from smshim.modelparallel.torch.errors import (
    BwdExecutionNotInStepFnError,
    FwdExecutionNotInStepFnError,
    InvalidPartitionIDError,
    MultipleDistributedModelError,
    SMPConfigError,
    SMPError,
    SMPNotInitializedError,
    SMPRuntimeError,
    SMPUnsupportedError,
    SMPValidationError,
    TensorSplitError,
    UnsafeCheckpointError,
)
from smshim.modelparallel.torch.state import require_init, state
from smshim.modelparallel.torch.topology import Topology
from smshim.modelparallel.torch.tensor_parallel import replace as _tp
from smshim.modelparallel.torch.tensor_parallel import collectives as tp_comm

logger = logging.getLogger(__name__)

WORLD = CommGroup.WORLD
PP_GROUP = CommGroup.PP_GROUP
TP_GROUP = CommGroup.TP_GROUP
RDP_GROUP = CommGroup.RDP_GROUP
DP_GROUP = CommGroup.DP_GROUP
MP_GROUP = CommGroup.MP_GROUP
WORLD_RANK = RankType.WORLD_RANK
PP_RANK = RankType.PP_RANK
TP_RANK = RankType.TP_RANK
RDP_RANK = RankType.RDP_RANK
DP_RANK = RankType.DP_RANK
MP_RANK = RankType.MP_RANK

# Creation order of the process groups; every rank walks it identically.
_GROUP_ORDER = (CommGroup.PP_GROUP, CommGroup.TP_GROUP, CommGroup.RDP_GROUP, CommGroup.DP_GROUP,
                CommGroup.MP_GROUP)

_init_lock = threading.Lock()
_init_config: Optional[Dict[str, Any]] = None  # the dict the successful init() was given


# Initialisation -----------------------------------------------------------------------------------
def _backend(cfg: SMPConfig) -> Optional[str]:
    if cfg.ddp_dist_backend == "auto":
        return None  # _runtime's default: nccl with CUDA, else gloo
    if cfg.ddp_dist_backend == "nccl" and not torch.cuda.is_available():
        raise SMPConfigError(
            "smp config: 'ddp_dist_backend'='nccl' needs CUDA devices and this host has none; "
            "use 'gloo' or 'auto'"
        )
    return cfg.ddp_dist_backend


def _apply_ddp_port(cfg: SMPConfig, info: _runtime.LaunchInfo) -> None:
    """Use ddp_port as the rendezvous port when the launcher did not fix one."""
    port = cfg.ddp_port
    if port is None or dist.is_initialized():
        return
    if info.master_port is not None:
        if port != info.master_port:
            logger.warning("smp: ddp_port=%d is not used: the launcher's rendezvous is at "
                           "MASTER_PORT=%d", port, info.master_port)
        return
    if port == 0:
        return  # 0: let the runtime pick a port
    if info.master_addr is None:
        if info.local_size != info.world_size:
            logger.warning("smp: ddp_port=%d is not used: with several hosts it needs MASTER_ADDR "
                           "(or SM_HOSTS) to say where rank 0 is", port)
            return
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)


def _create_groups(topo: Topology) -> tuple:
    tmo = _runtime.timeout()
    # The object-message group comes first, on gloo whatever the default backend.
    object_group = dist.new_group(backend="gloo", timeout=tmo)
    by_members: Dict[tuple, Any] = {tuple(range(topo.size)): dist.group.WORLD}
    groups: Dict[int, Any] = {CommGroup.WORLD: dist.group.WORLD}
    for kind in _GROUP_ORDER:
        for members in topo.all_groups(kind):
            if tuple(members) not in by_members:
                by_members[tuple(members)] = dist.new_group(members, timeout=tmo)
        groups[kind] = by_members[tuple(topo.group(kind))]
    # smp.send/broadcast messages live in the job's store under their own prefix; the elastic
    # restart count keeps a restarted job from reading a previous attempt's leftovers.
    attempt = _runtime.attempt_id()
    store = dist.PrefixStore(f"smshim/smp/{attempt}/", dist.distributed_c10d._get_default_store())
    return groups, object_group, store


def _log_second_init(config: Optional[Mapping[str, Any]]) -> None:
    """A second init() changes nothing; say so, louder if its config would have differed."""
    differs = ""
    if config is not None:
        try:
            wanted = resolve_config(config, state.topology.size)
            differs = ", ".join(f"{k}={getattr(wanted, k)!r}"
                                for k in SMPConfig.__dataclass_fields__
                                if getattr(wanted, k) != getattr(state.cfg, k))
        except (SMPConfigError, SMPUnsupportedError) as e:
            differs = f"an invalid config ({e})"
    if differs:
        logger.warning(
            "smp.init(%r) ignored: smp is already initialised (from %s), and this config would "
            "have set %s. Set SMP_MANUAL_INIT=1 to initialise from the script's smp.init(config).",
            dict(config), "smp.init" if _init_config is not None else ENV_VAR, differs)
    else:
        logger.info("smp.init() called again: smp is already initialised")


def init(config: Optional[Mapping[str, Any]] = None) -> None:
    """Initialise smp: merge and validate the config, bring up the process groups."""
    global _init_config
    with _init_lock:
        if state.initialized:
            _log_second_init(config)
            return
        info = _runtime.detect_launch()
        world = dist.get_world_size() if dist.is_initialized() else info.world_size
        cfg = resolve_config(config, world,
                             launcher=None if dist.is_initialized() else info.launcher)
        backend = _backend(cfg)
        _apply_ddp_port(cfg, info)
        if dist.is_initialized() and backend is not None and dist.get_backend() != backend:
            logger.warning("smp: ddp_dist_backend=%r, but torch.distributed is already initialised "
                           "with %r; keeping it", backend, dist.get_backend())
        info = _runtime.init_distributed(backend)
        if torch.cuda.is_available():
            torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
        topo = Topology(dist.get_rank(), dist.get_world_size(), cfg.pipeline_parallel_degree,
                        cfg.tensor_parallel_degree, cfg.placement_strategy)
        groups, object_group, store = _create_groups(topo)
        if topo.tp_size > 1:
            # One TP group per microbatch (why: tp_comm's docstring); all ranks, same order.
            tp_comm.create_groups(topo.all_groups(CommGroup.TP_GROUP),
                                  topo.group(CommGroup.TP_GROUP), cfg.microbatches,
                                  _runtime.timeout())
        state._set_initialized(cfg, topo, info, groups, object_group, store)
        # At exit, stop the pipeline (its transport's receivers) before the groups are destroyed.
        _runtime.before_teardown(state.reset)
        # Runs at interpreter exit and at the end of a multiprocessing child alike.
        multiprocessing.util.Finalize(None, drain_at_exit, exitpriority=10)
        _init_config = dict(config) if config is not None else None
        logger.info("smp initialised: rank %d/%d pp_rank %d/%d dp_rank %d/%d (placement %s, "
                    "microbatches %d, pipeline %s)", topo.rank, topo.size, topo.pp_rank,
                    topo.pp_size, topo.dp_rank, topo.dp_size, cfg.placement_strategy,
                    cfg.microbatches, cfg.pipeline)


def is_initialized() -> bool:
    return state.initialized


def reset() -> None:
    """Forget the DistributedModel/optimizer and step state (config and groups stay)."""
    state.reset()


def num_microbatches() -> int:
    require_init("smp.num_microbatches()")
    return state.cfg.microbatches


# Ranks and groups ---------------------------------------------------------------------------------
def _topo(fn: str) -> Topology:
    require_init(f"smp.{fn}()")
    return state.topology


def rank() -> int:
    return _topo("rank").rank


def size() -> int:
    return _topo("size").size


def local_rank() -> int:
    require_init("smp.local_rank()")
    return state.launch.local_rank


def local_size() -> int:
    require_init("smp.local_size()")
    return state.launch.local_size


def pp_rank() -> int:
    return _topo("pp_rank").pp_rank


def pp_size() -> int:
    return _topo("pp_size").pp_size


def dp_rank() -> int:
    return _topo("dp_rank").dp_rank


def dp_size() -> int:
    return _topo("dp_size").dp_size


def tp_rank() -> int:
    return _topo("tp_rank").tp_rank


def tp_size() -> int:
    return _topo("tp_size").tp_size


def rdp_rank() -> int:
    return _topo("rdp_rank").rdp_rank


def rdp_size() -> int:
    return _topo("rdp_size").rdp_size


def mp_rank() -> int:
    return _topo("mp_rank").mp_rank


def mp_size() -> int:
    return _topo("mp_size").mp_size


def get_pp_group() -> List[int]:
    return _topo("get_pp_group").group(CommGroup.PP_GROUP)


def get_dp_group() -> List[int]:
    return _topo("get_dp_group").group(CommGroup.DP_GROUP)


def get_mp_group() -> List[int]:
    return _topo("get_mp_group").group(CommGroup.MP_GROUP)


def get_tp_group() -> List[int]:
    return _topo("get_tp_group").group(CommGroup.TP_GROUP)


def get_rdp_group() -> List[int]:
    return _topo("get_rdp_group").group(CommGroup.RDP_GROUP)


def get_world_process_group() -> dist.ProcessGroup:
    return state.process_group(CommGroup.WORLD)


def get_pp_process_group() -> dist.ProcessGroup:
    return state.process_group(CommGroup.PP_GROUP)


def get_dp_process_group() -> dist.ProcessGroup:
    return state.process_group(CommGroup.DP_GROUP)


def get_mp_process_group() -> dist.ProcessGroup:
    return state.process_group(CommGroup.MP_GROUP)


def get_tp_process_group() -> dist.ProcessGroup:
    return state.process_group(CommGroup.TP_GROUP)


def get_rdp_process_group() -> dist.ProcessGroup:
    return state.process_group(CommGroup.RDP_GROUP)


# Adv entry points ---------------------------------------------------------------------------------
# Each is accepted in the form that asks for nothing smshim lacks (a no-op, exactly what SageMaker
# does in that case) and rejected, naming the function and argument, in every other form.
def _unsupported(call: str, what: str) -> SMPUnsupportedError:
    return SMPUnsupportedError(f"{call} is not supported by smshim: {what} is not implemented")


def delay_param_initialization(enabled: bool = True) -> ContextManager[None]:
    """Context for delayed parameter creation: only `enabled=False` (a no-op) is supported."""
    if enabled:
        raise _unsupported("smp.delay_param_initialization(enabled=True)",
                           "delayed parameter initialization")
    return contextlib.nullcontext()


def model_creation(tensor_parallelism: bool = False, dtype: Optional[torch.dtype] = None,
                   **tensor_parallel_config: Any) -> ContextManager[None]:
    """Context around model construction: modules created inside get floating-point parameters
    of `dtype` (None: unchanged) and, with `tensor_parallelism`, are marked for tensor
    parallelism (`smp.tensor_parallelism`) configured by `tensor_parallel_config`."""
    tp = (_tp.tensor_parallelism(True, **tensor_parallel_config) if tensor_parallelism
          else contextlib.nullcontext())
    return _both(mixed_precision.creation_dtype(dtype), tp)


@contextlib.contextmanager
def _both(first: ContextManager[None], second: ContextManager[None]) -> Iterator[None]:
    with first, second:
        yield


def tensor_parallelism(enabled: bool = True, **tensor_parallel_config: Any) -> ContextManager[None]:
    """Context: modules created inside are distributed (enabled) or kept whole (not) when the
    DistributedModel is created; the innermost context wins."""
    return _tp.tensor_parallelism(enabled, **tensor_parallel_config)


def set_tensor_parallelism(module: torch.nn.Module, enabled: bool = True,
                           **tensor_parallel_config: Any) -> None:
    """Mark `module` (and its submodules) for tensor parallelism, before DistributedModel."""
    _tp.set_tensor_parallelism(module, enabled, **tensor_parallel_config)


tp_register = _tp.tp_register
tp_register_with_module = _tp.tp_register_with_module


# ==================================================================================================
# The pipeline engine.
# ==================================================================================================
from smshim.modelparallel.torch import model  # noqa: E402,F401  (smp.model.DistributedModel)
from smshim.modelparallel.torch.pipeline.microbatch import StepOutput  # noqa: E402
from smshim.modelparallel.torch.model import DistributedModel  # noqa: E402
from smshim.modelparallel.torch.optimizer import DistributedOptimizer  # noqa: E402
from smshim.modelparallel.torch.pipeline.partitioner import partition, set_partition  # noqa: E402
from smshim.modelparallel.torch.step import step  # noqa: E402
from smshim.modelparallel.torch.checkpointing.checkpoint import (  # noqa: E402
    load,
    resume_from_checkpoint,
    save,
    save_checkpoint,
)
# After the checkpoint.py import above: `smp.checkpoint` is the activation-checkpointing function,
# as in SageMaker (the submodule stays importable as smshim.modelparallel.torch.checkpointing.checkpoint).
from smshim.modelparallel.torch.pipeline.activation_checkpointing import (  # noqa: E402
    checkpoint,
    checkpoint_sequential,
    set_activation_checkpointing,
)


def _auto_init_wanted(env: Mapping[str, str] = os.environ) -> bool:
    if not env.get(ENV_VAR, "").strip():
        return False
    if env.get("SMP_MANUAL_INIT", "").strip().lower() in ("1", "true", "yes"):
        return False
    return _runtime.detect_launch(env).launcher != "single"


if _auto_init_wanted():
    init()
