"""Train a small GPT-style byte-level language model with SageMaker model parallelism (smp v1):
a 2-stage pipeline, replicated twice for data parallelism (pp=2 x dp=2, 4 processes).

    smshim run -n 4 examples/gpt_pipeline.py
    smshim run --distribution '{"smdistributed": {"modelparallel": {"enabled": true, "parameters":
        {"partitions": 2, "microbatches": 4, "ddp": true, "pipeline": "interleaved"}}},
        "mpi": {"enabled": true, "processes_per_host": 4}}' examples/gpt_pipeline.py

The model is an ordinary nn.Module (token embedding + learned positions, pre-LN transformer blocks
in a ModuleList, final LayerNorm, LM head tied to the embedding); smp splits it between the two
pipeline ranks by itself. The corpus is the Python standard library's own source, read at run
time, split into one contiguous shard per data-parallel replica.

Checkpoints: every --checkpoint-every steps (default 10) the job saves an smp checkpoint under
--checkpoint-dir (default: <output dir>/checkpoints); started again, it resumes from the newest
complete one, so `smshim run --max-restarts N` continues a job that lost a worker where it left off.
Batches and the learning rate are functions of the step number, so a resumed job trains exactly
like an uninterrupted one.

Rank 0 reports loss, step time, samples/s and tokens/s per step. At the end the output directory
(--out-dir, else SM_MODEL_DIR's parent, else ./smshim_output/) gets loss_curve.png and, with
--timeline (default), timeline.png: the pipeline's forward/backward spans on every rank for one
step. The script exits non-zero if the loss did not fall.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import smdistributed.modelparallel.torch as smp

from _common import Progress, human, log, output_dir, plot_curve, plot_timeline

# Used when SM_HP_MP_PARAMETERS is not set (keys it sets override these).
DEFAULT_MP_CONFIG = {"partitions": 2, "microbatches": 4, "ddp": True, "pipeline": "interleaved"}


# ---- the model ---------------------------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, context: int, d: int, heads: int, layers: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(context, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied: smp keeps both modules on one rank
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# ---- data --------------------------------------------------------------------------------------

def stdlib_corpus(max_bytes: int) -> torch.Tensor:
    """Bytes of the standard library's top-level *.py files, in name order, up to max_bytes."""
    root = os.path.dirname(os.__file__)
    chunks, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data[:max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total == 0:
        raise SystemExit(f"no *.py files found in {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


def sample_batch(data: torch.Tensor, batch: int, context: int, seed: int) -> tuple:
    """`batch` random windows of the corpus: inputs and the same shifted by one (next bytes).
    Drawn from a generator seeded per step (not one running generator), so that a job resumed
    from a checkpoint sees the same batches as one that never stopped."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - context - 1, (batch,), generator=g)
    offsets = torch.arange(context + 1)
    windows = data[starts[:, None] + offsets]
    return windows[:, :-1], windows[:, 1:]


# ---- training ----------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per replica per step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--corpus-kb", type=int, default=400, help="KB of stdlib source to train on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=None,
                   help="output directory (default: SM_MODEL_DIR's parent, else ./smshim_output)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="where checkpoints go and are resumed from (default: <out dir>/checkpoints)")
    p.add_argument("--checkpoint-every", type=int, default=10,
                   help="save a checkpoint every K steps (0: never)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each transformer block's activations in backward "
                        "(smp.set_activation_checkpointing)")
    p.add_argument("--timeline", action=argparse.BooleanOptionalAction, default=True,
                   help="trace the pipeline and draw one step's timeline (default on)")
    # SageMaker passes the hyperparameters, including mp_parameters, as arguments too.
    args, _ = p.parse_known_args()
    if args.steps < 2:
        p.error("--steps must be at least 2 (the loss has to be seen falling)")
    return args


def build(args: argparse.Namespace) -> tuple:
    torch.manual_seed(args.seed)  # same initial weights on every rank
    gpt = GPT(256, args.context, args.d_model, args.heads, args.layers)
    if args.activation_checkpointing:
        for block in gpt.blocks:
            smp.set_activation_checkpointing(block)
    model = smp.DistributedModel(gpt)
    # With "fp16"/"bf16" in the smp config the model runs in that dtype and the optimizer keeps
    # fp32 master weights, with a dynamic loss scale (needed by fp16's narrow range).
    cfg = smp.state.cfg
    scaling = dict(static_loss_scale=None, dynamic_loss_scale=True,
                   dynamic_loss_args={"init_scale": 2.0 ** 16, "scale_window": 1000,
                                      "min_scale": 1, "delayed_shift": 2}) \
        if (cfg.fp16 or cfg.bf16) else {}
    optimizer = smp.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01), **scaling)
    return model, optimizer


@smp.step
def train_step(model, idx, targets):
    logits = model(idx).float()  # (a no-op in fp32; the loss in fp32 under fp16/bf16)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    model.backward(loss)
    return loss


def resume(ckpt_dir: str, schedule: torch.optim.lr_scheduler.LRScheduler) -> tuple:
    """(first step to run, losses so far) from the newest complete checkpoint, else (0, [])."""
    if not os.path.exists(os.path.join(ckpt_dir, "newest")):
        return 0, []
    # Model and optimizer state apply at partitioning (the first step); the optimizer state
    # carries the learning rate the schedule had set for the next step.
    state = smp.resume_from_checkpoint(ckpt_dir)
    schedule.load_state_dict(state["schedule"])
    if smp.rank() == 0:
        log(f"resumed from {ckpt_dir} at step {state['step']}")
    return state["step"], list(state["losses"])


def save(ckpt_dir: str, step: int, model, optimizer, schedule, losses: list) -> None:
    """A partial checkpoint after `step` steps (every rank takes part; the last two are kept)."""
    smp.save_checkpoint(ckpt_dir, tag=f"step{step}", partial=True, model=model,
                        optimizer=optimizer, num_kept_partial_checkpoints=2,
                        user_content={"step": step, "losses": losses,
                                      "schedule": schedule.state_dict()})


def trace_one_step(args: argparse.Namespace, trace_dir: str, idx: torch.Tensor,
                   targets: torch.Tensor) -> None:
    """Run two steps of a fresh copy of the model with the pipeline timeline on (SMSHIM_TRACE is
    read when a DistributedModel is created), so that the training run itself pays nothing for
    tracing. The first step also partitions the model; the second is the one to look at."""
    smp.reset()  # forget the trained model: smp holds one DistributedModel at a time
    if smp.rank() == 0:  # files of an earlier run with more ranks would show up in the plot
        for old in glob.glob(os.path.join(trace_dir, "trace_rank*.json")):
            os.remove(old)
    smp.barrier()
    os.environ["SMSHIM_TRACE"] = trace_dir
    try:
        model, optimizer = build(args)
        for _ in range(2):
            optimizer.zero_grad()
            train_step(model, idx, targets)
            optimizer.step()
    finally:
        del os.environ["SMSHIM_TRACE"]


def main() -> int:
    args = parse_args()
    smp.init(DEFAULT_MP_CONFIG)  # merged with SM_HP_MP_PARAMETERS, which wins
    rank0 = smp.rank() == 0
    out_dir = output_dir(args.out_dir)

    data = stdlib_corpus(args.corpus_kb * 1024)
    n = len(data) // smp.dp_size()
    shard = data[smp.dp_rank() * n:(smp.dp_rank() + 1) * n]  # this replica's part of the corpus

    model, optimizer = build(args)
    # Linear warm-up for the first steps, then cosine decay to 10 %.
    warm = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warm) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, args.steps))))))
    ckpt_dir = args.checkpoint_dir or os.path.join(out_dir, "checkpoints")
    start, losses = resume(ckpt_dir, schedule)

    if rank0:
        n_params = sum(p.numel() for p in model.parameters())
        log(f"smp: {smp.size()} processes = pp {smp.pp_size()} x dp {smp.dp_size()}, "
            f"{smp.num_microbatches()} microbatches, pipeline {smp.state.cfg.pipeline}; "
            f"GPT {args.layers} x d{args.d_model}, {human(n_params)} parameters, context "
            f"{args.context}; corpus {human(len(data))} bytes of stdlib source")

    samples = args.batch_size * smp.dp_size()  # per step, over all replicas
    tokens = samples * args.context
    progress = Progress(args.steps, enabled=rank0)
    times = []
    for step in range(start, args.steps):
        idx, targets = sample_batch(shard, args.batch_size, args.context,
                                    (args.seed * 1_000_003 + step) * 1009 + smp.dp_rank())
        t0 = time.perf_counter()
        optimizer.zero_grad()
        out = train_step(model, idx, targets)
        optimizer.step()
        schedule.step()
        # The step's loss is per replica: average it over the replicas for the report.
        loss = sum(smp.allgather(out.reduce_mean().item(), smp.DP_GROUP)) / smp.dp_size()
        dt = time.perf_counter() - t0
        losses.append(loss)
        times.append(dt)
        progress.update(step, loss, dt, samples, tokens)
        if args.checkpoint_every > 0 and ((step + 1) % args.checkpoint_every == 0
                                          or step + 1 == args.steps):
            save(ckpt_dir, step + 1, model, optimizer, schedule, losses)
    progress.close()

    tail = max(1, len(losses) // 10)  # smooth the end of the curve a little
    first, last = losses[0], sum(losses[-tail:]) / tail
    if rank0 and times:
        steady = times[1:] or times  # the first step also partitions the model
        mean_t = sum(steady) / len(steady)
        log(f"{len(times)} steps in {sum(times):.1f} s; after the first: {1e3 * mean_t:.0f} ms/step, "
            f"{samples / mean_t:.1f} samples/s, {human(tokens / mean_t)} tokens/s")
    elif rank0:
        log(f"training already complete: the checkpoint in {ckpt_dir} is at step {args.steps} "
            "(pass a new --checkpoint-dir, or delete it, to train again)")
    if rank0 and plot_curve(losses, os.path.join(out_dir, "loss_curve.png"),
                            f"GPT on stdlib source, pp={smp.pp_size()} x dp={smp.dp_size()}"):
        log(f"wrote {os.path.join(out_dir, 'loss_curve.png')}")
    if args.timeline and times:
        trace_dir = os.path.join(out_dir, "trace")
        trace_one_step(args, trace_dir, idx, targets)
        smp.barrier()  # every rank has written its trace (each step's end flushes it)
        path = os.path.join(out_dir, "timeline.png")
        if rank0 and plot_timeline(trace_dir, path, step=1):
            log(f"wrote {path} (traces in {trace_dir})")
    if rank0:
        log(f"loss {first:.4f} -> {last:.4f} (first step -> mean of the last {tail})")
    return 0 if last < first else 1


if __name__ == "__main__":
    sys.exit(main())
