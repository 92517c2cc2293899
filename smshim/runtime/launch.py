"""Runtime bring-up shared by the data-parallel and model-parallel libraries.

Answers three questions for a process, from its environment only:
  * how was it launched (torchrun, Open MPI, MPICH/Hydra, SageMaker, or a plain process)?
  * what are its rank, world size, local rank and local size?
  * where is the rendezvous (MASTER_ADDR/MASTER_PORT)?
and brings up the default torch.distributed process group with the right backend (NCCL with one
device per local rank when CUDA is there, gloo otherwise) and a timeout on every collective.

Under mpirun without MASTER_ADDR/MASTER_PORT, rank 0 starts the TCPStore on a port the OS picks
and shares the port over MPI (mpi4py), so there is no race on a "free" port.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import io
import json
import logging
import os
import socket
import stat
from dataclasses import dataclass
from typing import Callable, List, Mapping, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, as read from its launcher's environment."""

    launcher: str  # "torchrun", "openmpi", "mpich", or "single"
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    master_addr: Optional[str]
    master_port: Optional[int]
    # The launcher said how many ranks share this host (else local rank and size are the
    # global ones, a guess that holds on one host only).
    local_known: bool = True

    @property
    def is_mpi(self) -> bool:
        return self.launcher in ("openmpi", "mpich")


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ValueError(f"environment variable {key}={env[key]!r} is not an integer") from None


def _sagemaker_master(env: Mapping[str, str]) -> Optional[str]:
    """SageMaker lists the hosts in SM_HOSTS; the first is the master."""
    hosts = env.get("SM_HOSTS")
    if not hosts:
        return None
    try:
        parsed = json.loads(hosts)
    except json.JSONDecodeError:
        raise ValueError(f"SM_HOSTS={hosts!r} is not a JSON list of host names") from None
    if not isinstance(parsed, list) or not parsed:
        raise ValueError(f"SM_HOSTS={hosts!r} must be a non-empty JSON list of host names")
    return str(sorted(parsed)[0])


def detect_launch(env: Optional[Mapping[str, str]] = None) -> LaunchInfo:
    """Read rank, sizes and rendezvous from the launcher's variables (first match wins)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torchrun"
        rank, size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
        local_size = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else size
        known = "LOCAL_RANK" in env and "LOCAL_WORLD_SIZE" in env
    elif "OMPI_COMM_WORLD_RANK" in env:
        launcher = "openmpi"
        rank, size = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
        known = True
    elif "PMI_RANK" in env and "PMI_SIZE" in env:
        launcher = "mpich"
        rank, size = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
        local_rank = _int(env, "MPI_LOCALRANKID") if "MPI_LOCALRANKID" in env else rank
        local_size = _int(env, "MPI_LOCALNRANKS") if "MPI_LOCALNRANKS" in env else size
        known = "MPI_LOCALRANKID" in env and "MPI_LOCALNRANKS" in env
    else:
        launcher, rank, size, local_rank, local_size, known = "single", 0, 1, 0, 1, True
    if not (0 <= rank < size):
        raise ValueError(f"{launcher} environment gives rank {rank} outside world size {size}")
    addr = env.get("MASTER_ADDR") or _sagemaker_master(env)
    port = _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else None
    return LaunchInfo(launcher, rank, size, local_rank, local_size, addr, port, known)


def timeout_seconds(env: Optional[Mapping[str, str]] = None) -> float:
    """SMSHIM_TIMEOUT (seconds, default 1800): the bound on every collective and every wait."""
    env = os.environ if env is None else env
    raw = env.get("SMSHIM_TIMEOUT")
    if raw is None or raw == "":
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"SMSHIM_TIMEOUT={raw!r} must be a number of seconds") from None
    if value <= 0:
        raise ValueError(f"SMSHIM_TIMEOUT={raw!r} must be positive")
    return value


def timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=timeout_seconds())


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "gloo"


def device() -> torch.device:
    """The device this process computes on: its local GPU under NCCL, else the CPU."""
    backend = dist.get_backend() if dist.is_initialized() else default_backend()
    # smddp delegates CUDA tensors to NCCL: with a GPU it computes there too.
    if backend == "nccl" or (backend == "smddp" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


LOOPBACK = "127.0.0.1"


def loopback_store(port: int = 0,
                   tmo: datetime.timedelta = datetime.timedelta(seconds=60)) -> dist.TCPStore:
    """A TCPStore server listening on 127.0.0.1 only (port 0: the OS picks one, no race).

    TCPStore itself binds every interface; a single-node job needs no outside access, and smp's
    messages in the store are pickled. So the socket is bound here and handed over."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, port))
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    # The store owns the descriptor from here on.
    return dist.TCPStore(LOOPBACK, port, is_master=True, multi_tenant=True, timeout=tmo,
                         wait_for_workers=False, master_listen_fd=sock.detach())


def single_host(info: LaunchInfo) -> bool:
    """Every rank of the job runs on this host."""
    return info.local_size == info.world_size


