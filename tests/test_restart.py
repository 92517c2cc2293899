"""A job that loses a worker continues: `smshim run --max-restarts 1` restarts the worker group on
torch's elastic agent, and the main job (examples/gpt_pipeline.py, pp=2 with `ddp`) resumes from
its newest complete checkpoint, ending with exactly the parameters of a run that was never
interrupted. `deterministic_server` makes the pipeline bit-reproducible, so "exactly" is testable.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from smshim.testing import RankFailure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT = os.path.join(ROOT, "examples", "gpt_pipeline.py")
STEPS = 16
KILL_AFTER = 4  # SIGKILL a worker once this many steps are checkpointed
MP = {"partitions": 2, "microbatches": 2, "ddp": True, "deterministic_server": True}

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="finds the workers through /proc")


def _workers(launcher: int) -> dict:
    """LOCAL_RANK -> pid of the launcher's worker processes."""
    out = {}
    for task in os.listdir(f"/proc/{launcher}/task"):
        try:
            with open(f"/proc/{launcher}/task/{task}/children") as fh:
                children = [int(p) for p in fh.read().split()]
        except OSError:
            continue
        for pid in children:
            try:
                with open(f"/proc/{pid}/environ", "rb") as fh:
                    env = dict(kv.split(b"=", 1) for kv in fh.read().split(b"\0") if b"=" in kv)
            except OSError:
                continue
            if b"LOCAL_RANK" in env:
                out[int(env[b"LOCAL_RANK"])] = pid
    return out


def _newest_step(ckpt: str) -> int:
    try:
        with open(os.path.join(ckpt, "newest")) as fh:
            return int(fh.read().strip().removeprefix("step"))
    except (OSError, ValueError):
        return 0


def _run_job(tmp, name: str, kill: bool, timeout: float = 240.0) -> tuple:
    """Run the main job (small); with `kill`, SIGKILL local rank 1 mid-run. Returns (stdout+stderr,
    checkpoint dir, the step at which the worker was killed)."""
    out_dir = os.path.join(str(tmp), name)
    ckpt = os.path.join(out_dir, "checkpoints")
    cmd = [sys.executable, "-m", "smshim", "run", "-n", "2", "--max-restarts", "1", GPT,
           "--steps", str(STEPS), "--layers", "2", "--d-model", "32", "--corpus-kb", "32",
           "--batch-size", "4", "--no-timeline", "--out-dir", out_dir, "--checkpoint-every", "1"]
    env = dict(os.environ, SM_HP_MP_PARAMETERS=json.dumps(MP), OMP_NUM_THREADS="1",
               SMSHIM_TIMEOUT="60")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SMP_MANUAL_INIT"):
        env.pop(k, None)
    log_path = os.path.join(str(tmp), f"{name}.log")
    killed_at = None
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(tmp),
                                start_new_session=True)
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    raise RankFailure(f"{name}: the job did not finish within {timeout:.0f} s")
                if kill and killed_at is None and _newest_step(ckpt) >= KILL_AFTER:
                    victim = _workers(proc.pid).get(1)
                    if victim is not None:
                        killed_at = _newest_step(ckpt)
                        os.kill(victim, signal.SIGKILL)
                time.sleep(0.01)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    with open(log_path) as fh:
        out = fh.read()
    if proc.returncode != 0:
        raise RankFailure(f"{name}: smshim run exited with {proc.returncode}\n{out[-6000:]}")
    return out, ckpt, killed_at


def _final_parameters(ckpt: str) -> dict:
    assert _newest_step(ckpt) == STEPS
    params = {}
    for pp in (0, 1):
        path = os.path.join(ckpt, f"step{STEPS}_partial", f"model_{pp}_0.pt")
        params.update(torch.load(path, weights_only=True))
    return params


def test_killed_worker_restarts_and_resumes_to_the_same_parameters(tmp_path):
    out, ckpt, killed_at = _run_job(tmp_path, "killed", kill=True)
    assert killed_at is not None and killed_at < STEPS, f"no worker was killed mid-run\n{out}"
    assert "exitcode: -9" in out, out  # the agent saw the SIGKILL ...
    resumed = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", out)]
    assert len(resumed) == 1 and killed_at <= resumed[0] < STEPS, out  # ... and restarted once
    assert re.search(rf"^step {STEPS}/{STEPS} ", out, re.M), out

    ref_out, ref_ckpt, _ = _run_job(tmp_path, "uninterrupted", kill=False)
    assert "resumed from" not in ref_out
    got, want = _final_parameters(ckpt), _final_parameters(ref_ckpt)
    assert set(got) == set(want) and got
    for name, value in want.items():
        if not isinstance(value, torch.Tensor):
            assert got[name] == value, name
            continue
        assert torch.equal(got[name], value), (name, (got[name] - value).abs().max().item())
