"""Handwritten digits with SageMaker distributed data parallelism, written against the legacy
`smdistributed.dataparallel.torch` API (its own `distributed` module and DistributedDataParallel),
on scikit-learn's 8x8 digits (no download).

    smshim run -n 2 --distribution '{"smdistributed": {"dataparallel": {"enabled": true}}}' \\
        examples/mnist_smddp.py

Each rank trains on its shard (DistributedSampler by rank); DistributedDataParallel averages the
gradients. Rank 0 tests the model on the whole test set after every epoch and saves it to
SM_MODEL_DIR (or --model-dir) at the end.

Checkpoints: after every epoch rank 0 writes model, optimizer and scheduler state to
--checkpoint-dir (default: checkpoints/ beside the model directory) atomically (temporary file,
then rename); started again (e.g. by `smshim run --max-restarts N` after a lost worker), every rank
loads it and training continues with the next epoch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import StepLR

import smdistributed.dataparallel.torch.distributed as dist
from smdistributed.dataparallel.torch.parallel.distributed import DistributedDataParallel as DDP

from _common import DigitsCNN, load_digits_split, loaders, log


def train(model, train_loader, optimizer, epoch: int, rank: int, log_interval: int) -> float:
    model.train()
    total = 0.0
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        total += loss.item()
        if rank == 0 and batch_idx % log_interval == 0:
            log(f"train epoch {epoch} [{batch_idx * len(data):4d}/{len(train_loader.sampler)}]  "
                f"loss {loss.item():.4f}")
    return total / max(1, len(train_loader))


def test(model, x: torch.Tensor, y: torch.Tensor) -> tuple:
    model.eval()
    with torch.no_grad():
        output = model(x)
        loss = F.nll_loss(output, y, reduction="sum").item()
        correct = output.argmax(dim=1).eq(y).sum().item()
    return loss / len(x), correct / len(x)


def save_checkpoint(path: str, model, optimizer, scheduler, epoch: int) -> None:
    """Rank 0: the state after `epoch` epochs, written so a reader sees the old file or the new."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    torch.save({"epoch": epoch, "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp)
    os.replace(tmp, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32, help="per rank, per step")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--gamma", type=float, default=0.8, help="StepLR decay per epoch")
    p.add_argument("--limit", type=int, default=None, help="use only this many images")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--model-dir", default=os.environ.get("SM_MODEL_DIR", "smshim_output/model"))
    p.add_argument("--checkpoint-dir", default=None,
                   help="where the per-epoch checkpoint goes and is resumed from "
                        "(default: checkpoints/ beside --model-dir)")
    args, _ = p.parse_known_args()
    ckpt = os.path.join(args.checkpoint_dir or os.path.join(
        os.path.dirname(os.path.abspath(args.model_dir)), "checkpoints"), "checkpoint.pt")

    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    data = load_digits_split(seed=args.seed, limit=args.limit)
    train_loader, _ = loaders(data, args.batch_size, args.batch_size, world, rank, seed=args.seed)
    net = DigitsCNN()
    state = torch.load(ckpt, weights_only=True) if os.path.exists(ckpt) else None
    if state is not None:
        net.load_state_dict(state["model"])
    model = DDP(net)  # rank 0's weights are broadcast to every rank
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    first_epoch = 1
    if state is not None:  # every rank restores its optimizer (Adam state) and schedule
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        first_epoch = state["epoch"] + 1
        if rank == 0:
            log(f"resumed from {ckpt} after epoch {state['epoch']}")
    if rank == 0:
        log(f"smddp: {world} processes (local rank {dist.get_local_rank()}); "
            f"{len(data['train'][0])} training / {len(data['test'][0])} test images")

    t0 = time.perf_counter()
    for epoch in range(first_epoch, args.epochs + 1):
        train_loader.sampler.set_epoch(epoch)
        train_loss = train(model, train_loader, optimizer, epoch, rank, args.log_interval)
        # Report the training loss averaged over the ranks.
        avg = torch.tensor([train_loss])
        dist.all_reduce(avg, op=dist.ReduceOp.AVERAGE)
        scheduler.step()
        if rank == 0:
            test_loss, accuracy = test(model, *data["test"])
            log(f"epoch {epoch}: train loss {avg.item():.4f}  test loss {test_loss:.4f}  "
                f"test accuracy {100 * accuracy:.2f}% ({len(data['test'][0])} images)  "
                f"{time.perf_counter() - t0:.1f} s")
            save_checkpoint(ckpt, model, optimizer, scheduler, epoch)
        dist.barrier()  # nobody runs ahead of a checkpoint that may be needed to resume

    if rank == 0:
        accuracy = test(model, *data["test"])[1]
        log(f"test accuracy {100 * accuracy:.2f}%")
        os.makedirs(args.model_dir, exist_ok=True)
        path = os.path.join(args.model_dir, "model.pt")
        torch.save(model.module.state_dict(), path)
        log(f"saved {path}")
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
