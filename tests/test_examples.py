"""The examples run end to end through `smshim run`, at small size, and do what they claim."""

import importlib.util
import json
import os
import re
import sys

import pytest

from smshim.testing import run_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
needs_sklearn = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None,
                                   reason="the digits examples need scikit-learn (the examples extra)")


def _run(tmp_path, *args, timeout=150):
    cmd = [sys.executable, "-m", "smshim", "run", *args]
    return run_command(cmd, timeout=timeout, cwd=str(tmp_path)).stdout


def _loss_fell(out: str) -> tuple:
    m = re.search(r"loss ([0-9.]+) -> ([0-9.]+)", out)
    assert m, out
    first, last = float(m.group(1)), float(m.group(2))
    assert last < first, out
    return first, last


def test_gpt_pipeline_main_job(tmp_path):
    # The main job's command line, shrunk: pp=2 x dp=2 from the script's own defaults.
    out_dir = tmp_path / "out"
    out = _run(tmp_path, "-n", "4", os.path.join(EXAMPLES, "gpt_pipeline.py"), "--steps", "6",
               "--layers", "2", "--corpus-kb", "64", "--out-dir", str(out_dir))
    assert "4 processes = pp 2 x dp 2, 4 microbatches, pipeline interleaved" in out, out
    steps = re.findall(r"^step +(\d+)/6 +loss ([0-9.]+) .* ms/step .* samples/s .* tokens/s$", out, re.M)
    assert [int(s) for s, _ in steps] == list(range(1, 7)), out  # one line per step, rank 0 only
    assert re.search(r"after the first: \d+ ms/step, [0-9.]+ samples/s, [0-9.]+k? tokens/s", out), out
    _loss_fell(out)
    traces = sorted(os.listdir(out_dir / "trace"))
    assert traces == [f"trace_rank{r}.json" for r in range(4)], traces
    with open(out_dir / "trace" / "trace_rank1.json") as f:
        events = json.load(f)["traceEvents"]
    # The traced run is two steps of a fresh model, not the training run.
    assert {e["args"]["step"] for e in events if e.get("cat") == "backward"} == {0, 1}
    if HAVE_MPL:
        assert (out_dir / "loss_curve.png").stat().st_size > 1000
        assert (out_dir / "timeline.png").stat().st_size > 1000
    else:
        assert "matplotlib is not installed: skipping loss_curve.png" in out


def test_gpt_pipeline_bf16_sharded_checkpointed(tmp_path):
    # The main job with issue 12's training features on: bf16 with fp32 master weights and a
    # dynamic loss scale, optimizer state sharded over the 2 replicas, every block checkpointed.
    params = {"partitions": 2, "microbatches": 4, "ddp": True, "bf16": True,
              "shard_optimizer_state": True}
    dist = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": params}},
            "mpi": {"enabled": True, "processes_per_host": 4}}
    out = _run(tmp_path, "--distribution", json.dumps(dist), "--output-dir", str(tmp_path / "job"),
               os.path.join(EXAMPLES, "gpt_pipeline.py"), "--steps", "6", "--layers", "2",
               "--corpus-kb", "64", "--out-dir", str(tmp_path / "out"), "--no-timeline",
               "--activation-checkpointing")
    assert "4 processes = pp 2 x dp 2, 4 microbatches" in out, out
    _loss_fell(out)
    # Its checkpoint (written at the last step) holds the gathered optimizer state.
    assert (tmp_path / "out" / "checkpoints" / "newest").read_text().strip(), out


