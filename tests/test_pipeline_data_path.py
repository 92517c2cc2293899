"""The pipeline's data path: results stay on the rank that computed them.

Glue code that reads values, values used twice, a module called twice, keyword and dict outputs
between remote modules, a stage's output returned from the step, a last batch smaller than the
others — all equal to single-process training; and the transport's own counters show that a
4-stage chain moves each activation and each gradient once, between neighbouring ranks.
"""

import copy
import os
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from smshim.testing import held_port, run_ranks
from tests.pipeline_models import Block, slow_backward

TOL = 1e-5
D = 16


class Two(nn.Module):
    """A dict output."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return {"p": torch.tanh(self.l1(x)), "q": self.l2(x)}


class Fuse(nn.Module):
    """Keyword inputs."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, p, q, scale=1.0):
        return self.lin(p * q) * scale


class GlueNet(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.a, self.b, self.c = Block(d), Block(d), Block(d)
        self.two, self.fuse = Two(d), Fuse(d)
        self.k1, self.k2 = nn.Linear(d, d), nn.Linear(d, d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.a(F.gelu(self.inp(x)))
        u = self.b(h)
        r = u + h  # a residual add in the glue, across a stage boundary
        if u.abs().mean().item() > 1e6:  # .item() drives an if (never taken)
            r = r * 0
        v = self.b(r, scale=0.5)  # a module called twice, with a keyword argument
        s = self.c(v)
        t = self.k1(s) + self.k2(s)  # an output used twice, on two ranks
        out = self.two(t)  # a dict output ...
        z = self.fuse(**out, scale=2.0)  # ... into another rank's module as keywords
        return {"logits": self.head(z), "hidden": s}


# pp rank of each module (pp = 3): every call crosses a boundary, and values hop 1 -> 2 -> 0 ...
GLUE_PLACEMENT = {"a": 0, "b": 1, "c": 2, "k1": 0, "k2": 2, "two": 1, "fuse": 2, "head": 1}
BATCHES = [8, 8, 8, 4]  # the last batch is smaller


def _glue_batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))
            for n in BATCHES]


def _glue_model():
    torch.manual_seed(0)
    return GlueNet()


def _glue_reference():
    model = _glue_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outputs = []
    for x, y in _glue_batches():
        opt.zero_grad()
        out = model(x)
        F.cross_entropy(out["logits"], y).backward()
        outputs.append((out["logits"].detach(), out["hidden"].detach()))
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}, outputs


def _glue_train(schedule):
    import smdistributed.modelparallel.torch as smp

    smp.init({"pipeline_parallel_degree": 3, "microbatches": 2, "pipeline": schedule,
              "active_microbatches": 2, "auto_partition": False, "default_partition": 0})
    module = _glue_model()
    model = smp.DistributedModel(module)
    for name, pid in GLUE_PLACEMENT.items():
        smp.set_partition(getattr(module, name), pid)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train_step(model, x, y):
        out = model(x)
        loss = F.cross_entropy(out["logits"], y)
        model.backward(loss)
        return out["logits"], out["hidden"]  # stage outputs (ranks 1 and 2) returned

    outputs = []
    for x, y in _glue_batches():
        opt.zero_grad()
        logits, hidden = train_step(model, x, y)
        opt.step()
        outputs.append((logits.concat(), hidden.concat()))
    return {"params": {n: p.detach().clone() for n, p in model.local_named_parameters()},
            "outputs": outputs}


def _check_glue(results):
    want_params, want_outputs = _glue_reference()
    got = {}
    for r in results:
        got.update(r["params"])
    assert set(got) == set(want_params)
    for n, p in want_params.items():
        assert (got[n] - p).abs().max().item() < TOL, n
    for r in results:  # every pipeline rank gets the step's outputs
        for (logits, hidden), (want_l, want_h) in zip(r["outputs"], want_outputs):
            assert logits.shape == want_l.shape and hidden.shape == want_h.shape
            assert (logits - want_l).abs().max().item() < TOL
            assert (hidden - want_h).abs().max().item() < TOL


