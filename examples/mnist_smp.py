"""Handwritten digits with SageMaker model parallelism (smp v1): the classic SageMaker "MNIST with
smdistributed.modelparallel" training script, on scikit-learn's 8x8 digits (no download).

    smshim run --distribution '{"smdistributed": {"modelparallel": {"enabled": true, "parameters":
        {"partitions": 2, "microbatches": 4, "pipeline": "interleaved", "ddp": true}}},
        "mpi": {"enabled": true, "processes_per_host": 4}}' examples/mnist_smp.py

The configuration comes from SM_HP_MP_PARAMETERS (which `--distribution` sets, as a SageMaker
estimator does); run without it, the script uses the same values as defaults. Each data-parallel
replica trains on its shard (DistributedSampler by smp.dp_rank()); the CNN is split into two
pipeline stages by smp. At the end the test accuracy is printed and every pipeline stage of
replica 0 saves its part of the model with smp.save(..., partial=True).

Checkpoints: every --checkpoint-every steps and at the end of every epoch the job saves an smp
checkpoint under --checkpoint-dir (default: checkpoints/ beside the model directory); started
again (e.g. by `smshim run --max-restarts N` after a lost worker), it resumes from the newest
complete one, in the middle of an epoch if need be. (Dropout masks after a resume differ from an
uninterrupted run's: the random state is not checkpointed.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import StepLR

import smdistributed.modelparallel.torch as smp

from _common import DigitsCNN, load_digits_split, loaders, log

DEFAULT_MP_CONFIG = {"partitions": 2, "microbatches": 4, "pipeline": "interleaved", "ddp": True}


@smp.step
def train_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="mean")
    model.backward(loss)
    return output, loss


@smp.step
def test_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="sum").item()
    pred = output.argmax(dim=1)
    correct = pred.eq(target).sum().item()
    return loss, correct


def train(model, train_loader, optimizer, epoch: int, log_interval: int, skip: int = 0,
          after_step=None) -> float:
    """One epoch, from batch `skip` on (a resumed epoch); `after_step(batches_done)` after each."""
    model.train()
    total = 0.0
    for batch_idx, (data, target) in enumerate(train_loader):
        if batch_idx < skip:
            continue  # done before the checkpoint this run resumed from
        optimizer.zero_grad()
        _, loss_mb = train_step(model, data, target)
        loss = loss_mb.reduce_mean()  # mean over the microbatches of this replica's batch
        optimizer.step()
        total += loss.item()
        if smp.rank() == 0 and batch_idx % log_interval == 0:
            log(f"train epoch {epoch} [{batch_idx * len(data):4d}/{len(train_loader.sampler)}]  "
                f"loss {loss.item():.4f}")
        if after_step is not None:
            after_step(batch_idx + 1)
    return total / max(1, len(train_loader) - skip)


def save(ckpt_dir: str, model, optimizer, scheduler, epoch: int, batch: int, step: int) -> None:
    """A partial checkpoint: `batch` batches of `epoch` done (every rank takes part)."""
    tag = f"step{step}" if batch else f"epoch{epoch - 1}"  # batch 0: saved at an epoch's end
    smp.save_checkpoint(ckpt_dir, tag=tag, partial=True, model=model,
                        optimizer=optimizer, num_kept_partial_checkpoints=2,
                        user_content={"epoch": epoch, "batch": batch, "step": step,
                                      "scheduler": scheduler.state_dict()})


def resume(ckpt_dir: str, scheduler) -> tuple:
    """(epoch, batches of it done, global step) from the newest checkpoint, else (1, 0, 0)."""
    if not os.path.exists(os.path.join(ckpt_dir, "newest")):
        return 1, 0, 0
    # Model and optimizer state apply at partitioning (the first step).
    state = smp.resume_from_checkpoint(ckpt_dir)
    scheduler.load_state_dict(state["scheduler"])
    if smp.rank() == 0:
        log(f"resumed from {ckpt_dir} at epoch {state['epoch']}, batch {state['batch']} "
            f"(step {state['step']})")
    return state["epoch"], state["batch"], state["step"]


def test(model, test_loader) -> tuple:
    model.eval()
    loss = correct = seen = 0.0
    with torch.no_grad():
        for data, target in test_loader:
            loss_mb, correct_mb = test_step(model, data, target)  # per-microbatch lists
            loss += sum(loss_mb)
            correct += sum(correct_mb)
            seen += len(data)
    # Every replica tested its own shard: add them up.
    loss, correct, seen = map(sum, zip(*smp.allgather((loss, correct, seen), smp.DP_GROUP)))
    return loss / seen, correct / seen, int(seen)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32, help="per replica, per step")
    p.add_argument("--test-batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--gamma", type=float, default=0.8, help="StepLR decay per epoch")
    p.add_argument("--limit", type=int, default=None, help="use only this many images")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--model-dir", default=os.environ.get("SM_MODEL_DIR", "smshim_output/model"))
    p.add_argument("--checkpoint-dir", default=None,
                   help="where checkpoints go and are resumed from "
                        "(default: checkpoints/ beside --model-dir)")
    p.add_argument("--checkpoint-every", type=int, default=20,
                   help="also save a checkpoint every K steps (0: only at the end of each epoch)")
    args, _ = p.parse_known_args()  # SageMaker also passes --mp_parameters
    ckpt_dir = args.checkpoint_dir or os.path.join(
        os.path.dirname(os.path.abspath(args.model_dir)), "checkpoints")

    smp.init(DEFAULT_MP_CONFIG)  # SM_HP_MP_PARAMETERS, when set, wins
    torch.manual_seed(args.seed)

    data = load_digits_split(seed=args.seed, limit=args.limit)
    train_loader, test_loader = loaders(data, args.batch_size, args.test_batch_size,
                                        smp.dp_size(), smp.dp_rank(), seed=args.seed)
    model = smp.DistributedModel(DigitsCNN())
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=args.lr))
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    if smp.rank() == 0:
        log(f"smp: {smp.size()} processes = pp {smp.pp_size()} x dp {smp.dp_size()}, "
            f"{smp.num_microbatches()} microbatches, pipeline {smp.state.cfg.pipeline}; "
            f"{len(data['train'][0])} training / {len(data['test'][0])} test images")

    first_epoch, skip, step = resume(ckpt_dir, scheduler)
    t0 = time.perf_counter()
    accuracy = None
    for epoch in range(first_epoch, args.epochs + 1):
        train_sampler = train_loader.sampler
        train_sampler.set_epoch(epoch)  # the same order on a resumed run: skipping lines up

        def after_step(batches_done: int, epoch: int = epoch) -> None:
            nonlocal step
            step += 1
            if args.checkpoint_every > 0 and step % args.checkpoint_every == 0:
                save(ckpt_dir, model, optimizer, scheduler, epoch, batches_done, step)

        train_loss = train(model, train_loader, optimizer, epoch, args.log_interval, skip,
                           after_step)
        skip = 0
        test_loss, accuracy, seen = test(model, test_loader)
        scheduler.step()
        save(ckpt_dir, model, optimizer, scheduler, epoch + 1, 0, step)  # the epoch is done
        if smp.rank() == 0:
            log(f"epoch {epoch}: train loss {train_loss:.4f}  test loss {test_loss:.4f}  "
                f"test accuracy {100 * accuracy:.2f}% ({seen} images)  "
                f"{time.perf_counter() - t0:.1f} s")

    if accuracy is None:
        if smp.rank() == 0:
            log(f"training already complete: the checkpoint in {ckpt_dir} is after epoch "
                f"{first_epoch - 1} (pass a new --checkpoint-dir, or delete it, to train again)")
        return 0
    if smp.rank() == 0:
        log(f"test accuracy {100 * accuracy:.2f}%")
    # Each pipeline stage of replica 0 writes its own part: <path>_<pp_rank>_<tp_rank>.
    path = os.path.join(args.model_dir, "model.pt")
    if smp.dp_rank() == 0:
        os.makedirs(args.model_dir, exist_ok=True)
        smp.save({"model_state_dict": model.local_state_dict(),
                  "optimizer_state_dict": optimizer.local_state_dict()}, path, partial=True)
    smp.barrier()
    if smp.dp_rank() == 0:
        saved = smp.load(path, partial=True)["model_state_dict"]
        local = model.local_state_dict()
        same = saved.keys() == local.keys() and all(
            torch.equal(saved[k], local[k]) for k in local if isinstance(local[k], torch.Tensor))
        if not same:
            raise SystemExit(f"rank {smp.rank()}: the checkpoint read back from {path} differs from "
                             "the model")
        log(f"pp rank {smp.pp_rank()}: saved and re-read {path}_{smp.pp_rank()}_{smp.tp_rank()} "
            f"({sum(isinstance(v, torch.Tensor) for v in saved.values())} tensors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
