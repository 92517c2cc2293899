"""Random models and pipeline set-ups, generated from a seed, for equivalence testing.

A case is plain data: a model program (which modules exist, and a list of operations that its
`forward` interprets: module calls; glue between them that reads values, branches on `.item()`
and on a tensor's truth, in-place ops on clones, views, detaches; calls under `no_grad`; a module
called twice; dict, tuple, list, namedtuple and int outputs; keyword, string, bool and int
inputs; a child that may be placed elsewhere than its parent) and a set-up (pipeline degree,
microbatches, schedule, placement or auto-partition, data parallelism, optimizer, gradient
accumulation, evaluation steps, activation checkpointing, engine switches, batch sizes).
`train_smp` trains the case under smp and `train_reference` in one process; `compare` says where
they differ.

Run directly to sweep seeds: `python -m tests.random_models 0 200` prints one line per seed
(`RANDOM_MODELS_LOG=DEBUG` in the environment shows each rank's log, placement included).
"""

import logging
import os
import random
import sys
from collections import namedtuple
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

D = 8  # feature width of every module
CLASSES = 3
# In float64, so that the comparison can be sharp: in float32 a model that squares its values
# (Fuse with a == b) amplifies the rounding of a different summation order (microbatches) past
# any fixed tolerance; in float64 a gradient contribution lost or counted twice still shows.
DTYPE = torch.float64
TOL = 1e-8
LR = 0.1


# ---- the modules a program is made of --------------------------------------------------------

class Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return self.lin(x)


class Blk(nn.Module):
    """A pre-LN residual block with a keyword argument."""

    def __init__(self) -> None:
        super().__init__()
        self.ln, self.l1, self.l2 = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x, scale=1.0):
        return x + scale * self.l2(F.gelu(self.l1(self.ln(x))))


class Two(nn.Module):
    """A dict output."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        return {"a": torch.tanh(self.l1(x)), "b": self.l2(x)}


class Pair(nn.Module):
    """A tuple output."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        return self.l1(x), F.relu(self.l2(x))


class Fuse(nn.Module):
    """Two inputs (often given as keywords) and a keyword argument."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, a, b, scale=1.0):
        return self.lin(a * b) * scale


class Outer(nn.Module):
    """A module with a child of its own, which a placement may put elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.inner = nn.Linear(D, D), Lin()

    def forward(self, x):
        return self.inner(torch.tanh(self.lin(x))) + x


class Deep(nn.Module):
    """Two levels of children (`mid`, `mid.inner`), each of which a placement may put elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.mid = nn.Linear(D, D), Outer()

    def forward(self, x):
        return self.mid(torch.relu(self.lin(x))) * 0.5 + x


class Frozen(nn.Module):
    """A weight without gradient next to a bias with one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.lin.weight.requires_grad_(False)

    def forward(self, x):
        return self.lin(x)


class IntOut(nn.Module):
    """A float output and an int one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        h = self.lin(x)
        return h, h.argmax(-1)


class Gather(nn.Module):
    """Takes an int tensor (an embedding lookup)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lin = nn.Embedding(D, D), nn.Linear(D, D)

    def forward(self, x, idx):
        return self.lin(x) + self.emb(idx)


AuxOut = namedtuple("AuxOut", ["h", "none", "count"])


class Aux(nn.Module):
    """A string keyword, an optional bool mask, and a namedtuple output holding None and an int
    (as Hugging Face modules take flags and return structures with empty fields)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x, mode="tanh", mask=None):
        h = self.lin(x)
        h = torch.tanh(h) if mode == "tanh" else torch.sigmoid(h)
        if mask is not None:
            h = h * mask
        return AuxOut(h, None, 2)


class ListIn(nn.Module):
    """A list input and a list output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, xs):
        a, b = xs
        return [self.lin(a + b), a - b]