def test_glue_code_across_stages_interleaved():
    _check_glue(run_ranks(_glue_train, 3, "interleaved", timeout=180))


def test_glue_code_across_stages_simple():
    _check_glue(run_ranks(_glue_train, 3, "simple", timeout=180))


def test_glue_code_across_stages_without_prediction():
    _check_glue(run_ranks(_glue_train, 3, "interleaved", timeout=180, env={"SMSHIM_PREDICT": "0"}))


def test_glue_code_across_stages_without_fused_weight_grads():
    _check_glue(run_ranks(_glue_train, 3, "interleaved", timeout=180,
                          env={"SMSHIM_FUSED_WGRAD": "0"}))


# ---- a stage whose input gradient nobody needs ----------------------------------------------

class _SlowLinear(nn.Linear):
    def forward(self, x):
        return slow_backward(super().forward(x), 0.3)  # pp_rank 0 has long finished the step by now


class FirstOnRank1(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _SlowLinear(D, D), nn.Linear(D, 3)

    def forward(self, x):
        return self.b(self.a(x))


def _first_on_rank1_batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, D, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(3)]


def test_stage_whose_input_gradient_nobody_needs_finishes_its_backward_in_the_step():
    """The first stage (on rank 1) sends no gradient back, so pp_rank 0 ends the step while its
    backward still runs; rank 1 must finish it before its step ends (and before reducing)."""
    cfg = {"pipeline_parallel_degree": 2, "microbatches": 2}
    _check_placed(FirstOnRank1, _first_on_rank1_batches, cfg, {"a": 1}, timeout=120)


# ---- trained with a placement, compared with single-process SGD ----------------------------

def _placed(make, cfg, placement):
    """`make()` (seeded) as an smp.DistributedModel under `cfg`, with its modules placed by
    `placement` (name -> pp rank) and the rest on pp rank 0."""
    import smdistributed.modelparallel.torch as smp

    smp.init({**cfg, "auto_partition": False, "default_partition": 0})
    torch.manual_seed(0)
    module = make()
    model = smp.DistributedModel(module)
    for name, pid in placement.items():
        smp.set_partition(module.get_submodule(name), pid)
    return model


def _train_placed(make, batches, cfg, placement):
    """Train `make()` under smp with `cfg` and modules placed by `placement` (name -> pp rank);
    this rank's parameters after the steps."""
    import smdistributed.modelparallel.torch as smp

    model = _placed(make, cfg, placement)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    for x, y in batches():
        opt.zero_grad()
        train_step(model, x, y)
        opt.step()
    return {n: p.detach().clone() for n, p in model.local_named_parameters()}


def _check_placed(make, batches, cfg, placement, timeout):
    """Every parameter equals single-process SGD training's on the same batches."""
    torch.manual_seed(0)
    ref = make()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches():
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
    got = {}
    for r in run_ranks(_train_placed, cfg["pipeline_parallel_degree"], make, batches, cfg,
                       placement, timeout=timeout):
        got.update(r)
    assert set(got) == {n for n, _ in ref.named_parameters()}
    for n, p in ref.named_parameters():
        assert (got[n] - p.detach()).abs().max().item() < TOL, n


def _loss_step():
    """The @smp.step for a model whose forward returns the loss (call after smp.init)."""
    import smdistributed.modelparallel.torch as smp

    @smp.step
    def train_step(model, x, y):
        loss = model(x, y)
        model.backward(loss)
        return loss

    return train_step


# ---- a weight of pp_rank 0's linear layer also used in its glue code ------------------------

