"""Issue 40, "the first hour": what a SageMaker user meets first, each with the exact message.

1 config provenance and the missing launcher; 2 CPU mode; 3 distribution values checked before
launch; 4 a short failure report with per-rank logs; 5 the SM_* contract always set;
6 loss.backward() inside @smp.step; 7 Python-literal and @file distributions; 8 help and version;
(9, multi-node, is in test_multinode.py). Plus issue 36 item 8: every distribution kind.
"""

import json
import os
import shutil
import sys
import time

import pytest
import torch

from smshim.launcher.sagemaker_env import DistributionError, parse_distribution
from smshim.modelparallel.torch.config import resolve_config
from smshim.modelparallel.torch.errors import SMPConfigError
from smshim.testing import run_command, run_ranks
from tests.usage_helpers.models import assert_close, batches, make_model, reference

HERE = os.path.dirname(__file__)
SCRIPTS = os.path.join(HERE, "scripts")
DUMP = os.path.join(SCRIPTS, "dump_env.py")
GPU_STYLE = os.path.join(SCRIPTS, "gpu_style_train.py")
SMSHIM = [sys.executable, "-m", "smshim"]
BIN = os.path.dirname(sys.executable)  # the venv's tools, also when it is not activated
NO_LAUNCHER = {k: None for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                                  "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "SM_HOSTS",
                                  "SM_HP_MP_PARAMETERS", "SMSHIM_CPU", "SMSHIM_CPU_WARNED",
                                  "SMP_MANUAL_INIT")}
PP2 = {"partitions": 2, "microbatches": 2}


def _smp_dist(params, pph=2):
    return json.dumps({"smdistributed": {"modelparallel": {"enabled": True, "parameters": params}},
                       "mpi": {"enabled": True, "processes_per_host": pph}})


def _run(args, tmp_path, timeout=120, check=True, env=None, cmd=None):
    e = dict(NO_LAUNCHER, DUMP_DIR=str(tmp_path), OUT_DIR=str(tmp_path))
    e.update(env or {})
    return run_command((cmd or SMSHIM + ["run"]) + list(args), timeout=timeout, env=e,
                       cwd=str(tmp_path), check=check)


# ---- 1: where the config was looked for; the missing launcher ------------------------------------

def test_no_config_found_names_the_sources_and_the_fix():
    with pytest.raises(SMPConfigError) as e:
        resolve_config(None, 2, env={})
    msg = str(e.value)
    assert "no smp config found (looked in smp.init's argument and SM_HP_MP_PARAMETERS)" in msg
    assert "smshim run --distribution" in msg and "set SM_HP_MP_PARAMETERS=" in msg
    with pytest.raises(SMPConfigError, match=r"config from SM_HP_MP_PARAMETERS\)"):
        resolve_config(None, 3, env={"SM_HP_MP_PARAMETERS": '{"partitions": 2}'})
    with pytest.raises(SMPConfigError, match=r"config from smp.init's argument\)"):
        resolve_config({"partitions": 2}, 4, env={})


def test_no_config_under_a_launcher_says_so(tmp_path):
    r = _run(["-n", "2", os.path.join(SCRIPTS, "smp_init_only.py")], tmp_path, check=False)
    assert r.returncode == 1
    assert "no smp config found" in r.stderr and "smshim run --distribution" in r.stderr, r.stderr


def test_one_process_start_names_the_missing_launcher(tmp_path):
    r = run_command([sys.executable, os.path.join(SCRIPTS, "smp_init_only.py")], timeout=60,
                    env=dict(NO_LAUNCHER, SM_HP_MP_PARAMETERS='{"partitions": 2}'), check=False)
    assert r.returncode != 0
    err = r.stderr
    assert "started without a launcher" in err and "world size is 1" in err, err
    assert "smshim run -n 2" in err and "torchrun --nproc-per-node 2" in err and "mpirun -n 2" in err


# ---- 2: CPU mode ---------------------------------------------------------------------------------

def _want(steps=3):
    return reference(batches(steps, 8), lambda p: torch.optim.SGD(p, lr=0.1))


def _params(tmp_path, n):
    out = []
    for r in range(n):
        d = torch.load(os.path.join(tmp_path, f"params_rank{r}.pt"), weights_only=True)
        assert d["cuda"] is False  # is_available() kept telling the truth
        out.append(d)
    return out


def _merged(dumps):
    merged = {}
    for d in dumps:
        if d["dp_rank"] == 0:
            merged.update(d["params"])
    return merged


