"""Splitting of @smp.step inputs into microbatches and joining of the per-microbatch outputs."""

import collections
import re

import pytest
import torch

from smshim.modelparallel.torch.errors import TensorSplitError
from smshim.modelparallel.torch.pipeline.microbatch import StepOutput, join_step_outputs, split_step_inputs

Pair = collections.namedtuple("Pair", ["x", "y"])


# ------------------------------------------------------------------------------------------------
# StepOutput
# ------------------------------------------------------------------------------------------------

def test_stepoutput_sequence_protocol_and_repr():
    outs = [torch.tensor(1.0), torch.tensor(3.0)]
    so = StepOutput(outs)
    assert so.outputs == outs
    assert len(so) == 2
    assert so[1] is outs[1]
    assert list(so) == outs
    r = repr(so)
    assert "StepOutput" in r and "num_microbatches=2" in r and "3" in r
    assert "shape=(2, 3)" in repr(StepOutput([torch.zeros(2, 3)]))


def test_stepoutput_reductions_on_scalar_losses():
    so = StepOutput([torch.tensor(1.0), torch.tensor(2.0), torch.tensor(6.0)])
    mean = so.reduce_mean()
    assert mean.dim() == 0 and mean.item() == pytest.approx(3.0)
    assert so.reduce_sum().item() == pytest.approx(9.0)
    assert torch.equal(so.stack(), torch.tensor([1.0, 2.0, 6.0]))
    # 0-dim tensors cannot be concatenated; concat stacks them instead.
    assert torch.equal(so.concat(), torch.tensor([1.0, 2.0, 6.0]))


def test_stepoutput_reductions_on_batches():
    a = torch.arange(6.0).view(2, 3)
    b = torch.arange(6.0, 12.0).view(2, 3)
    so = StepOutput([a, b])
    assert torch.equal(so.concat(), torch.cat([a, b]))
    assert so.stack().shape == (2, 2, 3)
    assert torch.allclose(so.reduce_mean(), (a + b) / 2)
    assert torch.equal(so.reduce_sum(), a + b)
    # Integer tensors: the mean is still computed (as floating point).
    ints = StepOutput([torch.tensor(1), torch.tensor(2)])
    assert ints.reduce_mean().item() == pytest.approx(1.5)
    assert ints.reduce_sum().item() == 3


def test_stepoutput_map_and_detach():
    w = torch.tensor(2.0, requires_grad=True)
    so = StepOutput([w * 1.0, w * 3.0])
    assert all(t.requires_grad for t in so)
    mapped = so.map(lambda t: t + 1)
    assert isinstance(mapped, StepOutput)
    assert [t.item() for t in mapped] == [3.0, 7.0]
    det = so.detach()
    assert isinstance(det, StepOutput) and det is not so
    assert not any(t.requires_grad for t in det)
    assert so[0].requires_grad  # the original is untouched
    # The Hugging Face idiom.
    assert torch.equal(so.detach().concat(), torch.tensor([2.0, 6.0]))


def test_stepoutput_empty_reduction_is_an_error():
    with pytest.raises(ValueError, match="empty"):
        StepOutput([]).reduce_mean()


# ------------------------------------------------------------------------------------------------
# split_step_inputs
# ------------------------------------------------------------------------------------------------

def _call_all(fn, splits):
    return [fn(*a, **k) for a, k in splits]


def test_split_positional_and_keyword_tensors():
    def step(model, x, y=None):
        return x, y

    x = torch.arange(8).view(8, 1)
    y = torch.arange(8)
    splits = split_step_inputs(step, ("model", x), {"y": y}, 4)
    assert len(splits) == 4
    for mb, (args, kwargs) in enumerate(splits):
        assert args[0] == "model"  # non-tensors pass unchanged
        assert torch.equal(args[1], x[2 * mb:2 * mb + 2])
        assert torch.equal(kwargs["y"], y[2 * mb:2 * mb + 2])
    # Pieces are views, not copies.
    assert splits[1][0][1].data_ptr() == x[2:].data_ptr()


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_split_pieces_take_an_in_place_op_with_grad(axis):
    # A step function may add a parameter to its input in place; a piece from split() or
    # chunk() (views of a multi-output op) would refuse it, a slice or narrow() view does not.
    def step(x):
        return x

    w = torch.ones(1, requires_grad=True)
    x = torch.zeros(4, 4)
    args, _ = split_step_inputs(step, (x,), {}, 2, input_split_axes={"x": axis})[0]
    args[0].add_(w)
    args[0].sum().backward()
    assert w.grad.item() == 8.0


