"""Activation checkpointing inside the pipeline: smp.set_activation_checkpointing (modules and
nn.Sequential strategies), smp.checkpoint and smp.checkpoint_sequential.

Each job trains for 3 steps and must end with the parameters of single-process training without
checkpointing (< 1e-5). That checkpointing really happened is seen on the owner of each module:
the forward of a Linear inside a checkpointed unit runs twice per call (forward, and recomputed
in backward), once per call otherwise.
"""

import collections
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from smshim.testing import run_ranks
from tests.pipeline_models import Block, batches, make_model, reference

TOL = 1e-5


class SeqNet(nn.Module):
    """A Sequential of blocks inside a module (not the root)."""

    def __init__(self, d=16, n=6):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.body = nn.Sequential(*[Block(d) for _ in range(n)])
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        return self.head(self.body(self.inp(x)))


class FunctionalNet(nn.Module):
    """Uses the functional forms inside its forward."""

    def __init__(self, d=16):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(4)])
        self.tail = nn.Sequential(Block(d), Block(d))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        import smdistributed.modelparallel.torch as smp

        h = self.inp(x)
        for b in self.blocks:
            h = smp.checkpoint(b, h)
        # (no dropout here: the RNG state need not be replayed)
        h = smp.checkpoint_sequential(self.tail, h, strategy="group_2", preserve_rng_state=False)
        return self.head(h)


def seq_root(d=16, n=6):
    return nn.Sequential(nn.Linear(8, d), *[Block(d) for _ in range(n)], nn.Linear(d, 3))


def build(kind):
    torch.manual_seed(0)
    return {"net": lambda: make_model("net"), "seqnet": SeqNet, "seqroot": seq_root,
            "functional": FunctionalNet}[kind]()


def logits(kind, out):
    return out["logits"] if kind == "net" else out