def test_cpu_mode_runs_a_gpu_ddp_script_unchanged(tmp_path):
    r = _run(["--cpu", "-n", "2", GPU_STYLE, "--mode", "ddp"], tmp_path)
    # One warning, from the launcher, naming what is mapped.
    assert r.stderr.count("CPU mode (SMSHIM_CPU=1)") == 1, r.stderr
    for name in ("torch.cuda.set_device", ".cuda()", '.to("cuda"', "DistributedDataParallel",
                 "torch.load(map_location"):
        assert name in r.stderr
    dumps = _params(tmp_path, 2)
    for d in dumps:
        assert_close(d["params"], _want())


def test_cpu_mode_runs_a_gpu_smp_script_at_pp2(tmp_path):
    _run(["--cpu", "--distribution", _smp_dist(PP2), GPU_STYLE, "--mode", "smp"], tmp_path)
    assert_close(_merged(_params(tmp_path, 2)), _want())


def test_cpu_mode_under_torchrun_by_environment(tmp_path):
    r = _run(["--standalone", "--log-dir", str(tmp_path / "logs"), "--nproc-per-node", "2",
              GPU_STYLE, "--mode", "ddp"], tmp_path,
             cmd=[sys.executable, "-m", "torch.distributed.run"], env={"SMSHIM_CPU": "1"})
    assert r.stderr.count("CPU mode (SMSHIM_CPU=1)") == 1, r.stderr  # rank 0 only
    for d in _params(tmp_path, 2):
        assert_close(d["params"], _want())


def test_cpu_mode_under_mpirun_by_environment(tmp_path):
    mpirun = os.path.join(BIN, "mpirun")
    if not os.path.exists(mpirun):
        mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("no mpirun (pip install '.[mpi]')")
    _run(["-n", "2", sys.executable, GPU_STYLE, "--mode", "smp"], tmp_path, cmd=[mpirun],
         env={"SMSHIM_CPU": "1", "SM_HP_MP_PARAMETERS": json.dumps(PP2)})
    assert_close(_merged(_params(tmp_path, 2)), _want())


def test_without_cpu_mode_nothing_is_mapped(tmp_path):
    r = _run(["-n", "1", GPU_STYLE, "--mode", "ddp"], tmp_path, check=False)
    assert r.returncode == 1 and "CPU mode" not in r.stderr
    assert "_cuda_setDevice" in r.stderr or "CUDA" in r.stderr, r.stderr


def test_cpu_mode_maps_tensors_created_on_cuda():
    code = """
import torch
d = torch.device("cuda", 1)
made = [torch.zeros(2, device="cuda"), torch.ones(2, device=d), torch.tensor([1.0], device="cuda:0"),
        torch.arange(3, device=d), torch.randn(2, device=0), torch.empty(1, device="cuda"),
        torch.full((2,), 3.0, device=d), torch.eye(2, device=d), torch.randint(0, 5, (3,), device=d),
        torch.zeros_like(torch.ones(2), device="cuda"), torch.ones(2).new_zeros(3, device=d),
        torch.as_tensor([1, 2], device="cuda")]
assert all(t.device.type == "cpu" for t in made), [t.device for t in made]
assert torch.zeros(2, device="meta").device.type == "meta"  # other devices are left alone
assert not torch.cuda.is_available()
print("mapped", len(made))
"""
    r = run_command([sys.executable, "-c", code], timeout=120, env=dict(NO_LAUNCHER, SMSHIM_CPU="1"))
    assert "mapped 12" in r.stdout, r.stdout + r.stderr
    # Without CPU mode a CUDA device stays one (and fails here, where there is none).
    r = run_command([sys.executable, "-c", "import torch; torch.zeros(1, device='cuda')"],
                    timeout=120, env=NO_LAUNCHER, check=False)
    assert r.returncode != 0


def test_cpu_mode_does_nothing_at_start_up_without_the_variable():
    code = ("import sys, smshim._alias; "
            "print(any(type(f).__name__ == '_TorchImportHook' for f in sys.meta_path), "
            "'smshim.runtime.cpu_mode' in sys.modules)")
    off = run_command([sys.executable, "-c", code], timeout=60, env=NO_LAUNCHER).stdout.split()
    on = run_command([sys.executable, "-c", code], timeout=60,
                     env=dict(NO_LAUNCHER, SMSHIM_CPU="1")).stdout.split()
    assert off == ["False", "False"] and on == ["True", "True"]


# ---- 3: distribution values and the process count, before any process starts --------------------

