"""The single-node rendezvous of `smshim run`: torch's c10d rendezvous, listening on loopback only.

torch's c10d rendezvous (what `torchrun --standalone` uses, and what torchrun recommends with
`--max-restarts`) hosts two TCPStores in the launcher: the rendezvous state and the store the
workers share (their default group's and smp's messages). torch binds both to every interface; on
one node nothing outside needs to reach them, and smp's messages are pickled, so here both listen
on 127.0.0.1 only: the sockets are bound here and handed to TCPStore (`master_listen_fd`). And
torch keeps the workers' shared store across restarts, so a restarted group could read the dead
attempt's keys (gloo's connectFullMesh then dials addresses nobody listens on): here it is new for
every round. Everything else is torch's DynamicRendezvousHandler and C10dRendezvousBackend,
registered as rendezvous backend `smshim-local`.
"""

from __future__ import annotations

import datetime
import logging

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from smshim.runtime.launch import LOOPBACK, loopback_store

logger = logging.getLogger(__name__)

BACKEND = "smshim-local"


class _LoopbackHandler(DynamicRendezvousHandler):
    """torch's handler, with the workers' shared store bound to loopback and new every round."""

    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> dist.TCPStore:
        return loopback_store(master_port)

    def next_rendezvous(self):  # type: ignore[no-untyped-def]
        # A fresh shared store for every round, as torch's env:// code assumes ("we create a new
        # TCPStore for every retry"): torch keeps the first round's, so a restarted group would
        # read the previous attempt's keys and gloo would dial the dead workers' addresses.
        self._bootstrap_store_info = None
        self._shared_tcp_store_server = None
        return super().next_rendezvous()

    def get_backend(self) -> str:
        return BACKEND  # the agent checks the handler answers to the name it asked for


def _timeout(params: RendezvousParameters, name: str):
    value = params.get_as_int(f"{name}_timeout")
    if value is None and name == "join":
        value = params.get_as_int("timeout")  # LaunchConfig.rdzv_timeout arrives as "timeout"
    return None if value is None else datetime.timedelta(seconds=value)


def _create_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    port = int(params.endpoint.rpartition(":")[2] or 0) if params.endpoint else 0
    store = loopback_store(port, datetime.timedelta(seconds=params.get_as_int("read_timeout", 60)))
    backend = C10dRendezvousBackend(store, params.run_id)
    timeout = RendezvousTimeout(_timeout(params, "join"), _timeout(params, "last_call"),
                                _timeout(params, "close"), _timeout(params, "heartbeat"))
    logger.debug("rendezvous store on %s:%d (loopback only)", LOOPBACK, store.port)
    return _LoopbackHandler.from_backend(params.run_id, store, backend, params.min_nodes,
                                         params.max_nodes, LOOPBACK, timeout)


def register() -> str:
    """Register the `smshim-local` rendezvous backend (once); returns its name."""
    try:
        rendezvous_handler_registry.register(BACKEND, _create_handler)
    except ValueError:  # registered already (a second launch in this process)
        pass
    return BACKEND