def test_split_recurses_and_preserves_container_types():
    def step(batch):
        return batch

    batch = {
        "pair": Pair(torch.arange(4), [torch.arange(8).view(4, 2), "tag"]),
        "nested": collections.OrderedDict(ids=torch.arange(4) * 10, meta={"mask": torch.ones(4, 3)}),
        "tup": (torch.arange(4), 5, None),
    }
    results = _call_all(step, split_step_inputs(step, (batch,), {}, 2))
    for mb, out in enumerate(results):
        sl = slice(2 * mb, 2 * mb + 2)
        assert type(out) is dict
        assert type(out["pair"]) is Pair
        assert torch.equal(out["pair"].x, torch.arange(4)[sl])
        assert type(out["pair"].y) is list
        assert torch.equal(out["pair"].y[0], torch.arange(8).view(4, 2)[sl])
        assert out["pair"].y[1] == "tag"
        assert type(out["nested"]) is collections.OrderedDict
        assert torch.equal(out["nested"]["ids"], (torch.arange(4) * 10)[sl])
        assert out["nested"]["meta"]["mask"].shape == (2, 3)
        assert type(out["tup"]) is tuple and out["tup"][1:] == (5, None)


class _Encoding(collections.UserDict):
    """Like Hugging Face's BatchEncoding: a Mapping that is not a dict."""


def test_split_user_mapping_keeps_type():
    def step(inputs):
        return inputs

    enc = _Encoding(input_ids=torch.arange(6).view(6, 1), attention_mask=torch.ones(6, 2))
    out = _call_all(step, split_step_inputs(step, (enc,), {}, 3))
    assert all(type(o) is _Encoding for o in out)
    assert torch.equal(out[2]["input_ids"], torch.tensor([[4], [5]]))
    assert out[0]["attention_mask"].shape == (2, 2)


def test_split_defaultdict_keeps_factory():
    def step(d):
        return d

    d = collections.defaultdict(list, {"x": torch.arange(4)})
    out = _call_all(step, split_step_inputs(step, (d,), {}, 2))
    assert isinstance(out[0], collections.defaultdict) and out[0].default_factory is list
    assert torch.equal(out[1]["x"], torch.tensor([2, 3]))


def test_input_split_axes_non_zero_axis():
    def step(x, y):
        return x, y

    x = torch.arange(24).view(2, 6, 2)
    y = torch.arange(6)
    splits = split_step_inputs(step, (x, y), {}, 3, input_split_axes={"x": 1})
    for mb, (args, _) in enumerate(splits):
        assert args[0].shape == (2, 2, 2)
        assert torch.equal(args[0], x[:, 2 * mb:2 * mb + 2, :])
        assert torch.equal(args[1], y[2 * mb:2 * mb + 2])  # other arguments keep axis 0
    # Negative axes work too; the axis applies to every tensor inside the named argument.
    splits = split_step_inputs(step, ({"a": torch.ones(3, 4)}, y), {}, 2, input_split_axes={"x": -1})
    assert splits[0][0][0]["a"].shape == (3, 2)


def test_non_split_inputs_pass_whole():
    def step(x, labels, scale):
        return x, labels, scale

    x, labels, scale = torch.arange(4), torch.arange(3), torch.ones(5)
    splits = split_step_inputs(step, (x, labels), {"scale": scale}, 2, non_split_inputs=["labels", "scale"])
    for mb, (args, kwargs) in enumerate(splits):
        assert torch.equal(args[0], x[2 * mb:2 * mb + 2])
        assert args[1] is labels  # 3 rows would not divide: it must not even be looked at
        assert kwargs["scale"] is scale


def test_zero_dim_tensor_and_other_objects_pass_whole():
    def step(x, lr, name, obj):
        return x, lr, name, obj

    lr = torch.tensor(0.1)
    obj = object()
    splits = split_step_inputs(step, (torch.arange(2), lr, "n", obj), {}, 2)
    for args, _ in splits:
        assert args[1] is lr and args[2] == "n" and args[3] is obj


class _Sliceable:
    def __init__(self, data):
        self.data = data
        self.calls = []

    def smp_slice(self, num_mb, mb, axis):
        self.calls.append((num_mb, mb, axis))
        return ("slice", self.data, mb)


def test_smp_slice_objects_are_sliced_by_their_method():
    def step(a, b):
        return a, b

    s1, s2 = _Sliceable("a"), _Sliceable("b")
    splits = split_step_inputs(step, ([s1],), {"b": s2}, 3, input_split_axes={"b": 2})
    assert [a[0][0] for a, _ in splits] == [("slice", "a", 0), ("slice", "a", 1), ("slice", "a", 2)]
    assert s1.calls == [(3, 0, 0), (3, 1, 0), (3, 2, 0)]
    assert s2.calls == [(3, 0, 2), (3, 1, 2), (3, 2, 2)]