class TiedGlue(nn.Module):
    """`proj`'s weight is also used in the root's own forward (as a tied weight is): autograd adds
    that use's gradient into `.grad` in the body's thread while the layer's own weight gradients
    are computed by another (weight_grad.py)."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.inp, self.proj = nn.Linear(8, d), nn.Linear(d, d)
        self.mid, self.head = Block(d), nn.Linear(d, 3)

    def forward(self, x):
        h = self.proj(torch.tanh(self.inp(x)))
        h = self.mid(h)
        return self.head(F.linear(h, self.proj.weight))  # the glue's use of proj's weight


def _tied_batches():
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g))
            for _ in range(3)]


def test_a_linear_weight_also_used_in_the_glue_code_gets_both_gradients():
    cfg = {"pipeline_parallel_degree": 2, "microbatches": 8, "pipeline": "interleaved"}
    _check_placed(TiedGlue, _tied_batches, cfg, {"mid": 1, "head": 1}, timeout=120)


# ---- a gradient sent to pp_rank 0 that its glue passes on unread -----------------------------

class PassedOn(nn.Module):
    """`u + 1` is computed on pp_rank 0, so `head`'s owner sends its input gradient there; the
    add's backward hands that gradient on, unread, to `mid`'s backward, which names it by key on
    the rank that computed it (found by the random-model sweep: tests/random_models.py)."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.inp, self.mid, self.head = nn.Linear(8, d), Block(d), nn.Linear(d, 3)

    def forward(self, x):
        u = self.mid(self.inp(x))
        return self.head(u + 1)


def test_a_gradient_sent_to_pp_rank_0_and_passed_on_unread_to_its_owner():
    cfg = {"pipeline_parallel_degree": 2, "microbatches": 2}
    _check_placed(PassedOn, _tied_batches, cfg, {"mid": 1, "head": 1}, timeout=120)


def test_a_gradient_sent_to_pp_rank_0_and_passed_on_unread_to_a_third_rank():
    cfg = {"pipeline_parallel_degree": 3, "microbatches": 2}
    _check_placed(PassedOn, _tied_batches, cfg, {"mid": 1, "head": 2}, timeout=120)


# ---- a 4-stage chain: who sends what to whom -----------------------------------------------

class LossStage(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.block = Block(d)
        self.out = nn.Linear(d, 3)

    def forward(self, h, y):
        return F.cross_entropy(self.out(self.block(h)), y)


class Chain(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.stages = nn.ModuleList([Block(d) for _ in range(3)])
        self.last = LossStage(d)

    def forward(self, x, y):
        for stage in self.stages:
            x = stage(x)
        return self.last(x, y)


def _chain(m, batch, steps):
    import smdistributed.modelparallel.torch as smp

    smp.init({"pipeline_parallel_degree": 4, "microbatches": m, "auto_partition": False,
              "default_partition": 0})
    torch.manual_seed(0)
    module = Chain()
    model = smp.DistributedModel(module)
    for i, stage in enumerate(module.stages):
        smp.set_partition(stage, i)
    smp.set_partition(module.last, 3)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    train_step = _loss_step()

    g = torch.Generator().manual_seed(5)
    before = None
    for i in range(steps):
        if i == steps - 1:  # count the last step only (the first ones learn output shapes)
            before = dict(model._pipeline.transport.sent_bytes)
        x, y = torch.randn(batch, D, generator=g), torch.randint(0, 3, (batch,), generator=g)
        train_step(model, x, y)
        opt.step()
        opt.zero_grad()
    after = model._pipeline.transport.sent_bytes
    return {key: n - before.get(key, 0) for key, n in after.items() if n - before.get(key, 0)}


def test_chain_moves_activations_and_gradients_only_between_neighbours():
    m, batch = 2, 8
    results = run_ranks(_chain, 4, m, batch, 3, timeout=180)
    act = (batch // m) * D * 4  # one microbatch's activation (or its gradient), fp32
    scalar = 4
    for src, by_kind in enumerate(results):
        sent = {}
        for (kind, dst), n in by_kind.items():
            if kind != "step_end":  # the step's results, which every rank receives
                sent[dst] = sent.get(dst, 0) + n
        for dst in range(4):
            got = sent.get(dst, 0)
            if abs(src - dst) == 1:
                # forward k -> k+1 and backward k+1 -> k: each microbatch's tensor, once
                assert got == m * act, (src, dst, got, by_kind)
            elif (src, dst) == (0, 3):
                # the targets, a step input the last stage reads, and the loss's gradient seed
                assert got == batch * 8 + m * scalar, (src, dst, got, by_kind)
            elif (src, dst) == (3, 0):
                assert got == m * scalar, (src, dst, got, by_kind)  # the losses the step returns
            else:
                assert got == 0, (src, dst, got, by_kind)


# ---- a stage's calls of one microbatch leave pp_rank 0 together ------------------------------

class Loop(nn.Module):
    """Blocks in a ModuleList looped over, the head computing the loss (the model as written)."""

    def __init__(self, d: int = D, n: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])
        self.head = nn.Linear(d, 3)

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x), y)


