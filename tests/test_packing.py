"""A step's results travel to the other pp ranks packed (pipeline/packing.py): the small tensors
that share a dtype, device and shape as one stack. Every rank gets the values rank 0 returns."""

import torch
import torch.nn as nn

from smshim.modelparallel.torch.pipeline.packing import pack, unpack
from smshim.testing import run_ranks


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device \
        and torch.equal(a, b)


def test_scalars_of_one_kind_travel_as_one_tensor():
    losses = [torch.tensor(float(i) / 3) for i in range(8)]
    spec, packed = pack(losses)
    assert len(packed) == 1 and packed[0].shape == (8,)
    out = unpack(spec, packed)
    assert len(out) == 8 and all(_same(a, b) for a, b in zip(out, losses))


def test_mixed_kinds_keep_their_dtype_shape_and_order():
    big = torch.randn(40, 40)  # more than _PACK_NUMEL elements: sent as it is
    tensors = []
    for i in range(3):
        tensors += [torch.tensor(1.5 * i), torch.tensor([i, i + 1]), torch.randn(2, 3).half(),
                    torch.tensor(i % 2 == 0)]
    tensors.insert(5, big)
    spec, packed = pack(tensors)
    assert len(packed) == 5  # four stacks and the large tensor
    assert any(p is big for p in packed)
    out = unpack(spec, packed)
    assert len(out) == len(tensors) and all(_same(a, b) for a, b in zip(out, tensors))


def test_nothing_to_share_sends_the_tensors_as_they_are():
    tensors = [torch.tensor(1.0), torch.tensor([1, 2]), torch.randn(2000)]
    spec, packed = pack(tensors)
    assert spec is None and packed is tensors
    assert unpack(spec, packed) is tensors
    assert pack([]) == (None, [])


def test_a_result_in_a_graph_travels_as_its_value():
    w = torch.ones(3, requires_grad=True)
    losses = [(w * i).sum() for i in range(4)]
    spec, packed = pack(losses)
    assert not packed[0].requires_grad and packed[0].grad_fn is None
    assert [float(t) for t in unpack(spec, packed)] == [0.0, 3.0, 6.0, 9.0]


def test_sparse_and_nested_tensors_are_not_stacked():
    s = torch.eye(3).to_sparse()
    n = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    tensors = [s, torch.tensor(1.0), n, torch.tensor(2.0)]
    spec, packed = pack(tensors)
    assert packed[spec[0][0]] is s and packed[spec[2][0]] is n
    out = unpack(spec, packed)
    assert out[0] is s and out[2] is n and [float(out[1]), float(out[3])] == [1.0, 2.0]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _results(m: int):
    import smdistributed.modelparallel.torch as smp

    smp.init({"pipeline_parallel_degree": 3, "microbatches": m, "auto_partition": False,
              "default_partition": 0})
    torch.manual_seed(0)
    module = _Net()
    model = smp.DistributedModel(module)
    smp.set_partition(module.b, 1)
    smp.set_partition(module.c, 2)

    @smp.step
    def step(model, x, y):
        out = model(x)
        loss = nn.functional.cross_entropy(out, y)
        model.backward(loss)
        # a loss, an int count, a half-precision tensor, a large one and a plain float each
        return {"loss": loss, "right": (out.argmax(-1) == y).sum(), "half": out.half(),
                "big": torch.full((1100,), float(loss)), "k": 2.5}

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4 * m, 4, generator=g), torch.randint(0, 3, (4 * m,), generator=g)
    out = step(model, x, y)  # (a dict of StepOutputs, and a list for the float)
    return {k: list(v.outputs) if hasattr(v, "outputs") else v for k, v in out.items()}


def test_every_rank_gets_rank_0s_results():
    results = run_ranks(_results, 3, 4, timeout=120)
    first = results[0]
    assert first["k"] == [2.5] * 4 and len(first["loss"]) == 4
    for rank, got in enumerate(results[1:], start=1):
        assert got.keys() == first.keys() and got["k"] == first["k"], rank
        for key in ("loss", "right", "half", "big"):
            for mb, (a, b) in enumerate(zip(first[key], got[key])):
                assert _same(a, b), (rank, mb, key, a, b)
