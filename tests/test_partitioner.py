"""The automatic partitioner, in-process: tracing, the contiguous split, device allocation,
containers, tied weights."""

import torch
import torch.nn as nn

from smshim.modelparallel.torch.pipeline.partitioner import (auto_assignment, proportional_devices,
                                                     split_contiguous, trace_modules)
from tests.pipeline_models import Block, Net


class GPTLike(nn.Module):
    def __init__(self, vocab=32, d=16, n=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tok):
        h = self.embed(tok)
        for b in self.blocks:
            h = b(h)
        return self.head(self.ln(h))


def _assign(model, x, pp, mw=0.5):
    with torch.no_grad():
        trace = trace_modules(model, lambda: model(x), times=False)
    return auto_assignment(model, trace, pp, mw, times=False)


def test_split_contiguous_minimises_the_largest_group():
    assert split_contiguous([1, 1, 1, 1], 2) == [2, 2]
    assert split_contiguous([4, 1, 1, 1, 1], 2) == [1, 4]
    assert split_contiguous([1, 2, 3], 5) == [1, 1, 1]  # never more groups than items


def test_devices_in_proportion_to_cost():
    assert proportional_devices([3.0, 1.0], 4) == [3, 1]
    assert proportional_devices([1.0, 1.0], 2) == [1, 1]
    assert sum(proportional_devices([5.0, 0.1, 0.1], 8)) == 8


def test_blocks_in_a_module_list_are_spread_and_tied_modules_stay_together():
    model = GPTLike()
    for pp in (2, 4):
        a = _assign(model, torch.randint(0, 32, (2, 6)), pp)
        blocks = [a[f"blocks.{i}"] for i in range(8)]
        assert set(blocks) == set(range(pp)), blocks  # every stage gets blocks
        assert blocks == sorted(blocks)  # in execution order
        assert a["embed"] == a["head"] == 0  # tied: with the first to run
        assert a["blocks"] == blocks[0]  # the container goes with its first member
        assert a[""] == 0


def test_every_module_is_assigned_and_submodules_follow_their_block():
    model = Net(n_blocks=4)
    a = _assign(model, torch.randn(4, 8), 2)
    assert set(a) == {n for n, _ in model.named_modules()}
    for i in range(4):
        assert a[f"blocks.{i}.lin"] == a[f"blocks.{i}"] == a[f"blocks.{i}.norm"]


class _Leaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)


class _Mid(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Leaf()


class _Top(nn.Module):
    def __init__(self):
        super().__init__()
        self.outer = nn.Module()
        self.outer.mid = _Mid()


def test_a_module_on_pp_rank_0_nested_in_another_ranks_may_not_call_a_third_rank():
    from smshim.modelparallel.torch.errors import SMPValidationError
    from smshim.modelparallel.torch.pipeline.partitioner import manual_assignment, set_partition

    top = _Top()
    set_partition(top.outer, 1)
    set_partition(top.outer.mid, 0)
    set_partition(top.outer.mid.inner, 2)
    try:
        manual_assignment(top, 3, 0)
    except SMPValidationError as e:
        msg = str(e)
        assert "'outer.mid' is on pp rank 0 inside 'outer' (pp rank 1)" in msg, msg
        assert "'outer.mid.inner' is on pp rank 2" in msg and "set_partition" in msg, msg
    else:
        raise AssertionError("no error for a call chain rank 1 -> 0 -> 2")
    set_partition(top.outer.mid.inner, 0)  # rank 1 -> 0 only: fine
    assert manual_assignment(top, 3, 0)["outer.mid.inner"] == 0


class _TiedHead(nn.Module):
    """Owns a weight tied to the embedding, and a child of its own."""

    def __init__(self, embed: nn.Embedding):
        super().__init__()
        self.weight = embed.weight
        self.norm = nn.LayerNorm(embed.embedding_dim)

    def forward(self, h):
        return self.norm(h) @ self.weight.t()


class _Body(nn.Module):
    def __init__(self, embed: nn.Embedding, n: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList([Block(embed.embedding_dim) for _ in range(n)])
        self.head = _TiedHead(embed)

    def forward(self, h):
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class _TiedInsideBody(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.body = _Body(self.embed)

    def forward(self, tok):
        return self.body(self.embed(tok))


def test_the_automatic_partition_refuses_a_tied_module_pulled_to_pp_rank_0_inside_another_rank():
    # The body goes to pp rank 1, its tied head follows the embedding to pp rank 0, and the
    # head's norm stays on 1: pp rank 1 -> 0 -> 1, which the engine cannot follow.
    from smshim.modelparallel.torch.errors import SMPValidationError

    model = _TiedInsideBody()
    try:
        a = _assign(model, torch.randint(0, 32, (2, 6)), 2)
    except SMPValidationError as e:
        msg = str(e)
        assert msg.startswith("automatic partition: module 'body.head' is on pp rank 0 (it "
                              "shares a parameter with a module there) inside 'body' (pp rank 1)"), msg
        assert "'body.head.norm' is on pp rank 1" in msg and "auto_partition: False" in msg, msg
    else:
        raise AssertionError(f"no error for a call chain rank 1 -> 0 -> 1: {a}")


class _TiedInList(nn.Module):
    """The output projection, tied to the embedding, is the last member of the body's ModuleList."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.body = nn.Module()
        self.body.layers = nn.ModuleList([Block(16) for _ in range(3)] + [nn.Linear(16, 32)])
        self.body.layers[3].weight = self.embed.weight
        self.body.forward = self._body

    def _body(self, h):
        for layer in self.body.layers[:3]:
            h = layer(h)
        return self.body.layers[3](h)

    def forward(self, tok):
        return self.body(self.embed(tok))


def test_a_tied_module_pulled_to_pp_rank_0_that_calls_nothing_further_is_fine():
    # pp rank 1's body calls the projection on pp rank 0 (a nested call), which calls nothing.
    a = _assign(_TiedInList(), torch.randint(0, 32, (2, 6)), 2)
    assert a["body"] == a["body.layers"] == a["body.layers.0"] == 1, a
    assert a["body.layers.3"] == a["embed"] == 0, a
