"""A chain of calls to one stage (a stage's modules called one after another in a loop) is one
node in pp_rank 0's autograd graph and one backward request (calls.py, `_Chain`), and training
stays the same as in one process when glue code or another call also uses an output inside the
chain, before or after the next call took it."""

import time
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from smshim.testing import run_ranks

STEPS, BATCH, MICROBATCHES = 3, 8, 2


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.in_place = False  # scales its input in place first (as a block may in one process)

    def forward(self, x):
        if self.in_place:
            x = x.mul_(1.5)
        return x + torch.tanh(self.lin(x))


class _Chained(nn.Module):
    """`inp` on pp_rank 0; the blocks and the head on pp_rank 1."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([_Block(8) for _ in range(4)])
        self.head = nn.Linear(8, 3)
        self.hooked = 0  # gradients a hook saw
        if mode == "in_place":  # blocks[1:] change their input, an output of the one before
            for block in self.blocks[1:]:
                block.in_place = True

    def _hook(self, grad):
        self.hooked += 1

    def forward(self, x):
        b = self.blocks
        h0 = self.inp(x)
        aux = 0.0
        if self.mode in ("loop", "in_place"):
            h = h0
            for block in b:
                h = block(h)
        elif self.mode == "read_after":  # glue reads h2 after blocks[2] took it
            h2 = b[1](b[0](h0))
            h = b[3](b[2](h2))
            aux = (h2 * h2).mean()
        elif self.mode == "read_before":  # glue reads h1 before blocks[1] takes it
            h1 = b[0](h0)
            aux = (h1 * h1).mean()
            h = b[3](b[2](b[1](h1)))
        elif self.mode == "two_calls":  # h1 goes to blocks[1] and blocks[2]
            h1 = b[0](h0)
            h = b[3](b[1](h1)) + b[2](h1)
        elif self.mode == "hook_before":  # a hook on h1 before blocks[1] takes it
            h1 = b[0](h0)
            h1.register_hook(self._hook)
            h = b[3](b[2](b[1](h1)))
        elif self.mode in ("hook_after", "hook_after_read"):  # ... after: too late
            h1 = b[0](h0)
            h = b[1](h1)
            if self.mode == "hook_after_read":  # (even once glue read it too)
                aux = (h1 * h1).mean()
            h1.register_hook(self._hook)
            h = b[3](b[2](h))
        elif self.mode == "read_without_grad":  # h2 read, not differentiated
            h2 = b[1](b[0](h0))
            h = b[3](b[2](h2))
            aux = 0.0 * float(h2.detach().abs().sum() > -1)
        else:
            raise ValueError(self.mode)
        return self.head(h), aux


def _batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(STEPS)]


def _model(mode: str) -> _Chained:
    torch.manual_seed(0)
    return _Chained(mode)


def _reference(mode: str) -> dict:
    model = _model(mode)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for x, y in _batches():
        opt.zero_grad()
        # The pipeline's loss is the mean over microbatches of each one's loss.
        loss = 0.0
        for xs, ys in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
            logits, aux = model(xs)
            loss = loss + (F.cross_entropy(logits, ys) + aux) / MICROBATCHES
        loss.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(mode: str):
    import smdistributed.modelparallel.torch as smp

    torch.set_num_threads(1)
    smp.init({"pipeline_parallel_degree": 2, "microbatches": MICROBATCHES,
              "pipeline": "interleaved", "auto_partition": False, "default_partition": 1})
    module = _model(mode)
    smp.set_partition(module.inp, 0)
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))

    @smp.step
    def train_step(model, x, y):
        logits, aux = model(x)
        loss = F.cross_entropy(logits, y) + aux
        model.backward(loss)
        return loss

    from smshim.modelparallel.torch.pipeline import serving

    passes = []  # autograd passes on this rank (its owner's backwards)
    run_backward = serving._run_backward
    serving._run_backward = lambda *a, **k: (passes.append(1), run_backward(*a, **k))
    # pp_rank 0: the calls served by `CallerSide._next_in_chain` (a chain's later call, its
    # outputs predicted), each step.
    from smshim.modelparallel.torch.pipeline.calls import CallerSide

    next_in_chain, fast = CallerSide._next_in_chain, []

    def counted(*args):
        out = next_in_chain(*args)
        fast[-1] += out is not None
        return out

    CallerSide._next_in_chain = counted
    kept = []
    try:
        for x, y in _batches():
            opt.zero_grad()
            fast.append(0)
            train_step(model, x, y)
            opt.step()
            kept.append(len(model._pipeline.server._saved))  # graphs left after the step: none
    finally:
        serving._run_backward = run_backward
        CallerSide._next_in_chain = next_in_chain
    sent = model._pipeline.transport.sent_messages
    # pp_rank 0: the backward requests it sent; pp_rank 1: the autograd passes it ran.
    backwards = sent[("bwd_req", 1)] if smp.pp_rank() == 0 else len(passes)
    params = {n: p.detach().clone() for n, p in model.local_named_parameters()}
    return params, kept, backwards, module.hooked, fast


@pytest.mark.parametrize("mode", ["loop", "read_after", "read_before", "two_calls",
                                  "hook_before", "read_without_grad", "in_place"])
def test_a_chain_trains_as_one_process_does(mode):
    results = run_ranks(_train, 2, mode, timeout=120)
    want = _reference(mode)
    got = {}
    for params, kept, _, _, _ in results:
        got.update(params)
        assert kept == [0] * STEPS, kept
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    requests, passes = results[0][2], results[1][2]
    if mode in ("loop", "in_place"):
        # Five calls to pp_rank 1 per microbatch (four blocks and the head), one backward
        # request for them, the chain's, and one autograd pass on pp_rank 1: the calls took
        # each other's outputs into one graph there (which is also why a block may change its
        # input in place, as in one process).
        assert requests == STEPS * MICROBATCHES, requests
        assert passes == STEPS * MICROBATCHES, passes
        # Once the calls' outputs are predicted (after the first step's), each later call of
        # the chain (blocks[1:] and the head) takes the short path.
        assert results[0][4][1:] == [4 * MICROBATCHES] * (STEPS - 1), results[0][4]
    elif mode in ("read_before", "hook_before"):
        # The chain starts again at blocks[1], whose input glue had read (or hooked) first.
        assert requests == STEPS * MICROBATCHES * 2, requests
    if mode == "hook_before":
        assert results[0][3] == STEPS * MICROBATCHES, results[0][3]


def _hook_too_late(mode):
    try:
        _train(mode)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.parametrize("mode", ["hook_after", "hook_after_read"])
def test_a_hook_on_an_output_the_next_call_took_raises_naming_it(mode):
    """Its gradient never passes through pp_rank 0 whole: the hook would never run, or see a
    part of it."""
    results = run_ranks(_hook_too_late, 2, mode, timeout=120)
    assert results[0] is not None and "SMPRuntimeError" in results[0], results
    assert "module 'blocks.0'" in results[0] and "SMSHIM_MERGE_CHAINS=0" in results[0], results
    assert results[1] is not None, results  # (the other rank is told, and does not hang)


class _Criterion(nn.Module):
    def forward(self, logits, y):
        return F.cross_entropy(logits, y)


class _Probed(_Chained):
    """The loop with the loss on pp_rank 1 too (no glue waits for a value: a microbatch's
    forward code is over when it calls model.backward), noting at each microbatch 1 forward,
    from the second step on (no call waits for its outputs' shapes), whether microbatch 0's
    chain input, `inp`'s output on pp_rank 0, is still alive."""

    def __init__(self) -> None:
        super().__init__("loop")
        self.criterion = _Criterion()
        self.calls = 0
        self.alive: list = []
        self._previous = None

    def forward(self, x, y):
        h = self.inp(x)
        mb, step = self.calls % MICROBATCHES, self.calls // MICROBATCHES
        self.calls += 1
        if mb == 1 and step > 0:
            # (Polled a while: a thread that posted the frame carrying it may still be on its
            # way out. Before microbatch 1's forward is over, microbatch 0's backward cannot
            # free it.)
            deadline = time.monotonic() + 2.0
            while self._previous() is not None and time.monotonic() < deadline:
                time.sleep(0.01)
            self.alive.append(self._previous() is not None)
        self._previous = weakref.ref(h)
        for block in self.blocks:
            h = block(h)
        return self.criterion(self.head(h), y)


def _train_probed():
    import smdistributed.modelparallel.torch as smp

    torch.set_num_threads(1)
    # `simple`: microbatch 0 waits for its backward until microbatch 1's forward is over.
    smp.init({"pipeline_parallel_degree": 2, "microbatches": MICROBATCHES, "pipeline": "simple",
              "active_microbatches": MICROBATCHES, "auto_partition": False,
              "default_partition": 1})
    torch.manual_seed(0)
    module = _Probed()
    smp.set_partition(module.inp, 0)
    model = smp.DistributedModel(module)

    @smp.step
    def train_step(model, x, y):
        loss = model(x, y)
        model.backward(loss)
        return loss

    for x, y in _batches():
        train_step(model, x, y)
    return module.alive


def test_a_microbatch_waiting_for_its_backward_holds_no_chain_input():
    """A chain's input is what the node of a next call would stand on; once the microbatch's
    forward is over no call comes, and pp_rank 0 frees it (an activation per chain and
    microbatch in flight, which a call's node does not keep)."""
    alive, _ = run_ranks(_train_probed, 2, timeout=120)
    assert alive == [False] * (STEPS - 1), alive
