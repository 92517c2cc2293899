"""Runtime bring-up: launcher detection, timeouts, and real process groups under each launcher."""

import os
import re
import shutil
import sys
import threading

import pytest

from smshim.runtime import launch as _runtime
from smshim.runtime import scheduling
from smshim.testing import run_command, run_ranks

HERE = os.path.dirname(__file__)
# The venv's mpirun, also when the venv is not activated (its bin/ not on PATH).
MPIRUN = (os.path.join(os.path.dirname(sys.executable), "mpirun")
          if os.path.exists(os.path.join(os.path.dirname(sys.executable), "mpirun"))
          else shutil.which("mpirun"))
ALLREDUCE = os.path.join(HERE, "scripts", "dp_allreduce.py")


@pytest.mark.parametrize("env, expected", [
    ({}, ("single", 0, 1, 0, 1, None, None)),
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
      "MASTER_ADDR": "h0", "MASTER_PORT": "1234"}, ("torchrun", 3, 4, 1, 2, "h0", 1234)),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, ("openmpi", 1, 2, 1, 2, None, None)),
    ({"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"},
     ("mpich", 5, 8, 1, 4, None, None)),
    # SageMaker: MPI ranks, master = first of the sorted SM_HOSTS.
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "SM_HOSTS": '["algo-2", "algo-1"]',
      "SM_CURRENT_HOST": "algo-2", "MASTER_PORT": "7777"}, ("openmpi", 0, 4, 0, 2, "algo-1", 7777)),
])
def test_detect_launch(env, expected):
    info = _runtime.detect_launch(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_size,
            info.master_addr, info.master_port) == expected


def test_detect_launch_says_whether_the_launcher_gave_the_host_s_ranks():
    assert _runtime.detect_launch({}).local_known
    assert _runtime.detect_launch({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                                   "LOCAL_WORLD_SIZE": "2"}).local_known
    guessed = _runtime.detect_launch({"RANK": "3", "WORLD_SIZE": "4"})
    assert (guessed.local_rank, guessed.local_size, guessed.local_known) == (3, 4, False)
    assert not _runtime.detect_launch({"PMI_RANK": "1", "PMI_SIZE": "2"}).local_known


@pytest.mark.parametrize("env, words", [
    ({"RANK": "2", "WORLD_SIZE": "2"}, ["rank 2", "world size 2"]),
    ({"PMI_RANK": "x", "PMI_SIZE": "2"}, ["PMI_RANK"]),
    ({"SM_HOSTS": "algo-1"}, ["SM_HOSTS"]),
])
def test_detect_launch_errors(env, words):
    with pytest.raises(ValueError) as e:
        _runtime.detect_launch(env)
    for w in words:
        assert w in str(e.value)


def test_timeout_setting():
    assert _runtime.timeout_seconds({}) == 1800
    assert _runtime.timeout_seconds({"SMSHIM_TIMEOUT": "7.5"}) == 7.5
    for bad in ("abc", "0", "-3"):
        with pytest.raises(ValueError, match="SMSHIM_TIMEOUT"):
            _runtime.timeout_seconds({"SMSHIM_TIMEOUT": bad})


def _allreduce_rank():
    import torch
    import torch.distributed as dist

    info = _runtime.init_distributed()
    t = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(t)
    return info.rank, info.world_size, dist.get_backend(), t.item()


@pytest.mark.parametrize("n", [2, 4])
def test_torchrun_style_env(n):
    out = run_ranks(_allreduce_rank, n, timeout=90)
    assert [o[0] for o in out] == list(range(n))
    assert all(o[1] == n and o[2] == "gloo" and o[3] == n * (n + 1) / 2 for o in out)


NO_LAUNCHER = {k: None for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                                  "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "SM_HOSTS")}


def test_single_process_needs_no_launcher():
    r = run_command([sys.executable, ALLREDUCE], timeout=90, env=NO_LAUNCHER)
    assert "rank 0 of 1 sum 1.0" in r.stdout, r.stderr


def test_torchrun_launch(tmp_path):
    # (--log-dir: else torchrun leaves an empty log directory in the system's temp dir per run)
    r = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--log-dir", str(tmp_path), "--nproc-per-node", "2", ALLREDUCE], timeout=120)
    assert "rank 0 of 2 sum 3.0" in r.stdout and "rank 1 of 2 sum 3.0" in r.stdout, r.stderr


@pytest.mark.skipif(MPIRUN is None, reason="no mpirun (pip install '.[mpi]')")
def test_mpirun_without_master_addr():
    r = run_command([MPIRUN, "-n", "2", sys.executable, ALLREDUCE], timeout=120, env=NO_LAUNCHER)
    assert "rank 0 of 2 sum 3.0" in r.stdout and "rank 1 of 2 sum 3.0" in r.stdout, r.stderr


def _smddp_groups_then_teardown():
    import torch
    import torch.distributed as dist

    import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401  (registers "smddp")

    # The script, not smshim, creates the groups: the teardown registered at import still owns them.
    dist.init_process_group(backend="smddp")
    sub = dist.new_group([0, 1])
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2), process_group=sub)
    model(torch.ones(1, 3)).sum().backward()
    order = []
    _runtime.before_teardown(lambda: order.append(dist.is_initialized()))
    _runtime.teardown()
    return order, dist.is_initialized()


