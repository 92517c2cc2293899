"""A training script written for GPUs the way AWS's examples are (torch.cuda.set_device,
.cuda(), .to("cuda"), .to(torch.device("cuda", i)), DDP(device_ids=[local_rank]),
torch.load(map_location="cuda:0"), tensors created with device=...), used by the CPU-mode and
multi-node tests.

--mode ddp: torch DDP, each rank on its shard of the global batch. --mode smp: smdistributed
model parallelism, config from SM_HP_MP_PARAMETERS. Writes each rank's parameters to
$OUT_DIR/params_rank<R>.pt. KILL_AT_STEP=k (with KILL_RANK): that rank SIGKILLs itself after
step k in the first attempt (TORCHELASTIC_RESTART_COUNT 0).
"""
import argparse
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from tests.usage_helpers.models import batches, make_model, shard  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["ddp", "smp"], required=True)
p.add_argument("--steps", type=int, default=3)
args, _ = p.parse_known_args()  # SageMaker adds --mp_parameters
out_dir = os.environ["OUT_DIR"]


def maybe_die(step: int, rank: int) -> None:
    if (os.environ.get("KILL_AT_STEP") == str(step) and os.environ.get("KILL_RANK") == str(rank)
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
        os.kill(os.getpid(), signal.SIGKILL)


if args.mode == "ddp":
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    model = make_model().cuda()
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = torch.zeros((), device=device)  # created on "the GPU", as scripts keep their counters
    for step, (x, y) in enumerate(batches(args.steps, 8)):
        x = shard(x, rank, world).to("cuda")
        y = shard(y, rank, world).cuda()
        x = x[torch.arange(x.shape[0], device=f"cuda:{local_rank}")]  # (the same rows)
        opt.zero_grad()
        model(x, labels=y)["loss"].backward()
        opt.step()
        seen += x.new_ones((), device=device)
        maybe_die(step, rank)
    assert seen.item() == args.steps
    params = {n: p.detach() for n, p in model.module.named_parameters()}
    dp_rank = rank
else:
    import smdistributed.modelparallel.torch as smp

    smp.init()
    torch.cuda.set_device(smp.local_rank())
    device = torch.device("cuda", smp.local_rank())
    model = make_model()
    model.to(device)
    model = smp.DistributedModel(model)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train_step(model, x, y):
        loss = model(x, labels=y)["loss"]
        model.backward(loss)
        return loss

    for step, (x, y) in enumerate(batches(args.steps, 8)):
        x = shard(x, smp.dp_rank(), smp.dp_size()).to(torch.device("cuda", smp.local_rank()))
        y = shard(y, smp.dp_rank(), smp.dp_size()).to("cuda")
        opt.zero_grad()
        train_step(model, x, y)
        opt.step()
        maybe_die(step, smp.rank())
    params = {n: p.detach() for n, p in model.local_named_parameters()}
    rank, dp_rank = smp.rank(), smp.dp_rank()

path = os.path.join(out_dir, f"params_rank{rank}.pt")
torch.save({"params": params, "dp_rank": dp_rank, "cuda": torch.cuda.is_available(),
            "attempt": os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
            "framework_params": os.environ.get("SM_FRAMEWORK_PARAMS")}, path)
back = torch.load(path, map_location="cuda:0")  # a GPU script's reload, unchanged
assert all(t.device.type == "cpu" for t in back["params"].values())
print(f"rank {rank} done", flush=True)