def _gloo_on_loopback(info: LaunchInfo) -> None:
    """All ranks on this host: gloo listens on the loopback interface only (unless the user chose
    one with GLOO_SOCKET_IFNAME)."""
    if info.world_size > 1 and single_host(info) and "GLOO_SOCKET_IFNAME" not in os.environ:
        ifname = loopback_interface()
        if ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname


def _mpi_share_port(info: LaunchInfo, tmo: datetime.timedelta) -> dist.Store:
    """Rank 0 opens the store on an OS-chosen port; MPI carries (addr, port) to the others."""
    from mpi4py import MPI  # only under mpirun: importing mpi4py initialises MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() != info.world_size or comm.Get_rank() != info.rank:
        raise RuntimeError(
            f"MPI says rank {comm.Get_rank()} of {comm.Get_size()}, the environment says "
            f"{info.rank} of {info.world_size}: mpi4py is linked to a different MPI than mpirun"
        )
    store = None
    if info.rank == 0:
        # All ranks on this host: listen on loopback only. Several hosts: every interface, and
        # this host's name, resolvable by the others.
        if single_host(info):
            host, store = LOOPBACK, loopback_store(0, tmo)
        else:
            host = socket.getfqdn()
            store = dist.TCPStore("0.0.0.0", 0, info.world_size, is_master=True, timeout=tmo,
                                  wait_for_workers=False)
        endpoint = (host, store.port)
    else:
        endpoint = None
    host, port = comm.bcast(endpoint, root=0)
    os.environ.setdefault("MASTER_ADDR", host)
    os.environ.setdefault("MASTER_PORT", str(port))
    if store is None:
        store = dist.TCPStore(host, port, info.world_size, is_master=False, timeout=tmo)
    return store


def _agent_store() -> bool:
    """The workers were started by torch's elastic agent, which hosts their store."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True) and \
        "TORCHELASTIC_RUN_ID" in os.environ


def attempt_id(env: Optional[Mapping[str, str]] = None) -> str:
    """Which attempt of an elastic job this is, the same on every node: the multi-node
    rendezvous's round (SMSHIM_RDZV_ROUND, set by smshim/launcher/multinode.py; the nodes' restart
    counts can differ, as a node restarted for a peer's failure does not count it), else torch's
    TORCHELASTIC_RESTART_COUNT."""
    env = os.environ if env is None else env
    return env.get("SMSHIM_RDZV_ROUND") or env.get("TORCHELASTIC_RESTART_COUNT", "0")


def init_distributed(backend: Optional[str] = None) -> LaunchInfo:
    """Bring up the default process group once; later calls return the same LaunchInfo."""
    info = detect_launch()
    if dist.is_initialized():
        return info
    backend = backend or default_backend()
    tmo = timeout()
    _gloo_on_loopback(info)
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
    if info.master_addr is not None and info.master_port is not None and _agent_store():
        # The elastic agent's store outlives a restart of the workers (torch's c10d rendezvous
        # keeps it): keys of this attempt go under their own prefix, so a restarted group never
        # reads a dead attempt's gloo addresses.
        attempt = attempt_id()
        agent = dist.TCPStore(info.master_addr, info.master_port, info.world_size,
                              is_master=False, timeout=tmo)
        dist.init_process_group(backend, store=dist.PrefixStore(f"smshim/attempt_{attempt}/", agent),
                                rank=info.rank, world_size=info.world_size, timeout=tmo)
    elif info.master_addr is not None and info.master_port is not None:
        # torch's env:// rendezvous.
        os.environ.setdefault("MASTER_ADDR", info.master_addr)
        os.environ.setdefault("MASTER_PORT", str(info.master_port))
        dist.init_process_group(backend, init_method="env://", rank=info.rank,
                                world_size=info.world_size, timeout=tmo)
    else:
        if info.world_size == 1:
            store = dist.HashStore()  # a lone process needs no network
        elif info.is_mpi:
            store = _mpi_share_port(info, tmo)
        else:
            raise RuntimeError(
                f"rank {info.rank} of {info.world_size} ({info.launcher}): set MASTER_ADDR and "
                "MASTER_PORT, or launch with torchrun, mpirun or `smshim run`"
            )
        dist.init_process_group(backend, store=store, rank=info.rank,
                                world_size=info.world_size, timeout=tmo)
    logger.info("rank %d/%d up (%s, %s backend)", info.rank, info.world_size, info.launcher, backend)
    return info


# Teardown at exit ---------------------------------------------------------------------------------
# Every process group torch.distributed knows (the default group whoever created it, smddp's, smp's,
# the pipeline transport's) is destroyed by an atexit handler registered when this module is first
# imported, i.e. before the script's own handlers, so it runs after them; in workers of
# `smshim run` and in CPU mode the start-up hook (smshim/_alias.py) registers it for plain torch
# scripts too. Left to static
# destruction at exit, gloo's threads can be destroyed while joinable and abort the process
# ("terminate called without an active exception") after the script has finished.
_teardown_hooks: List[Callable[[], None]] = []


def before_teardown(hook: Callable[[], None]) -> None:
    """Run `hook` at interpreter exit before the process groups are destroyed (last added, first
    run); e.g. smp stops the pipeline transport's receivers so none is inside a gloo call."""
    _teardown_hooks.append(hook)


