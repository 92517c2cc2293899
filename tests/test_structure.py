"""structure.py: flatten / fill, whose common cases skip the generic walk, give what the walk
gives."""

import pickle
from collections import namedtuple

import torch

from smshim.modelparallel.torch.pipeline import structure as st

Pair = namedtuple("Pair", "a b")


def _walked(obj):
    tensors = []

    def to_slot(leaf):
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            return st._Slot(len(tensors) - 1)
        return leaf

    return st._map_leaves(obj, to_slot), tensors


def test_flatten_and_fill_agree_with_the_generic_walk():
    x, y = torch.randn(2), torch.randn(3)
    cases = [x, ((x,), {}), ((x, y), {}), ((), {}), ((x, 3), {}), ((x,), {"k": y}),
             (Pair(x, y), {}), [x, y], {"a": x, "b": (y, None)}, ((x, y),), "text"]
    for obj in cases:
        template, tensors = st.flatten(obj)
        expected_template, expected_tensors = _walked(obj)
        assert pickle.dumps(template) == pickle.dumps(expected_template), obj
        assert len(tensors) == len(expected_tensors)
        assert all(a is b for a, b in zip(tensors, expected_tensors))
        back = st.fill(template, tensors)
        assert pickle.dumps(back) == pickle.dumps(obj), obj
        assert type(back) is type(obj)