class LossHead(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.proj = nn.Linear(d, 3)

    def forward(self, x, y):
        return F.cross_entropy(self.proj(x), y)


class LossLoop(Loop):
    """The same, with the loss computed inside the head (on the last stage): pp_rank 0's glue
    reads no value, so nothing waits for a round trip."""

    def __init__(self) -> None:
        super().__init__()
        self.head = LossHead()

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return self.head(x, y)


def _loop_frames(m, steps, cls=Loop, pipeline="interleaved"):
    import smdistributed.modelparallel.torch as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": m, "auto_partition": False,
              "default_partition": 0, "pipeline": pipeline, "active_microbatches": m})
    torch.manual_seed(0)
    module = cls()
    model = smp.DistributedModel(module)
    for block in module.blocks[2:]:
        smp.set_partition(block, 1)
    smp.set_partition(module.head, 1)
    train_step = _loss_step()

    g = torch.Generator().manual_seed(5)
    counts = []  # per step after the first (which waits for output shapes): messages, frames
    for i in range(steps):
        if i:
            transport = model._pipeline.transport
            messages, frames = dict(transport.sent_messages), dict(transport.sent_frames)
        train_step(model, torch.randn(8, D, generator=g), torch.randint(0, 3, (8,), generator=g))
        if i:
            counts.append((
                {key: n - messages.get(key, 0) for key, n in transport.sent_messages.items()},
                {peer: n - frames.get(peer, 0) for peer, n in transport.sent_frames.items()}))
    return counts


