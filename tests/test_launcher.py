"""`smshim run`: torchrun-style launch plus a SageMaker estimator's distribution/hyperparameters."""

import json
import os
import sys
import time

import pytest

from smshim.launcher.sagemaker_env import (DistributionError, container_hyperparameters, hyperparameter_args,
                               parse_distribution)
from smshim.testing import run_command

HERE = os.path.dirname(__file__)
DUMP = os.path.join(HERE, "scripts", "dump_env.py")
MP_DIST = ('{"smdistributed":{"modelparallel":{"enabled":true,"parameters":{"partitions":2}}},'
           '"mpi":{"enabled":true,"processes_per_host":2}}')


# The console script next to this interpreter: the venv need not be on PATH.
SMSHIM = (os.path.join(os.path.dirname(sys.executable), "smshim"),)


def _launch(tmp_path, *args, check=True, env=None, smshim=SMSHIM):
    e = {"DUMP_DIR": str(tmp_path)}
    e.update(env or {})
    return run_command([*smshim, "run", *args], timeout=120, env=e, cwd=str(tmp_path), check=check)


def _dumps(tmp_path, n):
    out = []
    for r in range(n):
        with open(tmp_path / f"rank{r}.json") as f:
            out.append(json.load(f))
    return out


def test_modelparallel_distribution_sets_the_container_environment(tmp_path):
    _launch(tmp_path, "--distribution", MP_DIST, DUMP, "--epochs", "1")
    for rank, d in enumerate(_dumps(tmp_path, 2)):
        env, argv = d["env"], d["argv"]
        assert json.loads(env["SM_HP_MP_PARAMETERS"]) == {"partitions": 2}
        fw = json.loads(env["SM_FRAMEWORK_PARAMS"])
        assert fw["sagemaker_mpi_enabled"] is True
        assert fw["sagemaker_mpi_num_of_processes_per_host"] == 2
        assert fw["sagemaker_distributed_dataparallel_enabled"] is False
        assert argv[-2:] == ["--epochs", "1"]
        # The SageMaker SDK adds mp_parameters as a hyperparameter: it reaches argv too.
        assert argv[argv.index("--mp_parameters") + 1] == "partitions=2"
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
        assert env["SMDATAPARALLEL_LOCAL_RANK"] == env["LOCAL_RANK"] == str(rank)
        assert json.loads(env["SM_HOSTS"]) == ["algo-1"] and env["SM_CURRENT_HOST"] == "algo-1"
        assert env["SM_NUM_GPUS"] == "0" and int(env["SM_NUM_CPUS"]) >= 1
        assert os.path.isdir(env["SM_MODEL_DIR"]) and os.path.isdir(env["SM_OUTPUT_DATA_DIR"])
        assert env["OMP_NUM_THREADS"] == "1"


def test_dataparallel_distribution_and_hyperparameters(tmp_path):
    _launch(tmp_path, "-n", "2", "--distribution", '{"smdistributed":{"dataparallel":{"enabled":true}}}',
            "--hyperparameters", '{"epochs": 3, "lr": 0.5, "model-name": "tiny"}',
            "--channel", f"train={tmp_path}", DUMP, smshim=(sys.executable, "-m", "smshim"))
    for d in _dumps(tmp_path, 2):
        env, argv = d["env"], d["argv"]
        assert json.loads(env["SM_FRAMEWORK_PARAMS"])["sagemaker_distributed_dataparallel_enabled"]
        assert "SM_HP_MP_PARAMETERS" not in env
        assert env["SM_HP_EPOCHS"] == "3" and env["SM_HP_LR"] == "0.5"
        assert env["SM_HP_MODEL_NAME"] == "tiny"
        assert env["SM_CHANNEL_TRAIN"] == str(tmp_path)
        assert argv == ["--epochs", "3", "--lr", "0.5", "--model-name", "tiny"]


def test_plain_run_sets_no_sagemaker_variables(tmp_path):
    _launch(tmp_path, "-n", "2", DUMP, "--x", "1", env={"SM_HP_MP_PARAMETERS": None})
    for d in _dumps(tmp_path, 2):
        assert d["argv"] == ["--x", "1"]
        assert not any(k.startswith("SM_HP_") for k in d["env"])


@pytest.mark.parametrize("dist, field", [
    ("{not json", "not valid JSON"),
    ('{"smdistributed":{"modelparallel":{"enabled":"yes"}},"mpi":{"enabled":true,"processes_per_host":2}}',
     "smdistributed.modelparallel.enabled"),
    ('{"smdistributed":{"modelparallel":{"enabled":true,"parameters":{"partitions":2}}}}', "mpi.enabled"),
    ('{"smdistributed":{"modelparallel":{"enabled":true}},"mpi":{"enabled":true,"processes_per_host":0}}',
     "mpi.processes_per_host"),
    ('{"smdistributed":{"modelparallel":{"enabled":true}},"mpi":{"enabled":true}}', "mpi.processes_per_host"),
    ('{"smdistributed":{"modelparallel":{"enabled":true}, "dataparallel":{"enabled":true}},'
     '"mpi":{"enabled":true,"processes_per_host":2}}', "both enabled"),
    ('{"smdistributed":{"modelparalel":{"enabled":true}}}', "smdistributed.modelparalel"),
    ('{"mpi":{"enabled":true,"processes_per_host":"2"}}', "mpi.processes_per_host"),
    ('{"smdistributed":{"modelparallel":{"enabled":true,"parameters":[1]}},'
     '"mpi":{"enabled":true,"processes_per_host":2}}', "smdistributed.modelparallel.parameters"),
    ('[1, 2]', "<top level>"),
])
def test_bad_distribution_fails_fast_naming_the_field(tmp_path, dist, field):
    with pytest.raises(DistributionError, match=field.replace(".", r"\.").replace("[", r"\[")):
        parse_distribution(dist)
    t0 = time.monotonic()
    r = _launch(tmp_path, "--distribution", dist, DUMP, check=False)
    assert r.returncode == 2
    assert field in r.stderr
    assert not list(tmp_path.glob("rank*.json"))  # no process started
    assert time.monotonic() - t0 < 30