def teardown() -> None:
    """Run the before-teardown hooks, then destroy every process group (newest first, as torch's
    destroy_process_group does). Safe to call more than once; never raises."""
    while _teardown_hooks:
        hook = _teardown_hooks.pop()
        try:
            hook()
        except Exception:  # noqa: BLE001  (exiting anyway; the groups must still go)
            logger.debug("teardown hook %r failed", hook, exc_info=True)
    # Garbage that holds a group (a DDP model in a reference cycle, left by a returned main())
    # goes now: freed later, during finalization, its gloo group aborted the process ("terminate
    # called without an active exception") in 4 of 30 runs of examples/train_dp.py under
    # `smshim run`; 0 of 30 once the model was freed before exit.
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001  (exiting anyway; a peer may be gone)
            logger.debug("destroy_process_group at exit failed", exc_info=True)


_WRITABLE_FILES = (io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)


def _flush_if_on_a_regular_file(f: io.IOBase) -> None:
    """Flush `f` if it writes to a regular file. Not a pipe or a socket: a daemon thread may be
    blocked writing to one, holding its lock, and the exit would wait for it (finalization would
    not have touched a file that a live thread's frame still holds)."""
    try:
        raw = f
        while not isinstance(raw, io.FileIO):  # TextIOWrapper.buffer -> Buffered*.raw -> FileIO
            raw = getattr(raw, "buffer", None) or getattr(raw, "raw", None)
            if raw is None:
                return
        if raw.closed or not f.writable() or not stat.S_ISREG(os.fstat(raw.fileno()).st_mode):
            return
        f.flush()
    except (OSError, ValueError):  # detached, closed meanwhile, or the disk is full: exiting
        pass


def _settle_for_exit() -> None:
    """Spare the interpreter's finalization its garbage passes: each walks every object left
    (with torch, torch._dynamo and Hugging Face's GPT-2 imported, over 350,000), and together
    they cost a rank 1-1.5 s of CPU after the script has finished. The teardown has just
    collected the garbage there is; what is still alive is frozen (`gc.freeze`), so later passes
    skip it.

    Freezing changes one thing: an object that finalization would have freed as part of a
    reference cycle is left to the OS instead. Python does not promise to finalize such objects
    at exit; a file among them would lose its buffered writes, so open files are flushed first."""
    for obj in gc.get_objects():
        # type(), not isinstance(): the latter asks lazy proxies for their __class__.
        if issubclass(type(obj), _WRITABLE_FILES):
            _flush_if_on_a_regular_file(obj)
    gc.freeze()


def teardown_at_exit() -> None:
    """The atexit handler: `teardown`, then `_settle_for_exit`."""
    teardown()
    _settle_for_exit()


atexit.register(teardown_at_exit)


def loopback_interface() -> Optional[str]:
    """The name of the loopback network interface ("lo" on Linux, "lo0" on macOS), if any: what
    GLOO_SOCKET_IFNAME must name for gloo to listen on loopback only."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (AttributeError, OSError):
        return None
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return None


def free_port() -> int:
    """A TCP port the OS reports free right now (for launchers that must choose one up front)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_MPI_STORE: Optional[dist.Store] = None  # rank 0's rendezvous store under mpirun, kept alive


def export_mpi_env() -> bool:
    """Under mpirun, give torch's env:// rendezvous what torchrun would have set; True if it did.

    Sets RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE from the MPI variables. Without
    MASTER_ADDR/MASTER_PORT, rank 0 opens the TCPStore now on an OS-chosen port (shared over MPI,
    see _mpi_share_port) and keeps it open; every rank, rank 0 included, then joins it as a client
    the way torchrun's agent-hosted store is joined (TORCHELASTIC_USE_AGENT_STORE), so no port is
    picked, released and re-bound later (no race). A later `init_process_group(...)` with env://
    (torch's default) then needs nothing from the user.
    """
    global _MPI_STORE
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return False
    info = detect_launch()
    if not info.is_mpi:
        return False
    _gloo_on_loopback(info)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(info.rank), str(info.world_size)
    os.environ.setdefault("LOCAL_RANK", str(info.local_rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(info.local_size))
    if info.master_addr is not None and info.master_port is not None:
        os.environ.setdefault("MASTER_ADDR", info.master_addr)
        os.environ.setdefault("MASTER_PORT", str(info.master_port))
    else:
        store = _mpi_share_port(info, timeout())
        if info.rank == 0:
            _MPI_STORE = store
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = str(True)
    logger.info("rank %d/%d: torch.distributed environment exported from %s", info.rank,
                info.world_size, info.launcher)
    return True