class _SlowFirst(nn.Module):
    """pp_rank 0's stage, whose backward takes longer than a held message's deadline
    (`Transport.hold_s`), then a block and the loss on pp_rank 1."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.first = nn.Linear(d, d)
        self.block = Block(d)
        self.head = nn.Linear(d, 3)

    def forward(self, x, y):
        from smshim.modelparallel.torch.pipeline.transport import HOLD_S

        h = slow_backward(self.first(x), 1.5 * HOLD_S)
        return F.cross_entropy(self.head(self.block(h)), y)


def _drain_frames(m, steps):
    import smdistributed.modelparallel.torch as smp

    from smshim.modelparallel.torch.pipeline import transport as transport_module

    smp.init({"pipeline_parallel_degree": 2, "microbatches": m, "auto_partition": False,
              "default_partition": 0, "pipeline": "simple", "active_microbatches": m})
    torch.manual_seed(0)
    module = _SlowFirst()
    model = smp.DistributedModel(module)
    smp.set_partition(module.block, 1)
    smp.set_partition(module.head, 1)
    train_step = _loss_step()
    frames = []  # each frame pp_rank 0 posts: its messages' kinds
    real = transport_module.Transport._post_frame

    def post_frame(self, peer, msgs):
        frames.append(tuple(msg.kind for msg in msgs))
        return real(self, peer, msgs)

    transport_module.Transport._post_frame = post_frame
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        train_step(model, torch.randn(8, D, generator=g), torch.randint(0, 3, (8,), generator=g))
    return frames


def test_the_drains_microbatch_done_notices_leave_with_the_steps_end():
    # Once every microbatch's forward is over, no request comes that a notice could let the
    # peer admit: the notices of the microbatches that finish then wait for the next frame to
    # their peer or the step's end, which posts one to every peer, instead of leaving alone at
    # their deadline, here passed during each of pp_rank 0's backwards. (Under `simple` every
    # microbatch finishes in the drain: all forwards come first.)
    frames = run_ranks(_drain_frames, 2, 4, 3, timeout=120)[0]
    assert not [f for f in frames if set(f) == {"mb_done"}], frames
    assert sum(f.count("mb_done") for f in frames) == 4 * 3, frames


class _Near(nn.Linear):
    """pp_rank 0's own module, called after a call to pp_rank 1 that it does not read: records
    how many of its microbatch's requests wait in pp_rank 0's outbox for pp_rank 1 when it runs
    (not how many messages: the other microbatch's body may have queued its microbatch-done
    notice there, which waits for the next frame)."""

    held: list = []

    def forward(self, x):
        from smshim.modelparallel.torch.pipeline.context import ctx
        from smshim.modelparallel.torch.state import state

        box = state.model._pipeline.transport._outbox[1]
        with box.lock:
            requests = [m for m, _ in box.items
                        if m.kind == "fwd_req" and m.microbatch == ctx.microbatch]
        _Near.held.append(len(requests))
        return super().forward(x)


class Fork(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.before = Block(d)  # (pp_rank 0, before any call to pp_rank 1: finds nothing held)
        self.far = Block(d)
        self.near = _Near(d, d)

    def forward(self, x, y):
        x = self.before(x)
        far = self.far(x)  # (pp_rank 1: the request is held, to leave with what follows)
        near = self.near(x)  # (pp_rank 0: does not read `far`)
        return F.mse_loss(far + near, y)


def _fork_held(steps):
    import smdistributed.modelparallel.torch as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False,
              "default_partition": 0})
    torch.manual_seed(0)
    module = Fork()
    model = smp.DistributedModel(module)
    smp.set_partition(module.far, 1)
    train_step = _loss_step()
    g = torch.Generator().manual_seed(6)
    for _ in range(steps):
        train_step(model, torch.randn(8, D, generator=g), torch.randn(8, D, generator=g))
    if smp.pp_rank() != 0:
        return None
    held = list(_Near.held)
    copy.deepcopy(module.near)(torch.randn(2, D))  # (a copy's hook is inert: no transport)
    return held, len(module.near._forward_pre_hooks), len(module.before._forward_pre_hooks)


def test_a_held_request_leaves_before_pp_rank_0_runs_a_module_of_its_own_beside_it():
    # pp_rank 0 holds a call to another rank to leave with what follows it (`Transport.send`'s
    # `hold`); a module of its own that does not read the call's result must not keep it
    # waiting (it may compute for long), nor must the hold's deadline (local_flush.py). The
    # first step waits for the call's output shapes: nothing is held then. A module that runs
    # before any call to another rank (`before`) finds nothing held, and its hook goes.
    held, near_hooks, before_hooks = run_ranks(_fork_held, 2, 6, timeout=120)[0]
    assert len(held) == 12 and held[2:] == [0] * 10, held
    assert near_hooks == 1 and before_hooks == 0


def test_a_stages_calls_of_one_microbatch_leave_together():
    m = 4
    messages, frames = run_ranks(_loop_frames, 2, m, 3, timeout=180)[0][-1]
    # Per microbatch: one forward request carrying the chain of 5 calls (blocks 2-5, head) and
    # one backward request for it, fetching the loss, saying the microbatch is done; one frame
    # for the forward calls, one for the backward, one for the fetch (the microbatch-done notice
    # rides along with a later frame, or leaves on its own at the deadline). Sent one frame
    # each, they were 12.
    assert messages[("fwd_req", 1)] == m and messages[("bwd_req", 1)] == m, messages
    assert frames[1] <= 4 * m + 2, (frames, messages)


def test_a_microbatch_that_reads_no_value_costs_pp_rank_0_one_frame_to_the_next_stage():
    # The loss is computed on the last stage. Under `interleaved` (no wait between a
    # microbatch's forward code and its backward) its forward calls, the loss's fetch and its
    # backward calls leave in one frame, and the microbatch-done notice rides along with the
    # next one: m frames and the step's end, where they were 3 per microbatch (11-12 in all).
    # Under `simple` the forward calls leave before the body waits for every forward to be over
    # (6-9 frames, where they were 12). On a loaded machine a notice can reach its deadline
    # (`Transport.hold_s`) before the next frame goes and leave on its own: the bounds allow two.
    m = 4
    for pipeline, most in (("interleaved", m + 3), ("simple", 2 * m + 3)):
        counts = run_ranks(_loop_frames, 2, m, 4, LossLoop, pipeline, timeout=180)[0]
        for messages, _ in counts:
            assert messages[("fwd_req", 1)] == m and messages[("bwd_req", 1)] == m, messages
            assert messages[("mb_done", 1)] == m, messages
        # (The fewest over three steps.)
        assert min(frames[1] for _, frames in counts) <= most, (pipeline, counts)


def test_the_loss_comes_back_with_the_input_gradient():
    # The last stage pushes pp_rank 0 the gradient of its input in every microbatch's backward,
    # and pp_rank 0's backward waits for it: the loss's value, asked for with the backward's
    # requests, rides along with that gradient instead of a frame of its own (which cost both
    # ranks' CPU: 13 % of a step of tiny modules on one core each). Rank 1 then sends pp_rank 0
    # one frame per microbatch, where it was two; a value can reach its deadline on a loaded
    # machine (`Transport.hold_s`) and leave on its own: the bound allows two.
    m = 4
    for pipeline in ("interleaved", "simple"):
        counts = run_ranks(_loop_frames, 2, m, 4, LossLoop, pipeline, timeout=180)[1]
        for messages, _ in counts:
            assert messages[("value", 0)] == 2 * m, messages  # a gradient and a loss each
        assert min(frames[0] for _, frames in counts) <= m + 3, (pipeline, counts)


def _read_loss_after_backward(steps):
    import smdistributed.modelparallel.torch as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 1, "auto_partition": False,
              "default_partition": 0})
    torch.manual_seed(0)
    module = Chain()  # the loss computed on the last stage: a handle on pp_rank 0
    model = smp.DistributedModel(module)
    for stage in module.stages[1:]:
        smp.set_partition(stage, 1)
    smp.set_partition(module.last, 1)
    asked, read = [], []

    @smp.step
    def train_step(model, x, y):
        loss = model(x, y)
        model.backward(loss)
        transport = model._pipeline.transport
        before = transport.sent_messages[("fetch", 1)]
        read.append(loss.item())
        asked.append(transport.sent_messages[("fetch", 1)] - before)
        return loss

    g = torch.Generator().manual_seed(5)
    losses = [train_step(model, torch.randn(8, D, generator=g),
                         torch.randint(0, 3, (8,), generator=g)).reduce_mean().item()
              for _ in range(steps)]
    return asked, read, losses


def test_the_loss_is_fetched_while_its_backward_runs():
    # Its value is asked for with the backward request: reading it (or returning it from the
    # step) afterwards sends no request of its own and waits for no round trip.
    asked, read, losses = run_ranks(_read_loss_after_backward, 2, 2, timeout=180)[0]
    assert asked == [0, 0], asked
    assert read == losses


# ---- a dead peer is reported, naming it -----------------------------------------------------

DEAD_PEER_SCRIPT = r"""
import os, sys, time
import torch, torch.nn.functional as F
sys.path.insert(0, {root!r})
import smdistributed.modelparallel.torch as smp
from tests.pipeline_models import Net, batches, make_train_step

