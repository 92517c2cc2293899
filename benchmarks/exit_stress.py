"""Stress: do processes exit cleanly under `mpirun -n 2` after their work is done?

Each scenario is a complete small training script, launched N times (default 50) under
`mpirun -n 2`; a run counts as an abort when a rank dies by a signal (gloo's "terminate called
without an active exception" is SIGABRT) or prints that message, and as a failure when mpirun
exits non-zero for any other reason.

Scenarios:
  legacy  `smdistributed.dataparallel.torch.distributed.init_process_group()` + its DDP
  smddp   native torch DDP on `torch.distributed.init_process_group(backend="smddp")`
  smp     a pp=2 smp job (auto-initialised from SM_HP_MP_PARAMETERS, a few pipeline steps)

    python benchmarks/exit_stress.py [--runs 50] [--scenarios legacy,smddp,smp]
        [--python PY]   # run under another environment's mpirun and interpreter, e.g. an Open MPI
                        # side environment (tests/test_mpi_flavours.py shows how to make one)

Results land in benchmarks/results/exit_stress[_<flavour>].json (flavour: mpich or openmpi).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCENARIOS = ("legacy", "smddp", "smp")
ABORT_TEXT = "terminate called without an active exception"


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _train(model, rank: int, steps: int = 3) -> float:
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    loss = torch.zeros(())
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    return float(loss)


def worker_legacy() -> None:
    import smdistributed.dataparallel.torch.distributed as sdist
    from smdistributed.dataparallel.torch.parallel.distributed import DistributedDataParallel

    sdist.init_process_group()
    loss = _train(DistributedDataParallel(_model()), sdist.get_rank())
    print(f"rank {sdist.get_rank()} done loss {loss:.4f}", flush=True)


def worker_smddp() -> None:
    import torch
    import torch.distributed as dist

    import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401  (registers "smddp")

    dist.init_process_group(backend="smddp")
    loss = _train(torch.nn.parallel.DistributedDataParallel(_model()), dist.get_rank())
    print(f"rank {dist.get_rank()} done loss {loss:.4f}", flush=True)


def worker_smp() -> None:
    import torch

    import smdistributed.modelparallel.torch as smp  # auto-init from SM_HP_MP_PARAMETERS

    model = smp.DistributedModel(_model())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def step(model, x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        opt.zero_grad()
        out = step(model, torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
        opt.step()
    print(f"rank {smp.rank()} done loss {out.reduce_mean().item():.4f}", flush=True)


def _mpi_flavour(python: str) -> str:
    out = subprocess.run([python, "-c", "from mpi4py import MPI; print(MPI.Get_library_version())"],
                         capture_output=True, text=True, timeout=120).stdout
    return "openmpi" if "Open MPI" in out else "mpich" if "MPICH" in out else "unknown"


def _launch(scenario: str, timeout: float, python: str, flavour: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", SMSHIM_TIMEOUT="60")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    if scenario == "smp":
        env["SM_HP_MP_PARAMETERS"] = json.dumps({"partitions": 2, "microbatches": 2})
        env.pop("SMP_MANUAL_INIT", None)
    mpirun = os.path.join(os.path.dirname(python), "mpirun")
    extra = ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else []) \
        if flavour == "openmpi" else []
    cmd = [mpirun if os.path.exists(mpirun) else "mpirun", *extra, "-n", "2", python,
           os.path.abspath(__file__), "--worker", scenario]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = None, e.stdout or "", e.stderr or ""
        out, err = (out.decode() if isinstance(out, bytes) else out,
                    err.decode() if isinstance(err, bytes) else err)
    done = out.count(" done loss ")
    aborted = ABORT_TEXT in err or ABORT_TEXT in out or "signal 6" in err or "SIGABRT" in err
    return {"rc": rc, "done": done, "aborted": aborted, "seconds": time.monotonic() - t0,
            "tail": "" if rc == 0 else (err[-1500:] or out[-1500:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--python", default=sys.executable,
                    help="interpreter whose environment's mpirun (same bin directory) is used")
    ap.add_argument("--worker", choices=SCENARIOS, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        {"legacy": worker_legacy, "smddp": worker_smddp, "smp": worker_smp}[a.worker]()
        return
    flavour = _mpi_flavour(a.python)
    results = {}
    for scenario in a.scenarios.split(","):
        runs = []
        for i in range(a.runs):
            r = _launch(scenario, a.timeout, a.python, flavour)
            runs.append(r)
            if r["rc"] != 0:
                print(f"{scenario} run {i}: rc={r['rc']} aborted={r['aborted']} "
                      f"done={r['done']}\n{r['tail']}", file=sys.stderr, flush=True)
        aborts = sum(r["aborted"] for r in runs)
        failures = sum(r["rc"] != 0 for r in runs)
        secs = sorted(r["seconds"] for r in runs)
        results[scenario] = {"runs": len(runs), "aborts": aborts, "nonzero_exits": failures,
                             "both_ranks_finished": sum(r["done"] == 2 for r in runs),
                             "median_s": secs[len(secs) // 2]}
        print(f"{scenario}: {len(runs)} runs, {aborts} aborts, {failures} non-zero exits, "
              f"median {results[scenario]['median_s']:.1f} s per run", flush=True)
    out_dir = os.path.join(ROOT, "benchmarks", "results")
    os.makedirs(out_dir, exist_ok=True)
    name = "exit_stress.json" if flavour == "mpich" else f"exit_stress_{flavour}.json"
    with open(os.path.join(out_dir, name), "w") as fh:
        json.dump({"mpirun": f"{flavour} (pip)", "results": results}, fh, indent=2)


if __name__ == "__main__":
    main()