def test_conflicting_process_counts_are_an_error(tmp_path):
    r = _launch(tmp_path, "-n", "3", "--distribution", MP_DIST, DUMP, check=False)
    assert r.returncode == 2 and "processes_per_host 2" in r.stderr


def test_failing_worker_fails_the_launch(tmp_path):
    r = _launch(tmp_path, "-n", "2", DUMP, check=False, env={"FAIL_ON_RANK": "1"})
    assert r.returncode != 0


def test_a_plain_script_s_process_groups_are_destroyed_at_exit(tmp_path):
    # Never destroyed by the script, a gloo group was freed during finalization and aborted a
    # finished rank, rarely ("terminate called without an active exception"); the workers'
    # start-up hook now destroys it at exit.
    script = os.path.join(HERE, "scripts", "plain_gloo_no_destroy.py")
    r = _launch(tmp_path, "-n", "2", script)
    for rank in range(2):
        assert f"rank {rank} sum 2" in r.stdout, r.stdout
        assert f"rank {rank}: destroy_process_group at exit" in r.stdout, r.stdout
    # Started without the launcher, the script keeps torch's own exit.
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0",
           "SMSHIM_WORKER": None, "SMSHIM_CPU": None}
    r = run_command([sys.executable, script], timeout=60, env=env, cwd=str(tmp_path))
    assert "rank 0 sum 1" in r.stdout and "destroy_process_group" not in r.stdout, r.stdout


def test_hyperparameter_args_follow_the_toolkit():
    hps = container_hyperparameters(parse_distribution(MP_DIST), {"bb": True, "aa": "x", "c": 2})
    # Sorted by name; one-letter names get a single dash; non-strings as str(); dicts as k=v,...
    assert hyperparameter_args(hps) == ["--aa", "x", "--bb", "True", "-c", "2",
                                        "--mp_parameters", "partitions=2"]


def _config(argv, monkeypatch):
    from smshim.launcher import cli

    monkeypatch.setattr(os, "environ", dict(os.environ))  # prepare() exports the job's variables
    return cli.prepare(cli._parser().parse_args(["run", *argv, DUMP]))[0]


def test_max_restarts_reaches_the_elastic_agent(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # `prepare` makes the job's directories under ./smshim_output
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    one = _config(["-n", "2", "--max-restarts", "3"], monkeypatch)
    assert one.max_restarts == 3
    assert one.rdzv_backend == "smshim-local" and one.rdzv_endpoint.startswith("127.0.0.1:")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    assert _config(["-n", "2"], monkeypatch).max_restarts == 0
    # Several nodes: the c10d rendezvous when restarting (node 0 hosts it), else static (each
    # preceded by smshim's roll call, smshim/launcher/multinode.py).
    multi = ["--nnodes", "2", "--master-addr", "10.0.0.1", "--master-port", "29400"]
    c10d = _config([*multi, "--node-rank", "1", "--max-restarts", "1"], monkeypatch)
    assert (c10d.rdzv_backend, c10d.rdzv_endpoint, c10d.rdzv_configs["is_host"]) == (
        "smshim-c10d", "10.0.0.1:29400", False)
    assert _config([*multi, "--node-rank", "1"], monkeypatch).rdzv_backend == "smshim-static"


def test_negative_max_restarts_is_an_error(tmp_path):
    r = _launch(tmp_path, "-n", "2", "--max-restarts", "-1", DUMP, check=False)
    assert r.returncode == 2 and "--max-restarts must be >= 0" in r.stderr


def test_the_stderr_tailer_holds_back_a_traceback_written_in_pieces(tmp_path):
    # The tailer copies a worker's stderr.log to the terminal without tracebacks. A line read
    # while it was still being written (Python prints a caret line in pieces) must not end the
    # traceback early: the tail of the carets would pass for the exception line, and the rest of
    # the traceback would reach the terminal.
    import io
    import threading

    from smshim.launcher.worker_logs import _Tail

    log, out, done = tmp_path / "stderr.log", io.StringIO(), threading.Event()
    with open(log, "w") as w:
        w.write('Traceback (most recent call last):\n  File "x.py", line 4, in <module>\n'
                '    f(a,\n      ^^^^')
        w.flush()
        tail = _Tail(str(log), out, done)
        time.sleep(0.5)  # the tailer polls every 0.1 s: it reads the unfinished caret line
        w.write('^^^^\n  File "y.py", line 9, in f\n    raise ValueError("boom")\n'
                'ValueError: boom\nafter the traceback\nno newline yet')
    done.set()
    tail.thread.join(timeout=10)
    assert out.getvalue() == "after the traceback\nno newline yet"


def test_checking_an_smp_config_does_not_import_fsdp():
    # `smshim run` checks an smp distribution before any process starts, which imports the smp
    # package: without torch's FSDP (imported where sharded data parallelism uses it) that takes
    # ~1.7 s less on every such launch.
    code = ("import sys; import smshim.modelparallel.torch.config; "
            "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.fsdp')))")
    out = run_command([sys.executable, "-c", code], timeout=120).stdout
    assert out.strip() == "[]", out
