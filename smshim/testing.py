"""Run a function or a script in N gloo processes, with a hard deadline, and collect each rank's result.

`run_ranks(fn, n, *args)` starts n processes with torchrun-style environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), one thread each, and calls `fn(*args)` in
each. It returns the list of return values, indexed by rank. If any rank raises, dies or the
deadline passes, every process is killed and `RankFailure` is raised carrying the failing rank's
traceback; nothing can hang the caller.

`run_command(cmd, timeout)` runs a launcher command line (torchrun, mpirun, smshim run) in its own
process group and kills the whole group on timeout; a bare tool name is also looked for next to
this interpreter (`find_executable`), so an unactivated venv's mpirun is found.

Processes come from a forkserver that has already imported torch (and torch._dynamo, which the
first optimizer step would import), so each costs a fork instead of a fresh interpreter plus
torch import (and no parent OpenMP state is inherited through fork). `preload(*modules)`, called
before the first `run_ranks`, has it import more (the tests' conftest.py: Hugging Face's models).
Each rank hands what it inherited to the garbage collector's permanent generation (`gc.freeze`),
so that a full collection does not walk, and copy, the forkserver's heap.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from smshim.runtime.launch import free_port, teardown

DEFAULT_TIMEOUT_S = 120.0

_ctx = None
# What the forkserver imports before it forks the first rank (see `preload`). torch._dynamo is
# imported by the first optimizer step and costs seconds per process. Not smshim's modules: some
# tests check what their import does in a fresh rank.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.optim"]


class RankFailure(AssertionError):
    """A rank raised, died or did not finish in time; the message holds its traceback."""


def preload(*modules: str) -> None:
    """Start every rank of `run_ranks` with `modules` imported: the forkserver imports them once,
    instead of each rank on its own (a Hugging Face model's module costs a rank seconds of CPU).
    Call it before the first `run_ranks`. A module that is not installed is left out."""
    if _ctx is not None:
        names = ", ".join(map(repr, modules))
        raise RuntimeError(f"smshim.testing.preload({names}): call it before the first run_ranks "
                           "(the process that forks the ranks has started with what it had)")
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def _context():
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(list(_PRELOAD))  # (one that fails to import is skipped)
    return _ctx


def _child(fn: Callable, args: tuple, rank: int, env: Dict[str, str], results) -> None:
    # What the forkserver imported (torch, Hugging Face's models: some 300,000 objects) is never
    # garbage here. Frozen, a full collection (smp's exit teardown runs one) skips it instead of
    # walking it and copying every page it touches (~0.2 s of CPU per rank).
    gc.freeze()
    os.environ.update(env)
    try:
        import torch

        torch.set_num_threads(1)
        value = fn(*args)
        # Plain pickle bytes: the queue's own pickler would pass tensors through shared memory,
        # which needs this process alive when the parent unpickles.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001  (everything must reach the parent)
        results.put((rank, "error", traceback.format_exc()))
        # Flush the queue's feeder thread, then leave without atexit handlers that could block
        # on peers that are gone.
        results.close()
        results.join_thread()
        os._exit(1)
    finally:
        # As at a script's exit (this process leaves by os._exit, without atexit handlers): smp
        # first waits for its peers to have received its last step's messages, then the process
        # groups go. Destroyed at once, a group drops a frame still on its way to a peer.
        try:
            teardown()
        except Exception:  # noqa: BLE001
            pass


def run_ranks(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    env: Optional[Mapping[str, str]] = None,
    rank_env: Optional[Callable[[int], Mapping[str, str]]] = None,
) -> List[Any]:
    """Run `fn(*args)` on `nprocs` ranks; return each rank's value (picklable) in rank order."""
    ctx = _context()
    held, port = _hold_port()
    results = ctx.Queue()
    procs = []
    for rank in range(nprocs):
        e = {
            "RANK": str(rank), "WORLD_SIZE": str(nprocs), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1", "SMSHIM_TIMEOUT": str(max(10, int(timeout // 2))),
        }
        e.update(env or {})
        e.update(rank_env(rank) if rank_env else {})
        p = ctx.Process(target=_child, args=(fn, args, rank, e, results), daemon=True)
        p.start()
        procs.append(p)

    values: Dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    ok = False
    try:
        while len(values) < nprocs:
            try:
                rank, status, value = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode not in (None, 0)]
                if dead:
                    # A rank that died without reporting (segfault, os._exit, killed).
                    time.sleep(0.5)  # let a traceback that is in flight arrive first
                    try:
                        rank, status, value = results.get_nowait()
                    except queue.Empty:
                        r = dead[0]
                        raise RankFailure(f"rank {r} died with exit code {procs[r].exitcode} "
                                          "without reporting a result") from None
                elif time.monotonic() > deadline:
                    missing = [r for r in range(nprocs) if r not in values]
                    raise RankFailure(f"ranks {missing} did not finish within {timeout:.0f} s "
                                      f"(world size {nprocs})")
                else:
                    continue
            if status == "error":
                raise RankFailure(f"rank {rank} of {nprocs} failed:\n{value}")
            values[rank] = pickle.loads(value)
        ok = True
    finally:
        # After a failure the survivors may be blocked on the failed peer: kill them now.
        for p in procs:
            if ok:
                p.join(timeout=10)
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        results.close()
        if held is not None:
            held.close()
    return [values[r] for r in range(nprocs)]