smp.init({{"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False,
          "default_partition": 0}})
module = Net()
model = smp.DistributedModel(module)
smp.set_partition(module.blocks[3], 1)
smp.set_partition(module.head, 1)
train_step = make_train_step("net")
for i, (x, y) in enumerate(batches("net", 4, 8)):
    if i == 2 and smp.pp_rank() == 1:
        module.blocks[3].lin.forward = lambda *a, **k: os._exit(9)  # dies inside its forward
    t0 = time.monotonic()
    try:
        train_step(model, x, y)
    except Exception as e:
        print("ERROR after %.1f s: %s" % (time.monotonic() - t0, e), flush=True)
        os._exit(0)
print("no error", flush=True)
"""


def test_dead_peer_is_reported_naming_it(tmp_path):
    script = tmp_path / "dead_peer.py"
    script.write_text(DEAD_PEER_SCRIPT.format(root=os.path.dirname(os.path.dirname(__file__))))
    procs = []
    with held_port() as port:
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS="1", SMSHIM_TIMEOUT="60")
            procs.append(subprocess.Popen([sys.executable, str(script)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        try:
            out0, _ = procs[0].communicate(timeout=120)
            procs[1].wait(timeout=30)
        finally:
            for p in procs:
                p.kill()
    assert procs[1].returncode == 9
    line = next((ln for ln in out0.splitlines() if ln.startswith("ERROR after")), None)
    assert line is not None, out0
    assert float(line.split()[2]) < 30, line  # within seconds, not at SMSHIM_TIMEOUT
    assert "pp rank 1" in line and "global rank 1" in line, line
    assert "microbatch" in line and "step 2" in line, line
    assert "blocks.3" in line or "head" in line, line
    assert "forward" in line or "backward" in line, line


# ---- a handle kept past its step says so ----------------------------------------------------

def _kept_past_step():
    import smdistributed.modelparallel.torch as smp

    model = _placed(Chain, {"pipeline_parallel_degree": 2, "microbatches": 1}, {"last": 1})
    kept = []

    @smp.step
    def train_step(model, x, y):
        loss = model(x, y)
        kept.append(model.module.last.block(x))  # a handle to a value on pp rank 1, kept
        model.backward(loss)
        return loss

    x, y = torch.randn(4, D), torch.randint(0, 3, (4,))
    returned = train_step(model, x, y).reduce_mean()
    if smp.pp_rank() != 0:
        return None
    try:
        kept[0].sum()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e), float(returned)
    return "no error"


def test_handle_kept_past_its_step_raises_at_once():
    t0 = time.monotonic()
    r0 = run_ranks(_kept_past_step, 2, timeout=120)[0]
    assert time.monotonic() - t0 < 60
    assert r0[0] == "SMPRuntimeError", r0
    assert "pp rank 1" in r0[1] and "return it from the step function" in r0[1], r0


# ---- nested calls: a module on rank 1 calls modules on ranks 2 and 0 ------------------------

class Outer(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.pre = nn.Linear(d, d)
        self.inner = Block(d)  # on another rank than Outer: a nested call
        self.back = nn.Linear(d, d)  # on pp rank 0: a call back into the driver

    def forward(self, x):
        h = torch.tanh(self.pre(x))
        h = self.inner(h) + h  # the nested result is read here
        return self.back(h)


class NestedNet(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.outer = Outer(d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        return self.head(self.outer(torch.relu(self.inp(x))))


def test_nested_calls_match_single_process():
    cfg = {"pipeline_parallel_degree": 3, "microbatches": 2, "pipeline": "interleaved",
           "active_microbatches": 2}
    placement = {"outer": 1, "outer.inner": 2, "outer.back": 0, "head": 2}
    _check_placed(NestedNet, _glue_batches, cfg, placement, timeout=180)


class CallsBack(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.lin, self.inner = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return self.inner(torch.tanh(self.lin(x))) + x


class CallsBackNet(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.inp, self.outer, self.head = nn.Linear(8, d), CallsBack(d), nn.Linear(d, 3)

    def forward(self, x):
        return self.head(self.outer(self.inp(x)))


def test_nested_calls_backward_comes_after_pp_rank_0_has_nothing_left_to_wait_for():
    """`inp` and `outer` on rank 1, `outer.inner` on rank 0: pp_rank 0 needs no gradient back,
    so its step is over once its backward requests are sent, while rank 1's backward of `outer`
    still has to call `inner`'s on rank 0, which must serve it before its step ends (found by
    the random-model sweep)."""
    cfg = {"pipeline_parallel_degree": 2, "microbatches": 2}
    placement = {"inp": 1, "outer": 1, "outer.inner": 0}
    _check_placed(CallsBackNet, _glue_batches, cfg, placement, timeout=180)


def test_nested_calls_under_the_deterministic_server():
    """Rank 2 gets `inp`'s backward from pp_rank 0 (which needs `outer`'s input gradient from
    rank 1) before rank 1's backward of `outer` calls `inner`'s on rank 2: the nested backward
    must not wait for its turn behind the request that waits for it (found by the random-model
    sweep)."""
    cfg = {"pipeline_parallel_degree": 3, "microbatches": 2, "deterministic_server": True}
    placement = {"inp": 2, "outer": 1, "outer.inner": 2}
    _check_placed(CallsBackNet, _glue_batches, cfg, placement, timeout=120)


class DeadNested(NestedNet):
    def forward(self, x):
        h = torch.relu(self.inp(x))
        self.outer(h)  # a result nobody reads: pp_rank 0 does not wait for it
        return self.head(h)


def test_a_nested_call_whose_result_nobody_reads_is_served_within_its_step():
    """pp_rank 0 may end the step before rank 1 has even run `outer`, whose nested calls into
    ranks 0 and 2 must still be served in that step (found by the random-model sweep)."""
    cfg = {"pipeline_parallel_degree": 3, "microbatches": 2}
    placement = {"outer": 1, "outer.inner": 2, "outer.back": 0, "head": 2}
    _check_placed(DeadNested, _glue_batches, cfg, placement, timeout=180)


# ---- a step called under torch.no_grad() --------------------------------------------------

class _GradModeSeen(nn.Linear):
    """Records the grad mode each call runs under, on the rank that runs it."""

    seen: list = []

    def forward(self, x):
        _GradModeSeen.seen.append(torch.is_grad_enabled())
        return super().forward(x)


class _GradModeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _GradModeSeen(8, D), _GradModeSeen(D, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _grad_mode_steps():
    import smdistributed.modelparallel.torch as smp

    model = _placed(_GradModeNet, {"pipeline_parallel_degree": 2, "microbatches": 2}, {"b": 1})

    @smp.step
    def forward_only(model, x):
        return model(x)

    x = _glue_batches()[0][0]
    seen = {}
    for mode in (False, True):
        _GradModeSeen.seen.clear()
        with torch.set_grad_enabled(mode):
            out = forward_only(model, x).concat()
        seen[mode] = list(_GradModeSeen.seen)
    return {"seen": seen, "out": out}


def test_a_step_called_under_no_grad_builds_no_graph_on_any_rank():
    """The caller's grad mode holds in the step body (which pp_rank 0 runs in worker threads)
    and in the modules it calls on other ranks, as it does with pp = 1."""
    results = run_ranks(_grad_mode_steps, 2, timeout=120)
    torch.manual_seed(0)
    want = _GradModeNet()(_glue_batches()[0][0]).detach()
    for rank, r in enumerate(results):
        assert r["seen"][False] == [False, False], (rank, r["seen"])  # 2 microbatches
        assert r["seen"][True] == [True, True], (rank, r["seen"])
        assert (r["out"] - want).abs().max().item() < TOL
