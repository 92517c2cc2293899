"""Multi-node `smshim run` (issue 40 item 9), nodes simulated on one machine over loopback: every
node agrees on the run id, trains equal to one process, survives a killed worker with
--max-restarts, and a node whose peers never come says so within the rendezvous timeout."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from smshim.launcher.multinode import run_id
from smshim.testing import RankFailure, held_port
from tests.usage_helpers.models import assert_close, batches, reference

HERE = os.path.dirname(__file__)
GPU_STYLE = os.path.join(HERE, "scripts", "gpu_style_train.py")
DIST = json.dumps({"smdistributed": {"modelparallel": {"enabled": True, "parameters": {
    "partitions": 2, "microbatches": 2, "ddp": True}}},
    "mpi": {"enabled": True, "processes_per_host": 2}})
CLEAN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SM_HP_MP_PARAMETERS",
         "SMSHIM_RUN_ID", "SMP_MANUAL_INIT", "SMSHIM_CPU_WARNED", "GLOO_SOCKET_IFNAME")


def _start(tmp_path, node, port, *extra, env=None, script_args=("--mode", "smp")):
    e = {k: v for k, v in os.environ.items() if k not in CLEAN}
    e.update(OMP_NUM_THREADS="1", OUT_DIR=str(tmp_path), SMSHIM_CPU="1", SMSHIM_TIMEOUT="60")
    e.update(env or {})
    cmd = [sys.executable, "-m", "smshim", "run", "--nnodes", "2", "--node-rank", str(node),
           "--master-addr", "127.0.0.1", "--master-port", str(port), "--output-dir",
           str(tmp_path / f"node{node}"), "--distribution", DIST, *extra, GPU_STYLE,
           *script_args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=e, cwd=str(tmp_path), start_new_session=True)


def _wait(procs, timeout):
    """Every process's (returncode, output); all are killed at the deadline."""
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, text))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        texts = [p.communicate()[0] for p in procs]
        raise RankFailure(f"nodes did not finish within {timeout:.0f} s\n" + "\n----\n".join(
            t[-4000:] for t in texts)) from None
    return out


def _params(tmp_path):
    dumps = [torch.load(tmp_path / f"params_rank{r}.pt", weights_only=True) for r in range(4)]
    merged = {}
    for d in dumps:
        if d["dp_rank"] == 0:
            merged.update(d["params"])
    return merged, dumps


def _want():
    return reference(batches(3, 8), lambda p: torch.optim.SGD(p, lr=0.1))


def test_every_node_derives_the_same_run_id():
    a = run_id(None, "10.0.0.1", 29500, 2, env={})
    assert a == run_id(None, "10.0.0.1", 29500, 2, env={}) and "10.0.0.1" in a and "29500" in a
    assert run_id(None, "10.0.0.1", 29501, 2, env={}) != a
    assert run_id("job7", "10.0.0.1", 29500, 2, env={}) == "job7"
    assert run_id(None, "10.0.0.1", 29500, 2, env={"SMSHIM_RUN_ID": "j"}) == "j"


def test_two_nodes_train_pp2_dp2_equal_to_one_process(tmp_path):
    with held_port() as port:
        results = _wait([_start(tmp_path, 0, port), _start(tmp_path, 1, port)], timeout=150)
    for rc, text in results:
        assert rc == 0, text[-4000:]
    merged, _ = _params(tmp_path)
    assert_close(merged, _want())


def test_two_nodes_with_max_restarts_survive_a_killed_worker(tmp_path):
    kill = {"KILL_AT_STEP": "1", "KILL_RANK": "3"}  # node 1's second worker, first attempt
    with held_port() as port:
        procs = [_start(tmp_path, n, port, "--max-restarts", "1", env=kill) for n in (0, 1)]
        results = _wait(procs, timeout=200)
    for rc, text in results:
        assert rc == 0, text[-4000:]
    merged, dumps = _params(tmp_path)
    assert all(d["attempt"] != "0" for d in dumps if d["dp_rank"] == 1)  # node 1 restarted
    assert_close(merged, _want())


@contextlib.contextmanager
def _unanswered_port():
    """A loopback port that nothing answers on while the block runs: bound here and never
    listened on, so a connection is refused. (A port `free_port` returned is free only when it
    returns: another test's listener, which also takes a port the OS picks, may get it next, and
    then the node talks to that.)"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


RESTARTS = pytest.mark.parametrize("restarts", [[], ["--max-restarts", "1"]],
                                   ids=["static", "c10d"])


@RESTARTS
def test_a_node_whose_peers_never_come_says_so(tmp_path, restarts):
    t0 = time.monotonic()
    with held_port() as port:
        [(rc, text)] = _wait([_start(tmp_path, 0, port, "--rdzv-timeout", "5", *restarts)],
                             timeout=60)
    assert rc == 3 and time.monotonic() - t0 < 45, text
    assert f"only 1 of 2 nodes arrived at the rendezvous on 127.0.0.1:{port} within 5 s" in text
    assert "--node-rank I" in text and "--rdzv-timeout" in text
    assert "Traceback" not in text, text


@RESTARTS
def test_a_node_without_node_0_names_the_address(tmp_path, restarts):
    with _unanswered_port() as port:
        [(rc, text)] = _wait([_start(tmp_path, 1, port, "--rdzv-timeout", "5", *restarts)],
                             timeout=60)
    assert rc == 3, text
    assert f"no rendezvous answered at 127.0.0.1:{port} within 5 s (0 of 2 nodes seen)" in text
    assert "node 0 (--node-rank 0) hosts it there" in text
    assert "frame #" not in text and "Traceback" not in text, text  # no C++ or Python dumps


def test_nodes_with_different_run_ids_are_told(tmp_path):
    with held_port() as port:
        procs = [_start(tmp_path, 0, port, "--rdzv-timeout", "5", "--run-id", "a"),
                 _start(tmp_path, 1, port, "--rdzv-timeout", "5", "--run-id", "b")]
        results = _wait(procs, timeout=60)
    assert all(rc == 3 for rc, _ in results), results
    assert any("came with another run id: give every node the same --run-id" in t
               for _, t in results), results