def run_reference(kind, steps=3, batch=8):
    if kind == "net":
        return reference("net", steps, batch)
    model = build(kind)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for x, y in batches("net", steps, batch):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _job(kind, cfg, marks, manual=None, steps=3, batch=8):
    import smdistributed.modelparallel.torch as smp

    smp.init(cfg)
    module = build(kind)
    for name, kwargs in marks.items():
        smp.set_activation_checkpointing(module.get_submodule(name), **kwargs)
    calls = collections.Counter()
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear):
            m.register_forward_pre_hook(lambda mod, args, name=name: calls.update([name]))
    warnings = []

    class Catch(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("smshim.modelparallel.torch.pipeline.activation_checkpointing").addHandler(Catch())
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    for name, pid in (manual or {}).items():
        smp.set_partition(module.get_submodule(name), pid)

    @smp.step
    def train_step(model, x, y):
        out = model(x, scale=0.5) if kind == "net" else model(x)
        loss = F.cross_entropy(logits(kind, out), y)
        model.backward(loss)
        return loss

    for x, y in batches("net", steps, batch):
        opt.zero_grad()
        train_step(model, x, y)
        opt.step()
        if not calls.get("_started"):
            calls.clear()  # count from the second step on: the first one also traced
            calls["_started"] = 1
    calls.pop("_started")
    return {"params": {n: p.detach().clone() for n, p in model.local_named_parameters()},
            "calls": dict(calls), "assignment": dict(model._assignment), "warnings": warnings,
            "pp_rank": smp.pp_rank()}


def _check(results, ref):
    merged = {}
    for r in results:
        merged.update(r["params"])
    assert set(merged) == set(ref)
    for n, p in ref.items():
        diff = (merged[n] - p).abs().max().item()
        assert diff < TOL, f"{n}: max abs diff {diff}"


def _calls(results):
    """Linear name -> forward runs over the last 2 steps, on the rank that owns it."""
    out = {}
    for r in results:
        for n, c in r["calls"].items():
            if r["assignment"].get(n, 0) == r["pp_rank"]:
                out[n] = c
    return out


MANUAL_NET = {"blocks.2": 1, "blocks.3": 1, "head": 1}


def test_checkpointed_blocks_on_both_stages_of_pp2():
    cfg = {"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False,
           "default_partition": 0}
    marks = {f"blocks.{i}": {} for i in range(4)}
    results = run_ranks(_job, 2, "net", cfg, marks, MANUAL_NET, timeout=150)
    _check(results, run_reference("net"))
    calls = _calls(results)
    per_call = 2 * 2  # 2 steps x 2 microbatches
    for i in range(4):  # recomputed on its owner: blocks 0-1 on pp rank 0, 2-3 on pp rank 1
        assert calls[f"blocks.{i}.lin"] == 2 * per_call, calls
    assert calls["inp"] == per_call, calls
    assert calls["shared"] == 2 * per_call  # called twice per microbatch, not checkpointed
    assert results[1]["assignment"]["blocks.3"] == 1


@pytest.mark.parametrize("kind, strategy, groups_on", [
    ("seqroot", "each", None), ("seqroot", "contiguous", None), ("seqroot", "group_3", None),
    ("seqnet", "contiguous", None), ("seqnet", "group_3", None)])
def test_sequential_strategies_pp2(kind, strategy, groups_on):
    cfg = {"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False,
           "default_partition": 0}
    if kind == "seqroot":
        # children 0 (input Linear), blocks 1-2 on stage 0; blocks 3-6 and the head on stage 1
        manual = {str(i): 1 for i in range(3, 8)}
        blocks = [str(i) for i in range(1, 7)]
        marks = {"": {"strategy": strategy}}
    else:
        manual = {"body.3": 1, "body.4": 1, "body.5": 1, "head": 1}
        blocks = [f"body.{i}" for i in range(6)]
        marks = {"body": {"strategy": strategy}}
    results = run_ranks(_job, 2, kind, cfg, marks, manual, timeout=150)
    _check(results, run_reference(kind))
    calls = _calls(results)
    for b in blocks:
        assert calls[f"{b}.lin"] == 2 * 4, (b, calls)


def test_sequential_group_spanning_partitions():
    cfg = {"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False,
           "default_partition": 0}
    manual = {"body.3": 1, "body.4": 1, "body.5": 1, "head": 1}
    # group_2: body[2:4] holds blocks of both stages -> a manual partition rejects it, by name.
    with pytest.raises(AssertionError, match=r"body#ckpt\[2:4\].*spans pipeline partitions"):
        run_ranks(_job, 2, "seqnet", cfg, {"body": {"strategy": "group_2"}}, manual, timeout=150)


def test_manual_module_spanning_partitions_is_an_error():
    cfg = {"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False,
           "default_partition": 0}
    manual = dict(MANUAL_NET, **{"blocks.1.lin": 1})
    with pytest.raises(AssertionError, match=r"'blocks\.1'.*spans pipeline partitions \[0, 1\]"):
        run_ranks(_job, 2, "net", cfg, {"blocks.1": {}}, manual, timeout=150)


def test_auto_partition_spanning_module_warns_and_runs_unchanged():
    cfg = {"pipeline_parallel_degree": 2, "microbatches": 2}
    results = run_ranks(_job, 2, "net", cfg, {"": {}}, timeout=150)
    _check(results, run_reference("net"))
    assert any("'<root>'" in w and "without activation checkpointing" in w
               for w in results[0]["warnings"]), results[0]["warnings"]
    calls = _calls(results)
    assert calls["blocks.0.lin"] == 4  # not recomputed


def test_functional_forms_pp2():
    cfg = {"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False,
           "default_partition": 0}
    manual = {"blocks.2": 1, "blocks.3": 1, "tail": 1, "head": 1}
    results = run_ranks(_job, 2, "functional", cfg, {}, manual, timeout=150)
    _check(results, run_reference("functional"))
    calls = _calls(results)
    for name in ["blocks.0.lin", "blocks.1.lin", "blocks.2.lin", "blocks.3.lin", "tail.0.lin",
                 "tail.1.lin"]:
        assert calls[name] == 8, (name, calls)


def test_pp1_with_dropout_preserves_rng_state():
    # pp=1 (2 data-parallel replicas): a dropout model checkpointed gives the same training as
    # without (the recomputation replays the same dropout masks).
    (plain, plain_hits), _ = run_ranks(_pp1_job, 2, {}, timeout=120)
    assert plain_hits == 3 * 2
    for strategy in ("each", "group_2", "contiguous"):
        (ckpt, hits), _ = run_ranks(_pp1_job, 2, {"": {"strategy": strategy}}, timeout=120)
        assert hits == 2 * plain_hits, strategy  # recomputed in backward
        for n, p in plain.items():
            assert torch.equal(p, ckpt[n]), (strategy, n)


def _pp1_job(marks):
    import smdistributed.modelparallel.torch as smp

    smp.init({"ddp": True, "microbatches": 2})
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3),
                           nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Dropout(0.3),
                           nn.Linear(16, 3))
    for name, kw in marks.items():
        smp.set_activation_checkpointing(module.get_submodule(name), **kw)
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    hits = []
    # (inside a child: a checkpointed module's own hooks run once, its children's on recompute)
    module[2][0].register_forward_pre_hook(lambda *_: hits.append(1))

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    torch.manual_seed(1 + smp.dp_rank())
    for x, y in batches("net", 3, 16):
        x, y = x[smp.dp_rank() * 8:][:8], y[smp.dp_rank() * 8:][:8]
        opt.zero_grad()
        train_step(model, x, y)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, len(hits)


def test_invalid_arguments():
    import smdistributed.modelparallel.torch as smp

    with pytest.raises(ValueError, match="group_N"):
        smp.set_activation_checkpointing(nn.Sequential(nn.Linear(2, 2)), strategy="pairs")
    with pytest.raises(ValueError, match="nn.Sequential"):
        smp.set_activation_checkpointing(nn.Linear(2, 2), strategy="group_2")
    with pytest.raises(ValueError, match="no forward"):
        smp.set_activation_checkpointing(nn.ModuleList([nn.Linear(2, 2)]))


def test_pp4_auto_partition_all_blocks_checkpointed():
    cfg = {"pipeline_parallel_degree": 4, "microbatches": 4}
    marks = {f"blocks.{i}": {} for i in range(4)}
    results = run_ranks(_job, 4, "net", cfg, marks, None, 3, 8, timeout=200)
    _check(results, run_reference("net"))
    assert not any(r["warnings"] for r in results), [r["warnings"] for r in results]
    calls = _calls(results)
    for i in range(4):  # 2 steps x 4 microbatches, each recomputed once
        assert calls[f"blocks.{i}.lin"] == 2 * 8, calls
    assert len({r["assignment"][f"blocks.{i}"] for r in results for i in range(4)}) > 1