@pytest.mark.parametrize("params, pph, words", [
    ({"partitions": 2, "microbatch": 4}, 2, ["'microbatch'", "did you mean 'microbatches'"]),
    ({"partitions": "two"}, 2, ["'partitions'='two'", "must be an int >= 1"]),
    ({"partitions": 2}, 3, ["world size 3 is not divisible", "launch a multiple of 2"]),
    ({"partitions": 2}, 4, ["needs data parallelism", '"ddp": true']),
])
def test_distribution_values_fail_before_launch(tmp_path, params, pph, words):
    t0 = time.monotonic()
    r = _run(["--distribution", _smp_dist(params, pph), DUMP], tmp_path, check=False)
    assert r.returncode == 2, r.stderr
    assert "smdistributed.modelparallel.parameters" in r.stderr
    for w in words:
        assert w in r.stderr, r.stderr
    assert not list(tmp_path.glob("rank*.json"))  # no worker started
    assert time.monotonic() - t0 < 30


# ---- 4: a failing job's terminal output ----------------------------------------------------------

def test_config_typo_at_n4_prints_one_error_and_the_log_paths(tmp_path):
    r = _run(["-n", "4", os.path.join(SCRIPTS, "typo_smp.py")], tmp_path, check=False)
    assert r.returncode == 1
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert len(lines) <= 10, "\n".join(lines)
    err = r.stderr
    assert err.count("unknown key 'microbatchs'") == 1, err  # once, not once per rank
    assert "did you mean 'microbatches'" in err
    assert "typo_smp.py failed on rank" in err and "at typo_smp.py line 4: smp.init(" in err, err
    assert "Traceback" not in err and "elastic" not in err, err
    logs = [line.split("full tracebacks: ", 1)[1] for line in lines if "full tracebacks: " in line]
    assert len(logs) == 1
    attempt = logs[0].split("/<local rank>/")[0]
    full = [open(os.path.join(attempt, str(r_), "stderr.log")).read() for r_ in range(4)]
    assert any("Traceback (most recent call last)" in f and "microbatchs" in f for f in full)


def test_stderr_of_a_working_job_still_reaches_the_terminal(tmp_path):
    script = tmp_path / "warns.py"
    script.write_text("import os, sys\nprint('to stderr', os.environ['RANK'], file=sys.stderr)\n")
    r = _run(["-n", "2", str(script)], tmp_path)
    assert "to stderr 0" in r.stderr and "to stderr 1" in r.stderr


# ---- 5: the SM_* contract is always there --------------------------------------------------------

@pytest.mark.parametrize("extra", [[], ["--output-dir", "out"]])
def test_plain_run_sets_the_container_directories(tmp_path, extra):
    _run(["-n", "2", *extra, DUMP], tmp_path)
    base = tmp_path / (extra[1] if extra else "smshim_output")
    for r in range(2):
        env = json.load(open(tmp_path / f"rank{r}.json"))["env"]
        assert env["SM_MODEL_DIR"] == str(base / "model")
        assert env["SM_OUTPUT_DATA_DIR"] == str(base / "output" / "data")
        assert os.path.isdir(env["SM_MODEL_DIR"]) and os.path.isdir(env["SM_OUTPUT_DATA_DIR"])
        for key in ("SM_HOSTS", "SM_CURRENT_HOST", "SM_NUM_GPUS", "SM_NUM_CPUS", "SM_HPS",
                    "SM_FRAMEWORK_PARAMS", "SM_CHANNELS"):
            assert key in env, key


# ---- 6: loss.backward() inside @smp.step ---------------------------------------------------------

def _backward_in_step(pp):
    import smdistributed.modelparallel.torch as smp

    smp.init({"partitions": pp, "microbatches": 2})
    model = smp.DistributedModel(make_model())

    @smp.step
    def train_step(model, x, y):
        loss = model(x, labels=y)["loss"]
        loss.backward()  # the porting slip
        return loss

    x, y = batches(1, 8)[0]
    try:
        train_step(model, x, y)
    except Exception as e:  # noqa: BLE001
        return str(e)
    return None


@pytest.mark.parametrize("pp", [1, 2])
def test_loss_backward_in_step_says_call_model_backward(pp):
    for msg in run_ranks(_backward_in_step, pp, pp, timeout=90):
        assert msg is not None
        assert "loss.backward() was called inside an @smp.step function" in msg, msg
        assert "model.backward(loss)" in msg


# ---- 7: distributions as pasted from a notebook, or from a file ----------------------------------

def test_distribution_as_python_literal_or_file(tmp_path):
    literal = ("{'smdistributed': {'modelparallel': {'enabled': True, 'parameters': "
               "{'partitions': 2}}}, 'mpi': {'enabled': True, 'processes_per_host': 2}}")
    assert parse_distribution(literal).mp_parameters == {"partitions": 2}
    f = tmp_path / "dist.json"
    f.write_text(_smp_dist({"partitions": 2}))
    assert parse_distribution(f"@{f}").processes_per_host == 2
    with pytest.raises(DistributionError, match="cannot read"):
        parse_distribution(f"@{tmp_path}/missing.json")
    with pytest.raises(DistributionError) as e:
        parse_distribution("{'mpi': {'enabled': Tru}")
    assert "not valid JSON" in str(e.value) and "Python dict literal" in str(e.value)
    assert "@path/to/file.json" in str(e.value)
    _run(["--distribution", literal, "--hyperparameters", "{'lr': 0.5}", DUMP], tmp_path)
    env = json.load(open(tmp_path / "rank0.json"))["env"]
    assert json.loads(env["SM_HP_MP_PARAMETERS"]) == {"partitions": 2} and env["SM_HP_LR"] == "0.5"