@needs_sklearn
def test_mnist_smp_from_a_sagemaker_distribution(tmp_path):
    params = {"partitions": 2, "microbatches": 4, "pipeline": "interleaved", "ddp": True}
    dist = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": params}},
            "mpi": {"enabled": True, "processes_per_host": 4}}
    out = _run(tmp_path, "--distribution", json.dumps(dist), "--output-dir", str(tmp_path / "job"),
               os.path.join(EXAMPLES, "mnist_smp.py"), "--epochs", "2")
    assert "4 processes = pp 2 x dp 2, 4 microbatches" in out, out
    acc = [float(a) for a in re.findall(r"test accuracy ([0-9.]+)%", out)]
    assert len(acc) == 3 and acc[-1] > 50.0, out  # chance is 10 %
    model_dir = tmp_path / "job" / "model"  # SM_MODEL_DIR
    assert sorted(os.listdir(model_dir)) == ["model.pt_0_0", "model.pt_1_0"]
    assert out.count("saved and re-read") == 2, out


@needs_sklearn
def test_mnist_smddp_legacy_api(tmp_path):
    out = _run(tmp_path, "-n", "2", "--distribution",
               '{"smdistributed": {"dataparallel": {"enabled": true}}}',
               "--output-dir", str(tmp_path / "job"), os.path.join(EXAMPLES, "mnist_smddp.py"),
               "--epochs", "3")
    acc = [float(a) for a in re.findall(r"test accuracy ([0-9.]+)%", out)]
    assert len(acc) == 4 and acc[-1] > 50.0, out
    assert out.count("epoch 3:") == 1, out  # rank 0 only
    assert (tmp_path / "job" / "model" / "model.pt").exists()
    assert (tmp_path / "job" / "checkpoints" / "checkpoint.pt").exists()
    # Started again with more epochs (as after a restart), it continues after epoch 3.
    more = _run(tmp_path, "-n", "2", "--distribution",
                '{"smdistributed": {"dataparallel": {"enabled": true}}}',
                "--output-dir", str(tmp_path / "job"), os.path.join(EXAMPLES, "mnist_smddp.py"),
                "--epochs", "4")
    assert "after epoch 3" in more and "epoch 3:" not in more and "epoch 4:" in more, more


def test_train_dp(tmp_path):
    out = run_command([sys.executable, "-m", "smshim", "run", "-n", "2",
                       os.path.join(EXAMPLES, "train_dp.py"), "--steps", "10"],
                      timeout=120, cwd=str(tmp_path))
    _loss_fell(out.stdout + out.stderr)  # it logs to stderr


@needs_sklearn
def test_mnist_smp_resumes_from_its_newest_checkpoint(tmp_path):
    """A second start of the job continues from the first one's newest checkpoint (what a
    restart after a lost worker does), mid-epoch included."""
    env = {"SM_HP_MP_PARAMETERS": json.dumps({"partitions": 2, "microbatches": 2}),
           "SMP_MANUAL_INIT": None}
    script = os.path.join(EXAMPLES, "mnist_smp.py")
    common = ["--model-dir", str(tmp_path / "job" / "model"), "--limit", "400", "--batch-size",
              "16", "--checkpoint-every", "7"]
    first = run_command([sys.executable, "-m", "smshim", "run", "-n", "2", script, "--epochs", "1",
                         *common], timeout=150, cwd=str(tmp_path), env=env).stdout
    ckpt = tmp_path / "job" / "checkpoints"  # beside the model directory
    assert (ckpt / "newest").read_text() == "epoch1", first
    assert "resumed from" not in first
    # Epoch 1 has 20 steps (320 images / 16); the last two checkpoints are kept: step 14 and
    # the end of the epoch. Make step 14 the newest, as if the job had died at step 15.
    steps = sorted(p.name for p in ckpt.iterdir() if p.name.endswith("_partial"))
    assert "step14_partial" in steps, steps
    (ckpt / "newest").write_text("step14")
    second = run_command([sys.executable, "-m", "smshim", "run", "-n", "2", script, "--epochs", "2",
                          *common], timeout=150, cwd=str(tmp_path), env=env).stdout
    assert re.search(r"resumed from \S+ at epoch 1, batch 14 \(step 14\)", second), second
    assert "epoch 1:" in second and "epoch 2:" in second, second
    assert (ckpt / "newest").read_text() == "epoch2", second