def test_teardown_destroys_groups_the_script_created():
    for order, initialized in run_ranks(_smddp_groups_then_teardown, 2, timeout=60):
        assert order == [True]  # hooks run while the groups still exist
        assert not initialized


_EXITING_SCRIPT = """
import atexit, gc, sys
out = sys.argv[1]
# Registered before smshim's teardown, so it runs after it.
atexit.register(lambda: open(out + ".frozen", "w").write(str(gc.get_freeze_count())))
import smdistributed.dataparallel.torch.distributed as sdp
sdp.init_process_group()
class Holder:
    pass
h = Holder()
h.me = h  # a cycle: only the collector would free it, and close its file
h.log = open(out, "w")
h.log.write("written, never flushed\\n")
"""


def test_exit_freezes_what_is_left_after_flushing_open_files(tmp_path):
    # After the teardown, what is still alive is frozen, so that the interpreter's finalization
    # does not walk it (1-1.5 s of CPU per rank). A file in a reference cycle, which finalization
    # would have closed, still gets its writes.
    out = tmp_path / "log.txt"
    run_command([sys.executable, "-c", _EXITING_SCRIPT, str(out)], timeout=120,
                env={k: None for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")})
    assert int((tmp_path / "log.txt.frozen").read_text()) > 10_000
    assert out.read_text() == "written, never flushed\n"


LISTENING = os.path.join(os.path.dirname(ALLREDUCE), "listening.py")


def _listeners(out: str) -> list:
    return re.findall(r"^LISTEN (\S+):(\d+) (\d+)$", out, re.M)


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs `ss` to list listening sockets")
def test_single_node_smshim_run_listens_on_loopback_only(tmp_path):
    """The launcher's rendezvous store, the workers' shared store and every gloo group."""
    out = run_command([sys.executable, "-m", "smshim", "run", "-n", "2", LISTENING], timeout=120,
                      env=NO_LAUNCHER, cwd=str(tmp_path)).stdout
    found = _listeners(out)
    assert len({pid for _, _, pid in found}) == 3, out  # the launcher and both workers listen
    assert all(addr == "127.0.0.1" for addr, _, _ in found), out
    assert "STORE 127.0.0.1:" in out and "GLOO_SOCKET_IFNAME=lo" in out, out


@pytest.mark.skipif(MPIRUN is None or shutil.which("ss") is None,
                    reason="needs mpirun and `ss`")
def test_single_host_mpirun_store_and_gloo_on_loopback():
    out = run_command([MPIRUN, "-n", "2", sys.executable, LISTENING], timeout=120,
                      env=NO_LAUNCHER).stdout
    store = re.search(r"^STORE 127\.0\.0\.1:(\d+) GLOO_SOCKET_IFNAME=lo$", out, re.M)
    assert store, out
    # MPI's own sockets may use other interfaces; the store must not.
    assert [a for a, port, _ in _listeners(out) if port == store.group(1)] == ["127.0.0.1"], out


# ---- the pipeline's threads under SCHED_BATCH (runtime/scheduling.py) -----------------------

def _policies():
    return {int(t): os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")}


@pytest.mark.skipif(not scheduling.available(), reason="needs Linux's SCHED_BATCH")
def test_batch_scheduling_covers_every_thread_and_restore_undoes_it(monkeypatch):
    monkeypatch.delenv(scheduling.ENV, raising=False)
    started, stop = threading.Event(), threading.Event()

    def idle_thread():
        # A thread someone put in another class keeps it.
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        started.set()
        stop.wait(30)

    other = threading.Thread(target=idle_thread)
    other.start()
    started.wait(30)
    before = _policies()
    try:
        assert scheduling.use_batch_scheduling()
        during = _policies()
        assert during[other.native_id] == os.SCHED_IDLE
        assert all(p == os.SCHED_BATCH for t, p in during.items()
                   if before.get(t) == os.SCHED_OTHER), during
        # A thread started by a batch thread inherits the class.
        seen = []
        child = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))
        child.start()
        child.join()
        assert seen == [os.SCHED_BATCH]
    finally:
        scheduling.restore()
        stop.set()
        other.join()
    after = _policies()
    assert all(after[t] == p for t, p in before.items() if t in after and t != other.native_id)


@pytest.mark.skipif(not scheduling.available(), reason="needs Linux's SCHED_BATCH")
def test_batch_scheduling_off_by_env(monkeypatch):
    monkeypatch.setenv(scheduling.ENV, "0")
    before = _policies()
    assert not scheduling.use_batch_scheduling()
    assert _policies() == before


def _whole_host() -> bool:
    return (hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2
            and len(os.sched_getaffinity(0)) == os.cpu_count())


@pytest.mark.skipif(not (scheduling.available() and _whole_host()),
                    reason="needs Linux and at least 2 cores this process may all use")
def test_bind_to_own_cores_gives_each_local_rank_its_slice_and_restore_undoes_it(monkeypatch):
    import torch

    monkeypatch.delenv(scheduling.BIND_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpus = sorted(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    try:
        cores = scheduling.bind_to_own_cores(1, 2)
        share = len(cpus) // 2
        assert cores == cpus[share:2 * share]
        assert scheduling.binding() == (cores, set(cpus))
        for t in os.listdir("/proc/self/task"):
            assert os.sched_getaffinity(int(t)) == set(cores)
        assert torch.get_num_threads() <= share
    finally:
        scheduling.restore()
    assert scheduling.binding() is None
    assert os.sched_getaffinity(0) == set(cpus)
    assert torch.get_num_threads() == threads


@pytest.mark.skipif(not (scheduling.available() and _whole_host()),
                    reason="needs Linux and at least 2 cores this process may all use")
def test_bind_to_own_cores_leaves_a_bound_or_crowded_or_opted_out_rank(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpus = sorted(os.sched_getaffinity(0))
    assert scheduling.bind_to_own_cores(0, len(cpus) + 1) is None  # more ranks than cores
    assert scheduling.bind_to_own_cores(0, 1) is None  # the host's only rank
    monkeypatch.setenv(scheduling.BIND_ENV, "0")
    assert scheduling.bind_to_own_cores(0, 2) is None
    monkeypatch.delenv(scheduling.BIND_ENV)
    os.sched_setaffinity(0, cpus[:1])  # a launcher bound it already
    try:
        assert scheduling.bind_to_own_cores(0, 2) is None
    finally:
        os.sched_setaffinity(0, cpus)
    assert os.sched_getaffinity(0) == set(cpus)


@pytest.mark.skipif(not (scheduling.available() and _whole_host()),
                    reason="needs Linux and at least 2 cores this process may all use")
@pytest.mark.parametrize("local_known", [True, False])
def test_a_pipeline_that_fails_to_start_gives_the_threads_their_class_and_cores_back(
        monkeypatch, local_known):
    import types

    import torch

    from smshim.modelparallel.torch.pipeline import pipeline as pipeline_module
    from smshim.runtime.launch import LaunchInfo

    monkeypatch.delenv(scheduling.ENV, raising=False)
    monkeypatch.delenv(scheduling.BIND_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(pipeline_module, "state", types.SimpleNamespace(
        launch=LaunchInfo("torchrun", 0, 2, 0, 2, None, None, local_known)))

    def server_fails(*args, **kwargs):
        # What the server's start does first here: the class and the binding are in place (no
        # binding when the launcher did not say how many ranks share the host).
        assert os.sched_getscheduler(0) == os.SCHED_BATCH
        assert (scheduling.binding() is not None) == local_known
        raise RuntimeError("the module server could not start")

    monkeypatch.setattr(pipeline_module, "ModuleServer", server_fails)
    cpus, policy = os.sched_getaffinity(0), os.sched_getscheduler(0)
    with pytest.raises(RuntimeError, match="could not start"):
        pipeline_module.Pipeline(torch.nn.Linear(2, 2), {}, [0, 1], 0, (None, None),
                                 "interleaved", 2, None, 60.0, torch.device("cpu"))
    assert scheduling.binding() is None
    assert os.sched_getaffinity(0) == cpus
    assert os.sched_getscheduler(0) == policy