class LossMod(nn.Module):
    """A module that computes the loss, with a parameter of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.temp = nn.Parameter(torch.ones(()))

    def forward(self, logits, y):
        return F.cross_entropy(logits * self.temp, y)


KINDS = {"lin": Lin, "blk": Blk, "two": Two, "pair": Pair, "fuse": Fuse, "outer": Outer,
         "deep": Deep,
         "frozen": Frozen, "intout": IntOut, "gather": Gather, "aux": Aux, "listin": ListIn}


# ---- a program: what forward does, as data ---------------------------------------------------

@dataclass
class Program:
    kinds: List[str]  # module m{i} is KINDS[kinds[i]]()
    ops: List[Tuple]  # interpreted by RandomNet.forward
    loss_at: str  # "glue" (in forward), "module" (LossMod) or "step" (in the step function)
    return_hidden: bool
    return_int: bool


def make_program(rng: random.Random) -> Program:
    n = rng.randint(3, 7)
    kinds = [rng.choice(list(KINDS)) for _ in range(n)]
    floats, ints = 1, 1  # value 0 is inp(x); int value 0 is argmax of x
    ops: List[Tuple] = []
    calls = list(range(n)) + [rng.randrange(n) for _ in range(rng.randint(0, 2))]  # some twice
    rng.shuffle(calls)

    def pick() -> int:  # recent values more often: chains, with some long-range reuse
        return max(0, floats - 1 - int(rng.expovariate(0.7)))

    for i in calls:
        for _ in range(rng.choice([0, 0, 1, 2])):
            g = rng.choice(["add", "mul", "detach", "item_if", "bool_if", "cat", "inplace", "view",
                            "detmul", "act"])
            a, b = pick(), pick()
            ops.append(("glue", g, a, b))
            floats += 1
        kind, nograd = kinds[i], rng.random() < 0.1
        a, b = pick(), pick()
        if kind == "fuse":
            src = rng.choice(["pos", "kw", "dict"])
            ops.append(("call", i, nograd, src, a, b, rng.choice([1.0, 0.5])))
            floats += 1
        elif kind == "blk":
            ops.append(("call", i, nograd, rng.choice([None, 0.5, 2.0]), a))
            floats += 1
        elif kind == "gather":
            ops.append(("call", i, nograd, a, rng.randrange(ints)))
            floats += 1
        elif kind == "aux":
            ops.append(("call", i, nograd, a, rng.choice(["tanh", "sigmoid"]),
                        rng.choice([None, b])))
            floats += 1
        elif kind == "listin":
            ops.append(("call", i, nograd, a, b))
            floats += 2
        elif kind in ("two", "pair"):
            ops.append(("call", i, nograd, a))
            floats += 2
        elif kind == "intout":
            ops.append(("call", i, nograd, a))
            floats += 1
            ints += 1
        else:
            ops.append(("call", i, nograd, a))
            floats += 1
    # The head reads a sum of a few values, always including the last.
    ops.append(("head", sorted({floats - 1} | {pick() for _ in range(rng.randint(0, 2))})))
    return Program(kinds, ops, rng.choice(["glue", "module", "step"]),
                   return_hidden=rng.random() < 0.4, return_int=rng.random() < 0.3)


class RandomNet(nn.Module):
    """The model a Program describes; `forward(x, y)` returns a dict."""

    def __init__(self, prog: Program) -> None:
        super().__init__()
        self.prog = prog
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(KINDS[k]() for k in prog.kinds)
        self.head = nn.Linear(D, CLASSES)
        self.lossmod = LossMod()

    def _glue(self, g: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if g == "add":
            return a + b
        if g == "mul":
            return a * torch.tanh(b)
        if g == "detach":
            return a.detach() * 0.5 + b
        if g == "item_if":
            return a * 0 if a.abs().mean().item() > 1e6 else a + 1  # never taken
        if g == "bool_if":
            return b if (a.abs().sum() < -1) else a - b  # never taken
        if g == "cat":
            return torch.cat([a[:, : D // 2], b[:, D // 2:]], -1)
        if g == "inplace":
            c = a.clone()
            c.mul_(0.5)
            return c
        if g == "view":
            return a.view(a.shape[0], 2, D // 2).flip(1).reshape(a.shape[0], D)
        if g == "detmul":
            return a * torch.sigmoid(b.detach())
        return F.gelu(a) + torch.relu(b)  # "act"

    def _call(self, op: Tuple, v: List[torch.Tensor], iv: List[torch.Tensor]) -> None:
        _, i, nograd, *args = op
        mod, kind = self.blocks[i], self.prog.kinds[i]
        with torch.no_grad() if nograd else torch.enable_grad():
            if kind == "fuse":
                src, a, b, scale = args
                if src == "pos":
                    out = mod(v[a], v[b], scale=scale)
                elif src == "kw":
                    out = mod(b=v[b], a=v[a], scale=scale)
                else:
                    out = mod(**{"a": v[a], "b": v[b]}, scale=scale)
            elif kind == "blk":
                scale, a = args
                out = mod(v[a]) if scale is None else mod(v[a], scale=scale)
            elif kind == "gather":
                a, j = args
                out = mod(v[a], iv[j])
            elif kind == "aux":
                a, mode, m = args
                out = mod(v[a], mode=mode, mask=None if m is None else v[m] > 0)
            elif kind == "listin":
                out = mod([v[args[0]], v[args[1]]])
            else:
                out = mod(v[args[0]])
        if kind == "two":
            v.extend([out["a"], out["b"]])
        elif kind in ("pair", "listin"):
            v.extend(out)
        elif kind == "aux":
            if not (isinstance(out, AuxOut) and out.none is None and out.count == 2):
                raise AssertionError(f"Aux returned {type(out).__name__}: {out}")
            v.append(out.h)
        elif kind == "intout":
            v.append(out[0])
            iv.append(out[1])
        else:
            v.append(out)

    def forward(self, x, y):
        v = [self.inp(x)]
        iv = [x.argmax(-1)]
        for op in self.prog.ops:
            if op[0] == "glue":
                v.append(self._glue(op[1], v[op[2]], v[op[3]]))
            elif op[0] == "call":
                self._call(op, v, iv)
            else:
                logits = self.head(sum(v[j] for j in op[1]))
        out = {"logits": logits}
        if self.prog.loss_at == "glue":
            out["loss"] = F.cross_entropy(logits, y)
        elif self.prog.loss_at == "module":
            out["loss"] = self.lossmod(logits, y)
        if self.prog.return_hidden:
            out["hidden"] = v[len(v) // 2]
        if self.prog.return_int:
            out["ints"] = iv[-1]
        return out


def loss_of(out: Dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return out["loss"] if "loss" in out else F.cross_entropy(out["logits"], y)


# ---- a set-up: how the program is trained ----------------------------------------------------

@dataclass
class Case:
    seed: int
    prog: Program
    pp: int
    microbatches: int
    schedule: str
    active: Optional[int]
    deterministic_server: bool
    placement: Optional[Dict[str, int]]  # module name -> pp rank; None: auto-partition
    env: Dict[str, str]
    batches: List[int]  # per data-parallel replica
    dp: int = 1  # data-parallel replicas (ddp), each on its shard of the global batch
    placement_strategy: str = "cluster"
    optimizer: str = "sgd"
    accumulate: int = 1  # step calls per optimizer step (gradients add up in between)
    evaluate: bool = False  # a no_grad step after each optimizer step, returning the logits
    checkpointed: List[str] = field(default_factory=list)  # smp.set_activation_checkpointing
    extra_cfg: Dict[str, Any] = field(default_factory=dict)

    def cfg(self) -> Dict[str, Any]:
        c = {"pipeline_parallel_degree": self.pp, "microbatches": self.microbatches,
             "pipeline": self.schedule, "deterministic_server": self.deterministic_server}
        if self.active is not None:
            c["active_microbatches"] = self.active
        if self.dp > 1:
            c.update(ddp=True, placement_strategy=self.placement_strategy)
        if self.placement is None:
            c["auto_partition"] = True
        else:
            c.update(auto_partition=False, default_partition=0)
        c.update(self.extra_cfg)
        return c

    def describe(self) -> str:
        return (f"pp={self.pp} dp={self.dp} {self.placement_strategy} {self.optimizer} "
                f"accumulate={self.accumulate} evaluate={self.evaluate} "
                f"checkpointed={self.checkpointed} m={self.microbatches} {self.schedule} active={self.active} "
                f"det={self.deterministic_server} env={self.env} batches={self.batches} "
                f"loss_at={self.prog.loss_at} hidden={self.prog.return_hidden} "
                f"int={self.prog.return_int}\n  kinds={self.prog.kinds}\n"
                f"  placement={self.placement}\n  ops={self.prog.ops}")


def module_names(prog: Program) -> List[str]:
    names = ["inp", "head", "lossmod"]
    for i, k in enumerate(prog.kinds):
        names.append(f"blocks.{i}")
        if k == "outer":
            names.append(f"blocks.{i}.inner")
        if k == "deep":
            names += [f"blocks.{i}.mid", f"blocks.{i}.mid.inner"]
    return names


def make_case(seed: int) -> Case:
    rng = random.Random(seed)
    prog = make_program(rng)
    pp = rng.choice([2, 2, 3, 4])
    m = rng.choice([1, 2, 2, 4])
    placement = None
    if rng.random() < 0.8:
        placement = {n: rng.randrange(pp) for n in module_names(prog) if rng.random() < 0.8}
    env = rng.choice([{}, {}, {"SMSHIM_PREDICT": "0"}, {"SMSHIM_FUSED_WGRAD": "0"},
                      {"SMSHIM_FUSED_WGRAD_MIN_NUMEL": "0"}])
    steps = rng.choice([2, 3])
    batches = [4 * m] * (steps - 1) + [rng.choice([4 * m, 2 * m, m])]
    dp = 2 if pp == 2 and rng.random() < 0.25 else 1
    return Case(seed, prog, pp, m, rng.choice(["interleaved", "simple"]),
                rng.choice([None, 1, min(2, m), m]), rng.random() < 0.3, placement, env, batches,
                dp=dp, placement_strategy=rng.choice(["cluster", "spread"]),
                optimizer=rng.choice(["sgd", "sgd", "adam"]), accumulate=rng.choice([1, 1, 2]),
                evaluate=rng.random() < 0.3, checkpointed=[
                    f"blocks.{i}" for i, k in enumerate(prog.kinds)  # (modules wholly on one
                    if k not in ("outer", "deep") and rng.random() < 0.3])  # rank)


def features(case: Case) -> set:
    """What a case exercises, as names (for choosing seeds that cover them all)."""
    prog, f = case.prog, set()
    f |= {f"kind:{k}" for k in prog.kinds}
    calls = [op for op in prog.ops if op[0] == "call"]
    f |= {f"glue:{op[1]}" for op in prog.ops if op[0] == "glue"}
    f |= {f"fuse:{op[3]}" for op in calls if prog.kinds[op[1]] == "fuse"}
    f |= {"no_grad_call" for op in calls if op[2]}
    if len({op[1] for op in calls}) < len(calls):
        f.add("called_twice")
    f |= {f"loss:{prog.loss_at}", f"pp{case.pp}", f"m{case.microbatches}", case.schedule,
          case.optimizer, "auto" if case.placement is None else "manual"}
    f |= {f"env:{k}" for k in case.env}
    flags = {"return_hidden": prog.return_hidden, "return_int": prog.return_int,
             "deterministic": case.deterministic_server, "accumulate": case.accumulate > 1,
             "evaluate": case.evaluate, "checkpointed": bool(case.checkpointed),
             "smaller_last": case.batches[-1] != case.batches[0],
             f"dp2:{case.placement_strategy}": case.dp > 1}
    f |= {k for k, on in flags.items() if on}
    nested = _nested(case)
    if nested:
        f |= {"nested_call", f"nested_call:dp{case.dp}"}
    if "two" in nested:
        f.add("nested_call_through_pp_rank_0")
    return f


def _nested(case: Case) -> set:
    """Nested calls the placement makes: "one" for a module on a rank other than 0 with a
    descendant elsewhere, "two" for such a descendant on pp_rank 0 with one of its own elsewhere."""
    if case.placement is None:
        return set()

    def owner(name: str) -> int:  # (an unplaced module goes where its parent is)
        while name:
            if name in case.placement:
                return case.placement[name]
            name = name.rpartition(".")[0]
        return 0

    found = set()
    names = module_names(case.prog)
    for a in names:
        for b in names:
            if b.startswith(a + ".") and owner(a) != 0 and owner(b) != owner(a):
                found.add("one")
                if owner(b) == 0 and any(c.startswith(b + ".") and owner(c) != 0
                                         for c in names):
                    found.add("two")
    return found


def covering_seeds(first: int, search: int = 1000) -> List[int]:
    """Seeds 0..first-1, plus the first seed for each feature those miss."""
    seeds = list(range(first))
    covered = set().union(*(features(make_case(s)) for s in seeds))
    for s in range(first, search):
        new = features(make_case(s)) - covered
        if new:
            seeds.append(s)
            covered |= new
    return seeds


def case_batches(case: Case) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """The global batches: replica d trains on rows d*n .. (d+1)*n - 1 of each."""
    g = torch.Generator().manual_seed(case.seed)
    return [(torch.randn(n * case.dp, D, generator=g, dtype=DTYPE),
             torch.randint(0, CLASSES, (n * case.dp,), generator=g))
            for n in case.batches for _ in range(case.accumulate)]


def _rows(case: Case, x: torch.Tensor, d: int) -> slice:
    n = x.shape[0] // case.dp
    return slice(d * n, (d + 1) * n)


def _optimizer(case: Case, params):
    if case.optimizer == "adam":
        # (A large eps: Adam's first steps move every weight by about lr whatever the size of
        # its gradient, so with the default eps a gradient that is float noise around zero, as
        # on a path through detach(), moves it by noise that a different summation order, as
        # microbatches give, turns into a different direction.)
        return torch.optim.Adam(params, lr=0.01, eps=1e-3)
    return torch.optim.SGD(params, lr=LR)


def _model(case: Case) -> RandomNet:
    torch.manual_seed(case.seed)
    return RandomNet(case.prog).to(DTYPE)


# ---- training: one process, and under smp -----------------------------------------------------

def train_reference(case: Case) -> Dict[str, Any]:
    """One process on the global batches: the parameters, and per step what each replica's
    step should return (its loss, hidden and int outputs on its shard)."""
    model = _model(case)
    opt = _optimizer(case, model.parameters())
    outputs = []
    for i, (x, y) in enumerate(case_batches(case)):
        if i % case.accumulate == 0:
            opt.zero_grad()
        out = model(x, y)
        loss = loss_of(out, y)
        per_replica = []
        for d in range(case.dp):
            rows = _rows(case, x, d)
            with torch.no_grad():  # (before the step changes lossmod's parameter)
                logits, yy = out["logits"][rows], y[rows]
                shard_loss = (model.lossmod(logits, yy) if case.prog.loss_at == "module"
                              else F.cross_entropy(logits, yy))
            got = {"loss": shard_loss if case.dp > 1 else loss.detach()}
            if case.prog.return_hidden:
                got["hidden"] = out["hidden"][rows].detach()
            if case.prog.return_int:
                got["ints"] = out["ints"][rows]
            per_replica.append(got)
        loss.backward()
        outputs.append(per_replica)
        if i % case.accumulate == case.accumulate - 1:
            opt.step()
            if case.evaluate:
                with torch.no_grad():
                    logits = model(x, y)["logits"]
                outputs.append([{"logits": logits[_rows(case, x, d)]} for d in range(case.dp)])
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "outputs": outputs, "state_dict": model.state_dict(), "opt_state": opt.state_dict()}


def train_smp(case: Case) -> Dict[str, Any]:
    """Run on every rank (under run_ranks): this rank's parameters and the step outputs."""
    import smdistributed.modelparallel.torch as smp

    if os.environ.get("RANDOM_MODELS_LOG"):  # (for a sweep that looks into one case)
        logging.basicConfig(level=os.environ["RANDOM_MODELS_LOG"])
    smp.init(case.cfg())
    module = _model(case)
    for name in case.checkpointed:
        smp.set_activation_checkpointing(module.get_submodule(name))
    # (A program may leave a parameter unused: under ddp, say so, as torch's DDP is told.)
    model = smp.DistributedModel(module, find_unused_parameters=case.dp > 1)
    for name, pid in (case.placement or {}).items():
        smp.set_partition(module.get_submodule(name), pid)
    opt = smp.DistributedOptimizer(_optimizer(case, model.parameters()))
    at_step = case.prog.loss_at == "step"

    @smp.step
    def train_step(model, x, y):
        out = model(x, y)
        loss = F.cross_entropy(out["logits"], y) if at_step else out["loss"]
        model.backward(loss)
        return loss, out.get("hidden"), out.get("ints")

    @smp.step
    def eval_step(model, x, y):
        return model(x, y)["logits"]

    outputs = []
    d = smp.dp_rank()
    for i, (x, y) in enumerate(case_batches(case)):
        x, y = x[_rows(case, x, d)], y[_rows(case, x, d)]
        if i % case.accumulate == 0:
            opt.zero_grad()
        loss, hidden, ints = train_step(model, x, y)
        got = {"loss": torch.as_tensor(loss.reduce_mean()).detach()}
        if case.prog.return_hidden:
            got["hidden"] = hidden.concat().detach()
        if case.prog.return_int:
            got["ints"] = ints.concat()
        outputs.append(got)
        if i % case.accumulate == case.accumulate - 1:
            opt.step()
            if case.evaluate:
                with torch.no_grad():
                    outputs.append({"logits": eval_step(model, x, y).concat()})
    result = {"params": {n: p.detach().clone() for n, p in model.local_named_parameters()},
              "outputs": outputs, "dp_rank": d}
    if d == 0:  # (the full state dicts, gathered over the pipeline)
        result["state_dict"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        result["opt_state"] = opt.state_dict()
    return result


def compare(case: Case, results: List[Dict[str, Any]], tol: float = TOL) -> List[str]:
    """Where smp's training differs from the reference (empty when equal)."""
    want = train_reference(case)
    problems = []
    got: Dict[str, torch.Tensor] = {}
    for r in results:
        for n, p in r["params"].items():  # (replicas must hold the same values)
            if n in got and not torch.equal(got[n], p):
                problems.append(f"parameter {n} differs between replicas")
            got[n] = p
    if set(got) != set(want["params"]):
        problems.append(f"parameter names differ: {sorted(set(got) ^ set(want['params']))}")
    for n, p in want["params"].items():
        if n in got:
            diff = (got[n] - p).abs().max().item()
            if not diff < tol:
                problems.append(f"parameter {n}: max abs diff {diff:.3g}")
    for rank, r in enumerate(results):
        if "state_dict" in r:
            problems += [f"rank {rank}: {p}" for p in _compare_state(r, want, tol)]
        if len(r["outputs"]) != len(want["outputs"]):
            problems.append(f"rank {rank}: {len(r['outputs'])} step outputs, not "
                            f"{len(want['outputs'])}")
        for step, (g, w) in enumerate(zip(r["outputs"], want["outputs"])):
            for key, wv in w[r["dp_rank"]].items():
                gv = g[key]
                if gv.shape != wv.shape or gv.dtype != wv.dtype:
                    problems.append(f"rank {rank} step {step} {key}: {gv.dtype}{tuple(gv.shape)}"
                                    f" != {wv.dtype}{tuple(wv.shape)}")
                elif not (gv.double() - wv.double()).abs().max().item() < tol:
                    problems.append(f"rank {rank} step {step} {key} differs")
    return problems


def _compare_state(got: Dict[str, Any], want: Dict[str, Any], tol: float) -> List[str]:
    """The model's and the optimizer's full state dicts against the reference's."""
    problems = []
    sd, want_sd = got["state_dict"], want["state_dict"]
    if set(sd) != set(want_sd):
        problems.append(f"state_dict keys differ: {sorted(set(sd) ^ set(want_sd))}")
    for k in set(sd) & set(want_sd):
        if not (sd[k].shape == want_sd[k].shape and (sd[k] - want_sd[k]).abs().max() < tol):
            problems.append(f"state_dict[{k!r}] differs")
    st, want_st = got["opt_state"]["state"], want["opt_state"]["state"]
    if set(st) != set(want_st):
        problems.append(f"optimizer state for parameters {sorted(set(st) ^ set(want_st))} "
                        "differs in presence")
    for i in set(st) & set(want_st):
        for k, v in want_st[i].items():
            g = st[i].get(k)
            if g is None or not (torch.as_tensor(g).double() - torch.as_tensor(v).double()
                                 ).abs().max() < tol:
                problems.append(f"optimizer state {i}.{k} differs")
    groups = [{k: v for k, v in g.items() if k != "params"} for g in got["opt_state"]["param_groups"]]
    want_groups = [{k: v for k, v in g.items() if k != "params"}
                   for g in want["opt_state"]["param_groups"]]
    if groups != want_groups:
        problems.append(f"optimizer param_groups differ: {groups} != {want_groups}")
    return problems


def run_case(case: Case, timeout: float = 120) -> List[str]:
    from smshim.testing import RankFailure, run_ranks

    if "two" in _nested(case):  # a placement smp refuses, on every rank, saying why
        try:
            run_ranks(train_smp, case.pp * case.dp, case, timeout=timeout, env=case.env)
        except RankFailure as e:
            if "cannot call modules on other ranks in turn" in str(e):
                return []
            raise
        return ["a module on pp rank 0 nested in another rank's called a third: no error"]
    return compare(case, run_ranks(train_smp, case.pp * case.dp, case, timeout=timeout,
                                   env=case.env))


def main(argv: List[str]) -> int:
    lo, hi = int(argv[0]), int(argv[1])
    bad = 0
    for seed in range(lo, hi):
        case = make_case(seed)
        try:
            problems = run_case(case, timeout=40)
        except Exception as e:  # noqa: BLE001  (a sweep reports and goes on)
            bad += 1
            print(f"seed {seed}: ERROR {str(e)[-3000:]}\n  {case.describe()}", flush=True)
            continue
        if problems:
            bad += 1
            print(f"seed {seed}: MISMATCH {problems[:6]}\n  {case.describe()}", flush=True)
        else:
            print(f"seed {seed}: OK", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