@contextlib.contextmanager
def held_port() -> Iterator[int]:
    """A loopback port for the rendezvous of ranks that a test launches itself (its MASTER_PORT,
    where rank 0 opens torch's TCPStore, which binds with SO_REUSEADDR: under mpirun, or as
    plain processes; or a launcher's, where node 0's `smshim run` or torchrun's agent opens
    one), kept from other sockets while the block runs, as `run_ranks` keeps its own (see
    `_hold_port`)."""
    held, port = _hold_port()
    try:
        yield port
    finally:
        if held is not None:
            held.close()


def _hold_port() -> Tuple[Optional[socket.socket], int]:
    """A loopback port for the ranks' MASTER_PORT, and (on Linux) a socket that keeps it bound,
    never listening, until they are done. A port `free_port` returns is free only when it
    returns: another test's listener, given a port by the OS meanwhile, could take it before
    rank 0's store binds it, and rank 0 would then fail with "address already in use". Bound
    here with SO_REUSEADDR, it is given to no one else, and rank 0's store (which binds with
    SO_REUSEADDR too) can still bind and listen on it: Linux lets a listener share a port with
    sockets that do not listen. (Elsewhere SO_REUSEADDR means other things: the old way.)"""
    if not sys.platform.startswith("linux"):
        return None, free_port()
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(("127.0.0.1", 0))
    return held, held.getsockname()[1]


def find_executable(name: str) -> Optional[str]:
    """`name` (e.g. "mpirun") from this interpreter's environment first, then PATH: a virtual
    environment's commands sit next to its python, and PATH lacks them when it is not activated
    (`venv/bin/python -m pytest`)."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.isfile(here) and os.access(here, os.X_OK):
        return here
    return shutil.which(name)


def run_command(
    cmd: Sequence[str],
    timeout: float = DEFAULT_TIMEOUT_S,
    env: Optional[Mapping[str, Optional[str]]] = None,
    cwd: Optional[str] = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run a launcher command; kill its whole process group after `timeout` seconds.

    `env` is laid over this process's environment; a value of None removes the variable.
    With `check`, a non-zero exit raises `RankFailure` showing the command's output.
    """
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    # The environment's own commands first (mpirun's helpers find each other on PATH).
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in full_env.get("PATH", "").split(os.pathsep):
        full_env["PATH"] = bin_dir + os.pathsep + full_env.get("PATH", "")
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    cmd = list(cmd)
    if cmd and os.sep not in cmd[0]:
        cmd[0] = find_executable(cmd[0]) or cmd[0]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env, cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise RankFailure(f"{' '.join(cmd)} did not finish within {timeout:.0f} s\n"
                          f"--- stdout ---\n{out[-5000:]}\n--- stderr ---\n{err[-5000:]}") from None
    result = subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)
    if check and proc.returncode != 0:
        raise RankFailure(f"{' '.join(cmd)} exited with {proc.returncode}\n"
                          f"--- stdout ---\n{out[-5000:]}\n--- stderr ---\n{err[-8000:]}")
    return result
