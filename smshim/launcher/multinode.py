"""The rendezvous of a multi-node `smshim run`: one run id for every node, and a roll call that
says who is missing instead of waiting silently.

Run id. torch's rendezvous prefixes every key with the run id, so nodes that draw their own never
meet. `run_id()` takes `--run-id` / SMSHIM_RUN_ID (torchrun's `--rdzv-id`), else derives it from
what every node is given alike: the master address and port.

Roll call. Before torch's own rendezvous, each node adds itself to a counter in the rendezvous
store and waits, up to the rendezvous timeout, for all `nnodes`; if they do not all come, the
error names the address, how many nodes came and what to start. A node that cannot reach the
store at all says that node 0 hosts it at that address. Registered as the rendezvous backends
`smshim-static` (torch's static TCP rendezvous; no restarts) and `smshim-c10d` (torch's c10d
rendezvous, for --max-restarts).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Mapping, Optional

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

STATIC, C10D = "smshim-static", "smshim-c10d"
RUN_ID_ENV = "SMSHIM_RUN_ID"
_POLL_S = 0.2


def run_id(given: Optional[str], master_addr: str, master_port: int, nnodes: int,
           env: Mapping[str, str] = os.environ) -> Optional[str]:
    """The job's run id: the one given, else (several nodes) one derived from the master's address,
    so every node computes the same; None on one node (any id will do)."""
    explicit = given or env.get(RUN_ID_ENV)
    if explicit:
        return explicit
    if nnodes > 1:
        return f"smshim-{master_addr}-{master_port}"
    return None


def _hint(addr: str, port: int, nnodes: int) -> str:
    return (f"start every node with `smshim run --nnodes {nnodes} --node-rank I --master-addr "
            f"{addr} --master-port {port} ...` (I = 0..{nnodes - 1}, the same --run-id on each if "
            "you give one), or raise --rdzv-timeout")


def roll_call(store: Any, rid: str, nnodes: int, node: str, addr: str, port: int,
              timeout_s: float) -> None:
    """Count this node in and wait for all `nnodes`; RendezvousTimeoutError naming who came."""
    mine = f"smshim/roll_call/{rid}"
    came = 0
    try:
        store.add(mine, 1)
        store.add("smshim/roll_call/any", 1)  # every node of any run id: reveals a mismatch
        deadline = time.monotonic() + timeout_s
        while True:
            came = store.add(mine, 0)
            if came >= nnodes:
                return
            if time.monotonic() > deadline:
                break
            time.sleep(_POLL_S)
        others = store.add("smshim/roll_call/any", 0) - came
    except RuntimeError as e:  # the store went away: node 0 gave up or failed
        raise RendezvousConnectionError(
            f"{node}: the rendezvous on {addr}:{port} closed while waiting ({came} of {nnodes} "
            f"nodes had arrived): node 0 gave up or failed, see its output; "
            f"{_hint(addr, port, nnodes)} ({str(e).strip().splitlines()[0] if str(e).strip() else e!r})"
        ) from None
    mismatch = (f"; {others} node(s) came with another run id: give every node the same --run-id"
                if others > 0 else "")
    raise RendezvousTimeoutError(
        f"{node}: only {came} of {nnodes} nodes arrived at the rendezvous on {addr}:{port} within "
        f"{timeout_s:.0f} s{mismatch}; {_hint(addr, port, nnodes)}")


def _unreachable(node: str, addr: str, port: int, nnodes: int, timeout_s: float,
                 err: Exception) -> RendezvousConnectionError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return RendezvousConnectionError(
        f"{node}: no rendezvous answered at {addr}:{port} within {timeout_s:.0f} s (0 of {nnodes} "
        f"nodes seen): node 0 (--node-rank 0) hosts it there; {_hint(addr, port, nnodes)}; check "
        f"the address and that the port is reachable ({first})")


def wait_reachable(node: str, addr: str, port: int, nnodes: int, timeout_s: float) -> None:
    """Wait until node 0's rendezvous port accepts connections, else say whom to start. (Checked
    here, before torch's TCPStore client, whose C++ retries log a stack dump per attempt.)"""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, port), timeout=min(5.0, timeout_s)):
                return
        except OSError as e:
            if time.monotonic() + 0.5 > deadline:
                raise _unreachable(node, addr, port, nnodes, timeout_s, e) from None
            time.sleep(0.5)


