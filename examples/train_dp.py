"""A small data-parallel training run written against SageMaker's smdistributed.dataparallel API.

Run:  smshim run -n 2 examples/train_dp.py    (or: torchrun --nproc-per-node 2 ..., mpirun -n 2 python ...)

Each rank trains on its own shard of a fixed synthetic regression problem; gradients are averaged
by DistributedDataParallel, so every rank ends with the same parameters and the loss falls.
"""

import argparse
import logging
import time

import torch
import torch.nn as nn

import smdistributed.dataparallel.torch.distributed as dist
from smdistributed.dataparallel.torch.parallel.distributed import DistributedDataParallel as DDP

log = logging.getLogger("train_dp")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64, help="global batch")
    p.add_argument("--lr", type=float, default=0.05)
    args, _ = p.parse_known_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    teacher = nn.Linear(32, 4)
    x_all = torch.randn(args.steps * args.batch_size, 32)
    y_all = teacher(x_all).detach() + 0.01 * torch.randn(len(x_all), 4)

    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    local = args.batch_size // world
    first = last = None
    for step in range(args.steps):
        t0 = time.perf_counter()
        lo = step * args.batch_size + rank * local
        x, y = x_all[lo:lo + local], y_all[lo:lo + local]
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg, op=dist.ReduceOp.AVERAGE)
        first = avg.item() if first is None else first
        last = avg.item()
        if rank == 0:
            log.info("step %3d  loss %.4f  %.1f ms  %d samples/s", step, last,
                     1e3 * (time.perf_counter() - t0), args.batch_size / (time.perf_counter() - t0))
    if rank == 0:
        log.info("loss %.4f -> %.4f on %d ranks", first, last, world)
    assert last < first, "training did not lower the loss"


if __name__ == "__main__":
    main()