# ---- 8: help and version -------------------------------------------------------------------------

def test_help_and_version():
    from smshim import __version__
    from smshim.launcher import cli

    top = run_command(SMSHIM + ["--help"], timeout=60).stdout
    assert "`" not in top
    assert run_command(SMSHIM + ["--version"], timeout=60).stdout.strip() == f"smshim {__version__}"
    h = run_command(SMSHIM + ["run", "--help"], timeout=60).stdout
    assert "`" not in h
    assert "processes = pipeline x tensor x data parallel degree" in h
    assert "examples:" in h and "smshim run -n 2 --cpu" in h and "--nnodes 2 --node-rank 0" in h
    for var in ("SMSHIM_CPU", "SMSHIM_RUN_ID", "SMSHIM_TIMEOUT", "SMSHIM_LOG_LEVEL", "SMSHIM_ALIAS"):
        assert var in h
    run_parser = cli._parser()._subparsers._group_actions[0].choices["run"]
    for action in run_parser._actions:
        assert action.help, f"{action.option_strings or action.dest} has no help text"


# ---- issue 36 item 8: every distribution kind of the PyTorch / Hugging Face estimators ----------

def test_torch_distributed_with_smp_is_a_v2_job(tmp_path):
    v2 = {"torch_distributed": {"enabled": True},
          "smdistributed": {"modelparallel": {"enabled": True,
                                              "parameters": {"hybrid_shard_degree": 2}}}}
    _run(["-n", "2", "--distribution", json.dumps(v2), DUMP], tmp_path)
    for r in range(2):
        d = json.load(open(tmp_path / f"rank{r}.json"))
        env, argv = d["env"], d["argv"]
        # As SageMaker's SDK sends v2 parameters: one JSON string.
        assert json.loads(env["SM_HP_MP_PARAMETERS"]) == {"hybrid_shard_degree": 2}
        assert json.loads(argv[argv.index("--mp_parameters") + 1]) == {"hybrid_shard_degree": 2}
        fw = json.loads(env["SM_FRAMEWORK_PARAMS"])
        assert fw["sagemaker_torch_distributed_enabled"] is True
        assert fw["sagemaker_mpi_enabled"] is False
        assert env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == str(r)


def test_pytorchddp_is_native_ddp(tmp_path):
    _run(["-n", "2", "--distribution", '{"pytorchddp": {"enabled": true}}', GPU_STYLE,
          "--mode", "ddp"], tmp_path, env={"SMSHIM_CPU": "1"})
    for d in _params(tmp_path, 2):
        assert_close(d["params"], _want())
        assert json.loads(d["framework_params"])["sagemaker_pytorch_ddp_enabled"] is True


def test_pytorchxla_without_torch_xla_says_what_to_use(tmp_path):
    import importlib.util

    if importlib.util.find_spec("torch_xla") is not None:
        pytest.skip("torch_xla is installed")
    r = _run(["-n", "2", "--distribution", '{"pytorchxla": {"enabled": true}}', DUMP], tmp_path,
             check=False)
    assert r.returncode == 2 and not list(tmp_path.glob("rank*.json"))
    assert "needs torch_xla, which is not installed" in r.stderr
    assert '"torch_distributed": {"enabled": true}' in r.stderr


@pytest.mark.parametrize("dist, words", [
    ({"pytorchddp": {"enabled": True}, "smdistributed": {"dataparallel": {"enabled": True}}},
     ["pytorchddp", "cannot be combined with smdistributed"]),
    ({"torch_distributed": {"enabled": True}, "mpi": {"enabled": True}},
     ["torch_distributed and mpi", "enable one"]),
    ({"smdistributed": {"modelparallel": {"enabled": True}}},
     ["mpi.enabled=true for SMP v1", "torch_distributed.enabled=true for SMP v2"]),
    ({"pytorchddp": {"enabled": "yes"}}, ["pytorchddp.enabled"]),
    ({"torch_distributed": {"enabled": True, "foo": 1}}, ["torch_distributed.foo"]),
])
def test_bad_launcher_combinations(dist, words):
    with pytest.raises(DistributionError) as e:
        parse_distribution(dist)
    for w in words:
        assert w in str(e.value), str(e.value)