class _StaticHandler(StaticTCPRendezvous):
    """torch's static rendezvous, its store opened without blocking, then the roll call."""

    def get_backend(self) -> str:
        return STATIC  # the agent checks the handler answers to the name it asked for

    def next_rendezvous(self):  # type: ignore[no-untyped-def]
        if self._store is None:
            node = f"node {self.rank} of {self.world_size}"
            tmo = self.timeout.total_seconds()
            if self.rank != 0:
                wait_reachable(node, self.master_addr, self.master_port, self.world_size, tmo)
            try:
                self._store = TCPStore(self.master_addr, self.master_port, self.world_size,
                                       self.rank == 0, self.timeout, multi_tenant=True,
                                       wait_for_workers=False)
            except (RuntimeError, OSError) as e:
                raise _unreachable(node, self.master_addr, self.master_port, self.world_size,
                                   tmo, e) from None
            roll_call(self._store, self.run_id, self.world_size, node, self.master_addr,
                      self.master_port, tmo)
        return super().next_rendezvous()


def _endpoint(params: RendezvousParameters) -> tuple:
    addr, _, port = params.endpoint.rpartition(":")
    return addr, int(port)


def _create_static(params: RendezvousParameters) -> RendezvousHandler:
    addr, port = _endpoint(params)
    return _StaticHandler(addr, port, int(params.config["rank"]), params.max_nodes, params.run_id,
                          int(params.config.get("timeout", 900)))


class _RollCallFirst(RendezvousHandler):
    """torch's c10d handler; its first round is preceded by the roll call (restarts re-form the
    group through torch's own rounds)."""

    def __init__(self, inner: RendezvousHandler, store: Any, params: RendezvousParameters,
                 timeout_s: float) -> None:
        self._inner, self._store, self._params, self._timeout_s = inner, store, params, timeout_s
        self._called = False
        self._rounds = 0

    def next_rendezvous(self):  # type: ignore[no-untyped-def]
        if not self._called:
            self._called = True
            addr, port = _endpoint(self._params)
            host = "the host" if self._params.config.get("is_host") else "a node"
            roll_call(self._store, self._params.run_id, self._params.max_nodes,
                      f"{host} of {self._params.max_nodes}", addr, port, self._timeout_s)
        info = self._inner.next_rendezvous()
        self._rounds += 1
        # The workers' store keys are prefixed per attempt (smshim.runtime.launch.attempt_id); the
        # nodes agree on the round, not on their restart counts. The agent passes its own
        # environment on to the workers it starts next.
        state = getattr(getattr(self._inner, "_state_holder", None), "state", None)
        os.environ["SMSHIM_RDZV_ROUND"] = str(getattr(state, "round", self._rounds))
        return info

    def get_backend(self) -> str:
        return C10D

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


def _create_c10d(params: RendezvousParameters) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    timeout_s = float(params.get_as_int("join_timeout", 900) or 900)
    addr, port = _endpoint(params)
    if not params.config.get("is_host"):
        wait_reachable(f"a node of {params.max_nodes}", addr, port, params.max_nodes, timeout_s)
    try:
        backend, store = create_backend(params)
    except (RendezvousConnectionError, RuntimeError, OSError) as e:
        e = e.__cause__ or e  # torch's wrapper says "see inner exception"
        raise _unreachable(f"a node of {params.max_nodes}", addr, port, params.max_nodes,
                           timeout_s, e) from None
    return _RollCallFirst(create_handler(store, backend, params), store, params, timeout_s)


def register() -> None:
    """Register `smshim-static` and `smshim-c10d` (once per process)."""
    for name, creator in ((STATIC, _create_static), (C10D, _create_c10d)):
        try:
            rendezvous_handler_registry.register(name, creator)
        except ValueError:  # registered already
            pass