def test_stepoutput_as_input():
    def step(prev, x):
        return prev, x

    prev = StepOutput([torch.tensor(float(i)) for i in range(3)])
    splits = split_step_inputs(step, (prev, torch.arange(6)), {}, 3)
    assert [a[0].item() for a, _ in splits] == [0.0, 1.0, 2.0]
    # Nested inside a container as well.
    splits = split_step_inputs(step, ({"p": prev}, torch.arange(6)), {}, 3)
    assert splits[2][0][0]["p"].item() == 2.0
    # non_split_inputs passes the StepOutput itself.
    splits = split_step_inputs(step, (prev, torch.arange(6)), {}, 3, non_split_inputs=["prev"])
    assert splits[0][0][0] is prev


def test_stepoutput_input_with_wrong_count():
    def step(prev):
        return prev

    with pytest.raises(TensorSplitError, match=r"prev.*2 entries.*3 microbatches"):
        split_step_inputs(step, (StepOutput([1, 2]),), {}, 3)


def test_tensor_split_error_message():
    def step(model, batch):
        return batch

    batch = {"input_ids": torch.zeros(5, 7), "labels": torch.zeros(4)}
    with pytest.raises(TensorSplitError) as ei:
        split_step_inputs(step, (None, batch), {}, 2)
    msg = str(ei.value)
    assert isinstance(ei.value, ValueError)
    assert "batch['input_ids']" in msg
    assert "size along axis 0 is 5" in msg
    assert "2 microbatches" in msg
    assert "drop_last=True" in msg

    with pytest.raises(TensorSplitError, match=r"x.*axis 1 is 3.*drop_last"):
        split_step_inputs(lambda x: x, (torch.zeros(4, 3),), {}, 2, input_split_axes={"x": 1})
    with pytest.raises(TensorSplitError, match=r"x\[0\].*axis 2.*only 1 dimension"):
        split_step_inputs(lambda x: x, ([torch.zeros(4)],), {}, 2, input_split_axes={"x": 2})


def test_var_args_and_var_kwargs():
    def step(model, *tensors, flag=False, **inputs):
        return model, tensors, flag, inputs

    t = torch.arange(4)
    splits = split_step_inputs(
        step, ("m", t, t * 2), {"flag": True, "input_ids": t * 3, "mask": torch.ones(2, 4), "keep": t},
        2, non_split_inputs=["keep"], input_split_axes={"mask": 1},
    )
    outs = _call_all(step, splits)
    for mb, (model, tensors, flag, inputs) in enumerate(outs):
        sl = slice(2 * mb, 2 * mb + 2)
        assert model == "m" and flag is True
        assert torch.equal(tensors[0], t[sl]) and torch.equal(tensors[1], (t * 2)[sl])
        assert torch.equal(inputs["input_ids"], (t * 3)[sl])
        assert inputs["mask"].shape == (2, 2)
        assert inputs["keep"] is t

    # The *args name covers every positional extra.
    splits = split_step_inputs(step, ("m", torch.arange(3)), {}, 2, non_split_inputs=["tensors"])
    assert splits[0][0][1].shape == (3,)


def test_unknown_names_are_rejected():
    def step(model, batch):
        return batch

    with pytest.raises(ValueError, match="'labels'"):
        split_step_inputs(step, (None, torch.zeros(2)), {}, 2, non_split_inputs=["labels"])
    with pytest.raises(ValueError, match="'inputs'"):
        split_step_inputs(step, (None, torch.zeros(2)), {}, 2, input_split_axes={"inputs": 1})
    with pytest.raises(TypeError):
        split_step_inputs(step, (None, torch.zeros(2)), {}, 2, input_split_axes={"batch": "1"})
    # Wrong call against the signature.
    with pytest.raises(TypeError, match="step"):
        split_step_inputs(step, (1, 2, 3), {}, 2)
    with pytest.raises(ValueError, match="num_microbatches"):
        split_step_inputs(step, (1, 2), {}, 0)


def test_single_name_string_for_non_split_inputs():
    def step(a, b):
        return a, b

    a = torch.arange(3)
    splits = split_step_inputs(step, (a, torch.arange(2)), {}, 2, non_split_inputs="a")
    assert splits[1][0][0] is a


def test_one_microbatch_passes_everything():
    def step(x, y=3):
        return x, y

    x = torch.arange(5)
    ((args, kwargs),) = split_step_inputs(step, (x,), {}, 1)
    assert torch.equal(args[0], x) and kwargs == {}


def test_split_keeps_autograd_connection():
    w = torch.ones(4, requires_grad=True)

    def step(x):
        return x.sum()

    x = w * 2
    total = sum(_call_all(step, split_step_inputs(step, (x,), {}, 2)))
    total.backward()
    assert torch.equal(w.grad, torch.full((4,), 2.0))


