"""examples/tsm_llama.py, AWS's SMP v2 call sequence, runs through `smshim run` on 4 processes at
tensor_parallel_degree 2 x hybrid_shard_degree 2 (2 replicas of the TP x FSDP model): the loss
falls, per-TP-rank sharded checkpoints are written every N steps, a resume from step 10 repeats the
first run's losses, and the full export is an ordinary (whole, not TP-split) HF checkpoint.

The script has no branch on the degrees, so this one launch also stands for tp 1: hybrid sharding
without TP is checked against one process in-process (test_tsm_fsdp.py, test_tsm_transform.py)."""

import json
import os
import re
import sys

import torch

from smshim.testing import run_command

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "tsm_llama.py")


def _run(tmp_path, *args, steps=20):
    env = {"SM_HP_MP_PARAMETERS": json.dumps({"tensor_parallel_degree": 2,
                                              "hybrid_shard_degree": 2})}
    out = run_command([sys.executable, "-m", "smshim", "run", "-n", "4", EXAMPLE, "--max_steps",
                       str(steps), "--checkpoint_freq", "10", "--checkpoint_dir",
                       str(tmp_path / "ckpt"), *args], timeout=300, cwd=str(tmp_path), env=env)
    return out.stdout + out.stderr


def test_tsm_llama_example_tp2_shard2_trains_checkpoints_and_resumes(tmp_path):
    log = _run(tmp_path)
    m = re.search(r"loss ([0-9.]+) -> ([0-9.]+)", log)
    assert m and float(m.group(2)) < float(m.group(1)) - 0.5, log[-3000:]
    assert "dp 2 x tp 2 x cp 1, hybrid_shard_degree 2" in log, log[-3000:]
    for step in (10, 20):
        for tp_rank in (0, 1):
            assert (tmp_path / "ckpt" / f"{step}steps" / f"tp{tp_rank}_ep0" / ".metadata").exists()
    # Resume at step 10: steps 10..11 give the losses the first run logged for them.
    resumed = _run(tmp_path, "--resume_from_checkpoint", str(tmp_path / "ckpt" / "10steps"), steps=12)
    assert "resumed from" in resumed and "at step 10" in resumed, resumed[-3000:]
    first = dict(re.findall(r"step (\d+) loss ([0-9.]+)", log))
    again = dict(re.findall(r"step (\d+) loss ([0-9.]+)", resumed))
    assert again["10"] == first["10"] and again["11"] == first["11"], (first, again)
    # The full export is an ordinary HF checkpoint, whole.
    from transformers import LlamaForCausalLM

    # `smshim run` sets SM_MODEL_DIR (<cwd>/smshim_output/model), where the script writes it.
    plain = LlamaForCausalLM.from_pretrained(str(tmp_path / "smshim_output" / "model"))
    assert plain.lm_head.weight.shape == (100, 32)  # whole, not a TP half
    assert all(torch.isfinite(p).all() for p in plain.parameters())
