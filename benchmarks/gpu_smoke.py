"""GPU smoke test: pipeline, tensor-parallel and data-parallel equivalence with CUDA compute, and
the cost of a pipeline hop next to torch.distributed.pipelining's. One command:

    python benchmarks/gpu_smoke.py [--steps 3] [--hop-steps 20] [--m 4]

Two processes. With >= 2 GPUs each has its own and the job runs on NCCL: pipeline activations and
gradients travel on the transport's device channel (NCCL point-to-point, never through host
memory), the TP and DP collectives on NCCL groups. With one GPU both processes share it; NCCL
refuses two ranks on one device, so the pipeline's tensors take the host path (gloo frames), and
the TP and DP checks, which need NCCL collectives between the two ranks, are skipped (said so).

Checks (each against single-process training of the same model on the same global batch, on the
CPU in this process; TF32 off on the GPU; max abs difference of parameters and losses < 1e-4):
- pipeline: 8 residual MLP blocks in a ModuleList loop, pp = 2, m microbatches, `interleaved`;
  also that CUDA tensors took the device channel (>= 2 GPUs) or the host path (one GPU);
- tensor parallel: tp = 2, two `smp.nn.DistributedLinear` layers, 2 microbatches (each its own
  TP group: NCCL on >= 2 GPUs);
- data parallel: smp `ddp: true`, pp = 1, dp = 2 (the gradient reducer on the NCCL DP group).

Hop cost: two stages of one Linear(d, d) each (the loss on the second), m microbatches: a step
moves each microbatch's activation 0 -> 1 and its gradient 1 -> 0 (2m hops); printed: the step
time / 2m ("per hop", compute included, the same for both systems), and activation bytes moved
per second, for smshim and torch.distributed.pipelining's Schedule1F1B (>= 2 GPUs; on one GPU
torch's stages, which need NCCL between the ranks, cannot run), steps alternated, medians.

`--cpu` runs all of it on the CPU over gloo, the device channel played by its gloo stand-in
(SMSHIM_DEVICE_CHANNEL=gloo-test): it checks this script on a machine without a GPU.

Exit code: 0 when every check ran passed, or when there is no GPU (nothing is checked; the
message says so); 1 when a check failed.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Any, Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from pipeline_as_written import BLOCKS, make_batches, make_model  # noqa: E402
from smshim.testing import run_ranks  # noqa: E402

TOL = 1e-4
D, BATCH, LR = 256, 32, 0.05


# --cpu: the same checks on the CPU over gloo, the pipeline's device channel played by its gloo
# stand-in (SMSHIM_DEVICE_CHANNEL=gloo-test): checks this script itself without a GPU.
CPU_ENV = "GPU_SMOKE_ON_CPU"


def _on_cpu() -> bool:
    return os.environ.get(CPU_ENV) == "1"


def _device() -> torch.device:
    return torch.device("cpu") if _on_cpu() else torch.device("cuda", torch.cuda.current_device())


def _sync() -> None:
    if not _on_cpu():
        torch.cuda.synchronize()


def _cuda_setup() -> None:
    # fp32 on both sides of each comparison (TF32 rounds matmul inputs to 10 bits).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _cpu(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {n: t.detach().float().cpu() for n, t in tensors.items()}


def _max_diff(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> float:
    missing = set(want) ^ set(got)
    if missing:
        raise AssertionError(f"parameters differ in name: {sorted(missing)[:5]}")
    return max((got[n] - want[n]).abs().max().item() for n in want)


# ---- pipeline ---------------------------------------------------------------------------------

def _pp_rank(m: int, steps: int) -> Dict[str, Any]:
    import smdistributed.modelparallel.torch as smp

    _cuda_setup()
    smp.init({"pipeline_parallel_degree": 2, "microbatches": m, "pipeline": "interleaved",
              "auto_partition": False, "default_partition": 0})
    module = make_model(D)
    model = smp.DistributedModel(module)
    for i, block in enumerate(module.blocks):
        smp.set_partition(block, i // (BLOCKS // 2))
    smp.set_partition(module.head, 1)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))

    @smp.step
    def train_step(model, x, y):
        loss = model(x, y)
        model.backward(loss)
        return loss

    device = _device()
    losses = []
    for x, y in make_batches(steps, D, BATCH):
        opt.zero_grad()
        losses.append(float(train_step(model, x.to(device), y.to(device)).reduce_mean()))
        opt.step()
    transport = model._pipeline.transport
    return {"params": _cpu(dict(model.local_named_parameters())), "losses": losses,
            "apart": sum(transport.sent_apart.values()), "device": str(device)}


def _pp_reference(m: int, steps: int):
    model = make_model(D)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in make_batches(steps, D, BATCH):
        opt.zero_grad()
        step_loss = 0.0
        for xs, ys in zip(x.chunk(m), y.chunk(m)):
            loss = model(xs, ys)
            (loss / m).backward()  # smp averages the microbatches' gradients
            step_loss += float(loss.detach()) / m
        opt.step()
        losses.append(step_loss)
    return _cpu(dict(model.named_parameters())), losses


def check_pipeline(m: int, steps: int, gpus: int, path_ok) -> str:
    results = run_ranks(_pp_rank, 2, m, steps, timeout=600)
    want, want_losses = _pp_reference(m, steps)
    got: Dict[str, torch.Tensor] = {}
    for r in results:
        got.update(r["params"])
    diff = _max_diff(got, want)
    loss_diff = max(abs(a - b) for a, b in zip(results[0]["losses"], want_losses))
    if diff >= TOL or loss_diff >= TOL:
        raise AssertionError(f"pipeline differs from one process: params {diff:.2e}, "
                             f"losses {loss_diff:.2e}")
    apart = [r["apart"] for r in results]
    path = ("device channel" if all(apart) else "host path (gloo frames)")
    if not path_ok(apart):
        raise AssertionError(f"pipeline tensors took the wrong path: {path}, sent apart {apart}")
    return (f"params max diff {diff:.1e}, losses {loss_diff:.1e}; devices "
            f"{[r['device'] for r in results]}; tensors via the {path}, sent apart {apart}")


# ---- tensor parallel --------------------------------------------------------------------------

class _TPNet(nn.Module):
    def __init__(self, dist: bool) -> None:
        super().__init__()
        import smdistributed.modelparallel.torch as smp

        lin = smp.nn.DistributedLinear if dist else nn.Linear
        torch.manual_seed(0)
        self.fc1, self.fc2 = lin(D, 4 * D), lin(4 * D, D)
        self.head = nn.Linear(D, 16)

    def forward(self, x, y):
        return F.cross_entropy(self.head(x + self.fc2(F.gelu(self.fc1(x)))), y)


def _tp_rank(steps: int) -> Dict[str, Any]:
    import smdistributed.modelparallel.torch as smp

    _cuda_setup()
    smp.init({"tensor_parallel_degree": 2, "microbatches": 2})
    module = _TPNet(dist=True)
    module.load_state_dict(_TPNet(dist=False).state_dict())  # each rank keeps its shard
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))

    @smp.step
    def train_step(model, x, y):
        loss = model(x, y)
        model.backward(loss)
        return loss

    from smshim.modelparallel.torch.tensor_parallel import collectives

    device = _device()
    k = BATCH // smp.dp_size()  # the TP ranks are the DP group's ranks: each has its batch
    r = smp.dp_rank()
    for x, y in make_batches(steps, D, BATCH):
        opt.zero_grad()
        train_step(model, x[r * k:(r + 1) * k].to(device), y[r * k:(r + 1) * k].to(device))
        opt.step()
    full = model.state_dict() if smp.rdp_rank() == 0 else None
    return {"full": None if full is None else _cpu(full),
            "backend": collectives.group_backend()}


def check_tensor_parallel(steps: int) -> str:
    results = run_ranks(_tp_rank, 2, steps, timeout=600)
    model = _TPNet(dist=False)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in make_batches(steps, D, BATCH):
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    want = _cpu(model.state_dict())
    diffs = [_max_diff(r["full"], want) for r in results if r["full"] is not None]
    if not diffs or max(diffs) >= TOL:
        raise AssertionError(f"tensor parallel differs from one process: {diffs}")
    return f"state dict max diff {max(diffs):.1e}; microbatch groups on {results[0]['backend']}"


# ---- data parallel ----------------------------------------------------------------------------

def _dp_rank(steps: int) -> Dict[str, Any]:
    import smdistributed.modelparallel.torch as smp

    _cuda_setup()
    smp.init({"pipeline_parallel_degree": 1, "ddp": True})
    model = smp.DistributedModel(make_model(D))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))

    @smp.step
    def train_step(model, x, y):
        loss = model(x, y)
        model.backward(loss)
        return loss

    device = _device()
    k, r = BATCH // smp.dp_size(), smp.dp_rank()
    for x, y in make_batches(steps, D, BATCH):
        opt.zero_grad()
        train_step(model, x[r * k:(r + 1) * k].to(device), y[r * k:(r + 1) * k].to(device))
        opt.step()
    import torch.distributed as dist

    return {"params": _cpu(dict(model.local_named_parameters())),
            "backend": dist.get_backend(smp.get_dp_process_group())}


def check_data_parallel(steps: int) -> str:
    results = run_ranks(_dp_rank, 2, steps, timeout=600)
    model = make_model(D)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in make_batches(steps, D, BATCH):
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    want = _cpu(dict(model.named_parameters()))
    diffs = [_max_diff(r["params"], want) for r in results]
    if max(diffs) >= TOL:
        raise AssertionError(f"data parallel differs from one process: {diffs}")
    return f"params max diff {max(diffs):.1e}; DP group on {results[0]['backend']}"


# ---- the cost of a hop ------------------------------------------------------------------------

class _Hop(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, y):
        return F.mse_loss(self.b(self.a(x)), y)


def _hop_rank(d: int, batch: int, m: int, steps: int, with_torch: bool) -> Dict[str, Any]:
    import torch.distributed as dist

    import smdistributed.modelparallel.torch as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": m, "pipeline": "interleaved",
              "auto_partition": False, "default_partition": 0})
    device = _device()
    rank = smp.pp_rank()
    module = _Hop(d)
    model = smp.DistributedModel(module)
    smp.set_partition(module.b, 1)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))

    @smp.step
    def train_step(model, x, y):
        loss = model(x, y)
        model.backward(loss)
        return loss

    def ours(x, y):
        train_step(model, x, y)
        opt.step()
        opt.zero_grad()

    theirs = None
    if with_torch:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        twin = _Hop(d).to(device)
        stage_mod = twin.a if rank == 0 else twin.b
        stage = PipelineStage(stage_mod, rank, 2, device)
        sched = Schedule1F1B(stage, n_microbatches=m, loss_fn=F.mse_loss)
        topt = torch.optim.SGD(stage_mod.parameters(), lr=1e-3)

        def theirs(x, y):
            if rank == 0:
                sched.step(x)
            else:
                sched.step(target=y)
            topt.step()
            topt.zero_grad()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, d, generator=g).to(device)
    y = torch.randn(batch, d, generator=g).to(device)
    times: Dict[str, List[float]] = {"smshim": [], "torch": []}
    for i in range(steps + 3):  # 3 warm-up steps (shapes learnt, communicators made)
        for name, fn in (("smshim", ours), ("torch", theirs)):
            if fn is None:
                continue
            dist.barrier(group=smp.state.object_group)
            _sync()
            t0 = time.perf_counter()
            fn(x, y)
            _sync()
            if i >= 3:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items() if v}


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:7.1f} {unit}"
        n /= 1000
    return ""


def hop_costs(m: int, steps: int, gpus: int) -> List[str]:
    lines = []
    for d, batch in ((16, 8 * m), (256, 32 * m) if _on_cpu() else (4096, 256 * m)):
        got = run_ranks(_hop_rank, 2, d, batch, m, steps, gpus >= 2 or _on_cpu(), timeout=900)
        hop_bytes = (batch // m) * d * 4
        parts = [f"d={d:5d}, {_size(hop_bytes)} per hop:"]
        for name in ("smshim", "torch"):
            t = max(r.get(name, math.nan) for r in got)  # the slower rank's step
            if math.isnan(t):
                parts.append(f"{name}: n/a (needs NCCL between two GPUs)")
                continue
            hops = 2 * m
            parts.append(f"{name}: {t / hops * 1e3:8.3f} ms/hop, "
                         f"{_size(hop_bytes * hops / t)}/s")
        lines.append("  ".join(parts))
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="training steps per equivalence check")
    ap.add_argument("--hop-steps", type=int, default=20, help="measured steps per hop size")
    ap.add_argument("--m", type=int, default=4, help="microbatches")
    ap.add_argument("--cpu", action="store_true",
                    help="run the checks on the CPU over gloo (tests this script without a GPU)")
    args = ap.parse_args()
    if args.cpu:
        os.environ[CPU_ENV] = "1"
        os.environ["SMSHIM_DEVICE_CHANNEL"] = "gloo-test"
        print("gpu_smoke --cpu: the checks on the CPU over gloo, the device channel's gloo "
              "stand-in carrying the pipeline's tensors")
        return _run(args, gpus=2, pipeline_path_ok=all)
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        print("gpu_smoke: no CUDA device on this machine; nothing checked (exit code 0). "
              "The CPU paths are covered by the test suite; run this on a GPU host.")
        return 0
    gpus = torch.cuda.device_count()
    path = ("two GPUs, NCCL: pipeline tensors on the device channel" if gpus >= 2 else
            "ONE GPU shared by two processes: NCCL refuses two ranks on one device, so pipeline "
            "tensors take the host path (gloo), and the TP and DP checks are skipped")
    print(f"gpu_smoke: {gpus} GPU(s) ({torch.cuda.get_device_name(0)}); {path}")
    if gpus >= 2:
        return _run(args, gpus, pipeline_path_ok=all)
    return _run(args, gpus, pipeline_path_ok=lambda apart: not any(apart))


def _run(args, gpus: int, pipeline_path_ok) -> int:
    checks = [("pipeline pp=2", lambda: check_pipeline(args.m, args.steps, gpus, pipeline_path_ok))]
    if gpus >= 2:
        checks += [("tensor parallel tp=2", lambda: check_tensor_parallel(args.steps)),
                   ("data parallel dp=2", lambda: check_data_parallel(args.steps))]
    failed = 0
    for name, check in checks:
        try:
            print(f"PASS {name}: {check()}")
        except Exception as e:  # noqa: BLE001  (report every check)
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}")
    if gpus < 2:
        print("SKIP tensor parallel, data parallel: need one GPU per rank (NCCL)")
    print(f"per-hop cost, pp=2, m={args.m} (step time / 2m hops, median of {args.hop_steps} "
          "steps, the slower rank):")
    try:
        for line in hop_costs(args.m, args.hop_steps, gpus):
            print("  " + line)
    except Exception as e:  # noqa: BLE001
        failed += 1
        print(f"FAIL hop cost: {type(e).__name__}: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
