"""Benchmark: the pipeline's fused weight gradients on Hugging Face GPT-2 (its `Conv1D`
projections), on vs off.

A GPT-2 built locally (n_embd 256, 4 layers, 4 heads, vocabulary 1024, 64 positions), blocks
2-3 on pp rank 1 by `smp.set_partition`, batch 16 x 64 tokens, pp = 2, `m` microbatches,
`interleaved`, Adam; 2 gloo processes, one thread each. Each round runs the same training in
fresh processes twice, once with `SMSHIM_FUSED_WGRAD=0` (autograd's weight gradients) and once
with the default (weight_grad.py: kept, grouped and computed in the idle time, added in place);
the order alternates between rounds so that both see the same machine load. Reported: median
step time (the slowest rank's) per run, the paired ratio per round, and the losses, which must be
equal (the same sums, rounded differently).

    python benchmarks/wgrad_gpt2.py [--rounds 6] [--steps 10] [--m 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from smshim.testing import run_ranks  # noqa: E402

RESULTS = os.path.join(HERE, "results")
CONFIG = dict(vocab_size=1024, n_positions=64, n_embd=256, n_layer=4, n_head=4)
BATCH = 16


def _model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(**CONFIG, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def _train(m: int, warmup: int, steps: int) -> Dict[str, Any]:
    import torch.distributed as dist

    import smdistributed.modelparallel.torch as smp

    torch.set_num_threads(1)
    smp.init({"pipeline_parallel_degree": 2, "microbatches": m, "pipeline": "interleaved",
              "auto_partition": False, "default_partition": 0})
    module = _model()
    model = smp.DistributedModel(module)
    for block in module.transformer.h[CONFIG["n_layer"] // 2:]:
        smp.set_partition(block, 1)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4))

    @smp.step
    def train_step(model, ids):
        out = model(input_ids=ids, labels=ids)
        model.backward(out.loss)
        return out.loss

    gen = torch.Generator().manual_seed(0)
    times, losses = [], []
    for i in range(warmup + steps):
        ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, CONFIG["n_positions"]), generator=gen)
        dist.barrier()
        start = time.perf_counter()
        loss = train_step(model, ids)
        opt.step()
        opt.zero_grad()
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - start)
        losses.append(float(loss.reduce_mean()))
    smp.reset()
    return {"times": times, "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(RESULTS, "wgrad_gpt2.json"))
    a = ap.parse_args()

    load = os.getloadavg()
    rounds: List[Dict[str, Any]] = []
    for r in range(a.rounds):
        order = ("0", "1") if r % 2 == 0 else ("1", "0")
        run = {}
        for flag in order:
            res = run_ranks(_train, 2, a.m, a.warmup, a.steps, timeout=600,
                            env={"SMSHIM_FUSED_WGRAD": flag})
            slowest = [max(t) for t in zip(*(x["times"] for x in res))]  # per step
            run[flag] = {"step_s": statistics.median(slowest), "losses": res[0]["losses"]}
        for x, y in zip(run["0"]["losses"], run["1"]["losses"]):
            assert abs(x - y) <= 1e-4 * abs(x), (x, y)
        ratio = run["1"]["step_s"] / run["0"]["step_s"]
        rounds.append({"off_s": run["0"]["step_s"], "on_s": run["1"]["step_s"], "on_vs_off": ratio})
        print(f"round {r}: off {1e3 * run['0']['step_s']:.0f} ms, on {1e3 * run['1']['step_s']:.0f}"
              f" ms, on / off {ratio:.3f}", flush=True)
    ratios = [x["on_vs_off"] for x in rounds]
    print(f"GPT-2 {CONFIG}, batch {BATCH}, pp=2, m={a.m}, interleaved: fused weight gradients "
          f"on / off, median over {a.rounds} rounds {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f}); losses equal at every step")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"config": CONFIG, "batch": BATCH, "m": a.m, "steps": a.steps,
                   "load_avg_start": load, "load_avg_end": os.getloadavg(), "rounds": rounds,
                   "median_on_vs_off": statistics.median(ratios)}, f, indent=1)


if __name__ == "__main__":
    main()
