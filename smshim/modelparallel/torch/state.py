"""`smp.state`: the one per-process record of smp's configuration, placement, groups and model.

Before `smp.init()`, `state.initialized` is False and `state.cfg` / `state.topology` raise
SMPNotInitializedError (a clear error instead of an AttributeError on None deep in a script).
`smp.reset()` clears the model-related part (model, optimizer, microbatch, translate functions)
and runs the callbacks the engine registered with `register_reset_callback`; the configuration,
placement and process groups stay, since tearing process groups down in the middle of a job is
not something every rank can do safely.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

from smshim.modelparallel.torch.errors import SMPNotInitializedError

if TYPE_CHECKING:  # runtime imports would be circular (topology -> comm -> state)
    import torch.distributed as dist

    from smshim.runtime.launch import LaunchInfo
    from smshim.modelparallel.torch.config import SMPConfig
    from smshim.modelparallel.torch.topology import Topology

logger = logging.getLogger(__name__)

__all__ = ["state", "State", "ModuleManager", "require_init"]


class ModuleManager:
    """What Hugging Face reads from `smp.state.module_manager` (checkpoint key translation)."""

    def __init__(self) -> None:
        self.translate_functions: List[Callable] = []


class _CallbackHandle:
    def __init__(self, callbacks: List[Callable[[], None]], fn: Callable[[], None]) -> None:
        self._callbacks, self._fn = callbacks, fn

    def remove(self) -> None:
        if self._fn in self._callbacks:
            self._callbacks.remove(self._fn)


class State:
    """The smp state of this process (one instance: `state`)."""

    def __init__(self) -> None:
        self.initialized: bool = False
        self._cfg: Optional["SMPConfig"] = None
        self._topology: Optional["Topology"] = None
        self._launch: Optional["LaunchInfo"] = None
        self._process_groups: Dict[int, Any] = {}
        self._object_group: Any = None
        self._object_store: Any = None
        self._reset_callbacks: List[Callable[[], None]] = []
        self.model: Any = None
        self.optimizer: Any = None
        self.module_manager = ModuleManager()
        # Microbatch workers on pp_rank 0 run concurrently: each thread sees the microbatch it set;
        # a thread that never set one sees the last value set by any thread.
        self._mb_local = threading.local()
        self._mb_last = 0

    # Configuration and placement ---------------------------------------------------------------
    @property
    def cfg(self) -> "SMPConfig":
        require_init("smp.state.cfg")
        return self._cfg  # type: ignore[return-value]

    @property
    def topology(self) -> "Topology":
        require_init("smp.state.topology")
        return self._topology  # type: ignore[return-value]

    @property
    def launch(self) -> "LaunchInfo":
        require_init("smp.state.launch")
        return self._launch  # type: ignore[return-value]

    # Microbatch --------------------------------------------------------------------------------
    @property
    def microbatch(self) -> int:
        return getattr(self._mb_local, "value", self._mb_last)

    @microbatch.setter
    def microbatch(self, mb: int) -> None:
        self._mb_local.value = mb
        self._mb_last = mb

    # Process groups ----------------------------------------------------------------------------
    def process_group(self, kind: int) -> "dist.ProcessGroup":
        """The torch ProcessGroup of this rank's group of `kind` (a CommGroup)."""
        require_init("smp.state.process_group")
        try:
            return self._process_groups[int(kind)]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{kind!r} is not an smp.CommGroup") from None

    @property
    def object_group(self) -> "dist.ProcessGroup":
        """The dedicated gloo world group carrying smp.allgather and the smp barriers."""
        require_init("smp object communication")
        return self._object_group

    @property
    def object_store(self) -> "dist.Store":
        """The c10d store (own key prefix) carrying smp.send/broadcast messages."""
        require_init("smp object communication")
        return self._object_store

    # Lifecycle ---------------------------------------------------------------------------------
    def register_reset_callback(self, fn: Callable[[], None]) -> _CallbackHandle:
        """Call `fn()` on every `smp.reset()` (e.g. to drop engine state); returns a handle."""
        self._reset_callbacks.append(fn)
        return _CallbackHandle(self._reset_callbacks, fn)

    def _set_initialized(self, cfg: "SMPConfig", topology: "Topology", launch: "LaunchInfo",
                         process_groups: Dict[int, Any], object_group: Any,
                         object_store: Any) -> None:
        self._cfg, self._topology, self._launch = cfg, topology, launch
        self._process_groups = dict(process_groups)
        self._object_group, self._object_store = object_group, object_store
        self.initialized = True

    def reset(self) -> None:
        """Forget the model, optimizer and step state; keep config, placement and groups."""
        for fn in list(self._reset_callbacks):
            fn()
        self.model = None
        self.optimizer = None
        self.microbatch = 0
        self._mb_local = threading.local()
        self.module_manager.translate_functions.clear()


state = State()


def require_init(what: str) -> None:
    """Raise SMPNotInitializedError naming `what` unless smp.init() has run."""
    if not state.initialized:
        raise SMPNotInitializedError(
            f"{what} needs smp.init() first: call smp.init(config) at the start of the script "
            "(or set SM_HP_MP_PARAMETERS and launch with mpirun, torchrun or `smshim run`)"
        )