# ------------------------------------------------------------------------------------------------
# join_step_outputs
# ------------------------------------------------------------------------------------------------

def test_join_dicts_of_tensors_and_floats():
    w = torch.tensor(1.0, requires_grad=True)
    per_mb = [
        {"loss": w * (i + 1), "logits": torch.full((2, 3), float(i)), "acc": 0.5 * i, "n": i, "name": "x", "opt": None}
        for i in range(3)
    ]
    out = join_step_outputs(per_mb, detach=True)
    assert type(out) is dict and list(out) == ["loss", "logits", "acc", "n", "name", "opt"]
    assert isinstance(out["loss"], StepOutput) and len(out["loss"]) == 3
    assert out["loss"].reduce_mean().item() == pytest.approx(2.0)
    assert not any(t.requires_grad for t in out["loss"])
    assert out["logits"].concat().shape == (6, 3)
    assert out["acc"] == [0.0, 0.5, 1.0] and type(out["acc"]) is list
    assert out["n"] == [0, 1, 2]
    assert out["name"] == ["x", "x", "x"]
    assert out["opt"] is None


def test_join_without_detach_keeps_graph():
    w = torch.tensor(2.0, requires_grad=True)
    out = join_step_outputs([w * 1.0, w * 2.0], detach=False)
    assert isinstance(out, StepOutput)
    assert all(t.requires_grad for t in out)
    out.reduce_sum().backward()
    assert w.grad.item() == pytest.approx(3.0)
    out2 = join_step_outputs([w * 1.0, w * 2.0], detach=True)
    assert not any(t.requires_grad for t in out2)


def test_join_preserves_nested_types():
    per_mb = [(Pair(torch.tensor(float(i)), [torch.ones(1) * i, 1.5]), collections.OrderedDict(a=torch.zeros(2)))
              for i in range(2)]
    out = join_step_outputs(per_mb, detach=True)
    assert type(out) is tuple
    assert type(out[0]) is Pair and isinstance(out[0].x, StepOutput)
    assert out[0].x.stack().tolist() == [0.0, 1.0]
    assert type(out[0].y) is list and isinstance(out[0].y[0], StepOutput) and out[0].y[1] == [1.5, 1.5]
    assert type(out[1]) is collections.OrderedDict and isinstance(out[1]["a"], StepOutput)


def test_join_none_and_single_tensor():
    assert join_step_outputs([None, None], detach=True) is None
    out = join_step_outputs([torch.tensor(1.0)], detach=True)
    assert isinstance(out, StepOutput) and len(out) == 1
    # None mixed with plain values is a per-microbatch list.
    assert join_step_outputs([None, 1.0], detach=True) == [None, 1.0]
    with pytest.raises(ValueError):
        join_step_outputs([], detach=True)


@pytest.mark.parametrize(
    "per_mb, pattern",
    [
        ([{"loss": torch.tensor(1.0)}, {"loss": torch.tensor(1.0), "acc": 1.0}],
         r"at output, microbatch 0 returned a dict with keys \['loss'\] but microbatch 1 returned a dict with "
         r"keys \['loss', 'acc'\]; extra key\(s\) 'acc'"),
        ([(torch.tensor(1.0), 2), (torch.tensor(1.0), 2), (torch.tensor(1.0),)],
         r"microbatch 0 returned a tuple of length 2 but microbatch 2 returned a tuple of length 1"),
        ([{"loss": torch.tensor(1.0)}, {"loss": 1.0}],
         r"output\['loss'\], microbatch 0 returned a tensor of shape \(\) but microbatch 1 returned a float"),
        ([{"x": [torch.ones(1)]}, {"x": (torch.ones(1),)}],
         r"output\['x'\].*list of length 1.*microbatch 1 returned a tuple of length 1"),
        ([torch.ones(1), None], r"microbatch 1 returned None"),
    ],
)
def test_join_structure_mismatch_names_microbatch(per_mb, pattern):
    with pytest.raises(ValueError, match=pattern):
        join_step_outputs(per_mb, detach=True)


def test_split_then_join_roundtrip():
    def step(batch):
        return {"out": batch["x"] * 2, "rows": batch["x"].shape[0]}

    x = torch.arange(12.0).view(6, 2)
    splits = split_step_inputs(step, ({"x": x},), {}, 3)
    joined = join_step_outputs(_call_all(step, splits), detach=True)
    assert torch.equal(joined["out"].concat(), x * 2)
    assert joined["rows"] == [2, 2, 2]
    assert re.search(r"StepOutput\(num_microbatches=3", repr(joined["out"]))
