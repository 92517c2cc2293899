"""smshim's DistributedDataParallel against torch's; its bucketed reduction against raw allreduce.

    python benchmarks/dp_vs_torch_ddp.py [--steps 60] [--nprocs 2]

Two gloo processes (one thread each) on this machine. Part 1 wraps the same model once in our DDP
and once in torch DDP (both with default settings), alternates timed forward+backward steps of
the two inside one process group (a barrier before each, outside the timing) and reports the
median of the per-pair wall-time ratios ours/torch, plus the training thread's CPU time per step
(each DDP's own cost, which other load on a shared machine disturbs much less than wall time). Models: an MLP of 8 x Linear(1024, 1024) (32 MiB of
gradients) and a stack of 150 x Linear(48, 48) (300 small gradient tensors).

Part 2 reduces a fixed gradient set (the MLP's 16 tensors, 32 MiB) with our reducer
(`GradReducer.finalize()`: pre-divide, async bucket allreduces in order, wait) as DDP runs it
(gradients already live in the buckets) and in copy mode (copy in, reduce, copy back), against one
raw allreduce of a flat buffer of the same bytes (the bandwidth limit; a sum, so also shown with
the division an average needs) and one allreduce per tensor.
Bus bandwidth = 2 (n - 1) / n * bytes / time (the ring allreduce convention).

Prints a table and writes benchmarks/results/dp_vs_torch_ddp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

RESULTS = os.path.join(HERE, "results", "dp_vs_torch_ddp.json")


def _mlp(torch):
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1]), (64, 1024), 1024


def _many_small(torch):
    torch.manual_seed(0)
    layers = []
    for _ in range(150):
        layers += [torch.nn.Linear(48, 48), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1]), (64, 48), 48


def _time_step(torch, dist, model, params, x, y) -> Tuple[float, float]:
    """(wall seconds, this thread's CPU seconds) of one forward + backward."""
    for p in params:
        p.grad = None
    dist.barrier()  # both ranks start together; not timed
    t0, c0 = time.perf_counter(), time.thread_time()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()  # returns once gradients are averaged (both DDPs finalize inside backward)
    return time.perf_counter() - t0, time.thread_time() - c0


def _compare_ddp(torch, dist, build: Callable, steps: int, warmup: int) -> Dict[str, Any]:
    from smshim.dataparallel.torch.parallel import DistributedDataParallel as OurDDP

    net_a, in_shape, out_dim = build(torch)
    net_b, _, _ = build(torch)
    ours = OurDDP(net_a)
    theirs = torch.nn.parallel.DistributedDataParallel(net_b)
    pa, pb = list(net_a.parameters()), list(net_b.parameters())
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(*in_shape, generator=g)
    y = torch.randn(in_shape[0], out_dim, generator=g)
    for _ in range(warmup):
        _time_step(torch, dist, ours, pa, x, y)
        _time_step(torch, dist, theirs, pb, x, y)
    t_ours, t_torch = [], []
    for i in range(steps):
        # Alternate which goes first so drift (caches, clocks) does not favour one side.
        if i % 2 == 0:
            t_ours.append(_time_step(torch, dist, ours, pa, x, y))
            t_torch.append(_time_step(torch, dist, theirs, pb, x, y))
        else:
            t_torch.append(_time_step(torch, dist, theirs, pb, x, y))
            t_ours.append(_time_step(torch, dist, ours, pa, x, y))
    same = max((a.grad - b.grad).abs().max().item() for a, b in zip(pa, pb))
    ratios = [a[0] / b[0] for a, b in zip(t_ours, t_torch)]
    return {
        "tensors": len(pa),
        "grad_mib": sum(p.numel() * p.element_size() for p in pa) / 2**20,
        "buckets_ours": len(ours.reducer.buckets),
        "ours_ms": 1e3 * statistics.median(t[0] for t in t_ours),
        "torch_ms": 1e3 * statistics.median(t[0] for t in t_torch),
        # CPU time of the training thread: what each DDP itself costs, less sensitive to other
        # load on the machine than wall time (communication threads not included).
        "ours_cpu_ms": 1e3 * statistics.median(t[1] for t in t_ours),
        "torch_cpu_ms": 1e3 * statistics.median(t[1] for t in t_torch),
        "ratio_median": statistics.median(ratios),
        "ratio_quartiles": [statistics.quantiles(ratios, n=4)[i] for i in (0, 2)],
        "grad_max_abs_diff_vs_torch": same,
        "steps": steps,
    }


def _reduction(torch, dist, steps: int, warmup: int) -> Dict[str, Any]:
    from smshim.reducer.grad_reducer import GradReducer

    net, _, _ = _mlp(torch)
    params = list(net.parameters())
    n = dist.get_world_size()
    grads = [torch.randn_like(p) for p in params]
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    # Default 25 MiB buckets, 1 MiB first bucket. As DDP runs it, the gradients live in the buckets
    # (gradient_as_bucket_view): after a backward, only the division and the allreduces remain.
    reducer = GradReducer(params, None, gradient_as_bucket_view=True)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    reducer.finalize()  # from now on p.grad are bucket views
    # Copy mode: gradients are separate tensors, copied into the buckets and back every time.
    net2, _, _ = _mlp(torch)
    params2 = list(net2.parameters())
    copying = GradReducer(params2, None)
    flat = torch.randn(sum(g.numel() for g in grads))

    def ours():
        reducer.finalize()

    def ours_copying():
        for p, g in zip(params2, grads):
            p.grad = g
        copying.finalize()

    def flat_and_divide():
        dist.all_reduce(flat)
        flat.mul_(1.0 / n)

    def raw_flat():
        dist.all_reduce(flat)

    def per_tensor():
        for g in loose:
            dist.all_reduce(g)

    def rescale(tensors):
        # The sum-only cases grow the data n-fold per run: scale back (untimed) to stay finite.
        return lambda: torch._foreach_mul_(tensors, 1.0 / n)

    loose = [g.clone() for g in grads]
    no_reset = lambda: None  # noqa: E731
    cases = {"ours: GradReducer, grads as bucket views (as DDP)": (ours, no_reset),
             "ours: GradReducer, grads copied in and out": (ours_copying, no_reset),
             "one flat allreduce (sum only)": (raw_flat, rescale([flat])),
             "one flat allreduce + divide (average)": (flat_and_divide, no_reset),
             "allreduce per tensor (sum only)": (per_tensor, rescale(loose))}
    times: Dict[str, List[float]] = {k: [] for k in cases}
    for i in range(warmup + steps):
        for name, (fn, reset) in cases.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            reset()
            if i >= warmup:
                times[name].append(dt)
    out = {"bytes": nbytes, "tensors": len(grads), "buckets": len(reducer.buckets), "cases": {}}
    for name, ts in times.items():
        t = statistics.median(ts)
        out["cases"][name] = {"ms": 1e3 * t, "busbw_gbs": 2 * (n - 1) / n * nbytes / t / 1e9}
    flat_bw = out["cases"]["one flat allreduce (sum only)"]["busbw_gbs"]
    for case in out["cases"].values():
        case["of_flat_bw"] = case["busbw_gbs"] / flat_bw
    return out


def _rank_main(steps: int, warmup: int) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist

    from smshim.runtime import launch as _runtime

    _runtime.init_distributed()
    torch.set_num_threads(1)
    res = {
        "mlp": _compare_ddp(torch, dist, _mlp, steps, warmup),
        "many_small": _compare_ddp(torch, dist, _many_small, steps, warmup),
        "reduction": _reduction(torch, dist, steps, warmup),
    }
    return res


def _table(res: Dict[str, Any], nprocs: int) -> str:
    lines = [f"## DDP step (forward + backward), {nprocs} gloo processes, median of "
             f"{res['mlp']['steps']} alternated steps",
             "",
             "| model | grad tensors | grad MiB | ours ms | torch DDP ms "
             "| ours/torch (median of ratios) | ratio quartiles | main-thread CPU ms ours / torch |",
             "|---|---|---|---|---|---|---|---|"]
    for key, label in (("mlp", "MLP 8 x Linear(1024,1024)"), ("many_small", "150 x Linear(48,48)")):
        r = res[key]
        lines.append(f"| {label} | {r['tensors']} | {r['grad_mib']:.1f} | {r['ours_ms']:.2f} | "
                     f"{r['torch_ms']:.2f} | {r['ratio_median']:.3f} | "
                     f"{r['ratio_quartiles'][0]:.3f} - {r['ratio_quartiles'][1]:.3f} | "
                     f"{r['ours_cpu_ms']:.1f} / {r['torch_cpu_ms']:.1f} |")
    red = res["reduction"]
    lines += ["", f"## Reducing {red['bytes'] / 2**20:.0f} MiB in {red['tensors']} tensors "
              f"(our reducer: {red['buckets']} buckets)", "",
              "| method | ms | bus bandwidth GB/s | of flat-buffer bandwidth |",
              "|---|---|---|---|"]
    for name, c in red["cases"].items():
        lines.append(f"| {name} | {c['ms']:.2f} | {c['busbw_gbs']:.2f} "
                     f"| {100 * c['of_flat_bw']:.0f}% |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--nprocs", type=int, default=2)
    args = ap.parse_args()

    from smshim.testing import run_ranks

    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    results = run_ranks(_rank_main, args.nprocs, args.steps, args.warmup, timeout=280)
    res = results[0]  # the collectives keep ranks in step; rank 0's clock speaks for the job
    res["wall_s"] = time.perf_counter() - t0
    res["nprocs"] = args.nprocs
    # Other work on the machine shows up as noise; the pairing cancels slow drift, not bursts.
    res["load_average_1min"] = {"before": load_before, "after": os.getloadavg()[0]}
    res["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                      "torch": __import__("torch").__version__}
    table = _table(res, args.nprocs)
    print(table)
    print(f"\n(wall time {res['wall_s']:.0f} s; 1-min load average {load_before:.1f} before, "
          f"{res['load_average_1min']['after']:.1f} after, on {os.cpu_count()} CPUs)")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
