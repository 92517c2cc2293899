"""Fused weight-gradient accumulation (weight_grad.py), in one process: the same gradients as
plain autograd over several microbatches, and the ordinary path wherever fusing would be wrong."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from smshim.modelparallel.torch.pipeline import weight_grad as wg

TOL = 1e-5


def _pair(bias=True, size=(6, 12)):
    torch.manual_seed(0)
    fused, plain = nn.Linear(*size, bias=bias), nn.Linear(*size, bias=bias)
    plain.load_state_dict(fused.state_dict())
    acc = wg.WeightGradAccumulator()
    acc.active = True
    fused.forward = wg.fused_forward(fused, acc)
    return fused, plain, acc


def _inputs(n=3):
    g = torch.Generator().manual_seed(1)
    # 2 rows each: fewer than the weight may keep (a 12 x 6 weight: 4), so the path is taken
    return [torch.randn(1, 2, 6, generator=g, requires_grad=True) for _ in range(n)]


def _close(a, b):
    assert a is not None and b is not None
    assert (a - b).abs().max().item() < TOL


def _same_as_plain_autograd(fused, plain, acc, xs, x_grads):
    """The plain layer's backward on the same microbatches gives the gradients the fused one
    gave (after the flush)."""
    for x in xs:
        x.grad = None
        F.gelu(plain(x)).pow(2).sum().backward()
    acc.flush()
    _close(fused.weight.grad, plain.weight.grad)
    _close(fused.bias.grad, plain.bias.grad)
    for x, g in zip(xs, x_grads):
        _close(g, x.grad)


def test_microbatches_sum_into_one_gradient_as_autograd_does():
    fused, plain, acc = _pair()
    xs = _inputs()
    for x in xs:
        y = fused(x)
        assert type(y.grad_fn).__name__ == "_LinearAccumulatingBackward"
        F.gelu(y).pow(2).sum().backward()
        assert fused.weight.grad is None  # pending until the flush
    _same_as_plain_autograd(fused, plain, acc, xs, [x.grad.clone() for x in xs])


def test_a_microbatch_as_large_as_the_bound_takes_autograds_path():
    # Its product would be computed at once: nothing to defer, and autograd's backward is C++.
    fused, plain, acc = _pair()
    g = torch.Generator().manual_seed(2)
    small, large = (torch.randn(1, 2, 6, generator=g, requires_grad=True),
                    torch.randn(2, 2, 6, generator=g, requires_grad=True))  # 2 and 4 rows
    ys = [fused(x) for x in (small, large)]
    assert type(ys[0].grad_fn).__name__ == "_LinearAccumulatingBackward"
    assert "Accumulating" not in type(ys[1].grad_fn).__name__
    for y in ys:
        F.gelu(y).pow(2).sum().backward()
    _same_as_plain_autograd(fused, plain, acc, [small, large],
                            [small.grad.clone(), large.grad.clone()])


def test_hugging_face_conv1d_takes_the_same_path():
    # GPT-2's projections: a linear layer with its weight stored in x out.
    Conv1D = pytest.importorskip("transformers.pytorch_utils").Conv1D

    torch.manual_seed(0)
    fused, plain = Conv1D(40, 30), Conv1D(40, 30)  # weight 30 x 40: at most 17 rows kept
    plain.load_state_dict(fused.state_dict())
    acc = wg.WeightGradAccumulator()
    acc.active = True
    assert wg.install({"c_fc": fused}, lambda name: True, acc) == [fused]
    g = torch.Generator().manual_seed(1)
    # 2 rows each: grouped by 4, computed when asked, at the bound, and at the flush.
    xs = [torch.randn(1, 2, 30, generator=g, requires_grad=True) for _ in range(23)]
    x_grads = []
    for i, x in enumerate(xs):
        y = fused(x)
        assert type(y.grad_fn).__name__ == "_Conv1DAccumulatingBackward"
        assert torch.equal(y, plain(x))  # the forward Conv1D computes, op for op
        F.gelu(y).pow(2).sum().backward()
        x_grads.append(x.grad.clone())
        if i == 5:  # 12 rows: one group of 8 complete
            assert acc.compute_one() and not acc.compute_one()
    assert fused.weight.grad is None  # pending until the flush
    _same_as_plain_autograd(fused, plain, acc, xs, x_grads)
    wg.uninstall([fused])
    assert type(fused(xs[0]).grad_fn).__name__ != "_Conv1DAccumulatingBackward"


@pytest.mark.parametrize("deferred", [True, False])
def test_existing_grad_is_added_to_at_the_flush_only(deferred):
    """An existing `.grad` is added to when the step's work is flushed, not before: autograd may
    add into it meanwhile, in another thread (a tied weight used in pp_rank 0's glue code), and
    two in-place additions into one tensor at once would lose one."""
    fused, plain, acc = _pair()
    acc.deferred = deferred
    for p in (fused.weight, fused.bias, plain.weight, plain.bias):
        p.grad = torch.ones_like(p)
    for x in _inputs():
        fused(x).sum().backward()
        plain(x).sum().backward()
    while acc.compute_one():
        pass
    assert torch.equal(fused.weight.grad, torch.ones_like(fused.weight))
    assert torch.equal(fused.bias.grad, torch.ones_like(fused.bias))
    acc.flush()
    _close(fused.weight.grad, plain.weight.grad)
    _close(fused.bias.grad, plain.bias.grad)


def test_activation_checkpointing_recomputes_the_same_path():
    fused, plain, acc = _pair()
    for x in _inputs():
        checkpoint(fused, x, use_reentrant=False).pow(2).sum().backward()
        checkpoint(plain, x, use_reentrant=False).pow(2).sum().backward()
    acc.flush()
    _close(fused.weight.grad, plain.weight.grad)
    _close(fused.bias.grad, plain.bias.grad)


def test_ordinary_path_when_inactive_hooked_or_double_backward():
    fused, plain, acc = _pair()
    x = _inputs(1)[0]
    acc.active = False  # outside a step: plain autograd, .grad at once
    fused(x).sum().backward()
    assert fused.weight.grad is not None and not acc
    fused.weight.grad = None
    acc.active = True
    seen = []
    h = fused.weight.register_hook(lambda g: seen.append(g.shape))
    fused(x).sum().backward()  # a hook of the user's: it must see every gradient
    assert seen and fused.weight.grad is not None and not acc
    h.remove()
    fused.zero_grad(set_to_none=True)
    plain.zero_grad(set_to_none=True)
    # create_graph: gradients stay in the graph, as autograd returns them
    gw, = torch.autograd.grad(fused(x).pow(2).sum(), fused.weight, create_graph=True)
    gp, = torch.autograd.grad(plain(x).pow(2).sum(), plain.weight, create_graph=True)
    _close(gw, gp)
    assert gw.requires_grad and not acc


def test_reducer_hooks_do_not_prevent_fusing():
    fused, _, acc = _pair()

    def hook(_p):
        pass

    hook._smshim_reducer = True
    fused.weight.register_post_accumulate_grad_hook(hook)
    fused(_inputs(1)[0]).sum().backward()
    assert acc and fused.weight.grad is None


def test_deferred_products_are_grouped_computed_when_asked_bounded_and_flushed():
    fused, plain, acc = _pair(bias=False, size=(40, 30))
    # A row of dY and X holds 70 numbers, the weight 1200: at most 17 rows are kept, in groups
    # of 8.
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(1, 40, generator=g) for _ in range(30)]

    def run(x):
        fused(x).pow(2).sum().backward()
        plain(x).pow(2).sum().backward()

    for x in xs[:7]:
        run(x)
    assert not acc.wait_for_work(timeout=0.0)  # 7 rows kept, no complete group yet
    run(xs[7])
    assert acc.wait_for_work(timeout=0.0)
    assert acc.compute_one() and not acc.compute_one()  # one product for the 8 microbatches
    assert acc and fused.weight.grad is None  # computed into the pending buffer
    for x in xs[8:24]:
        run(x)
    assert acc.wait_for_work(timeout=0.0)  # 16 rows kept: two groups, left to the flush ...
    run(xs[24])  # ... or computed at once when the kept rows reach the bound
    assert not acc.wait_for_work(timeout=0.0)
    for x in xs[25:]:
        run(x)
    acc.flush()
    assert not acc
    _close(fused.weight.grad, plain.weight.grad)


def test_a_group_computed_at_once_does_not_wake_the_idle_time_thread():
    # Rows of a microbatch beyond the weight's bound: each product is computed in the backward
    # (small weights, large microbatches). The idle-time thread must not be woken for it: on a
    # model made of such layers it would wake once per layer and microbatch for nothing.
    fused, plain, acc = _pair(bias=False, size=(40, 30))  # bound: 17 rows
    woken = []
    notify_all = acc._lock.notify_all
    acc._lock.notify_all = lambda: (woken.append(1), notify_all())
    g = torch.Generator().manual_seed(3)

    def run(rows):
        x = torch.randn(rows, 40, generator=g)
        fused(x).pow(2).sum().backward()
        plain(x).pow(2).sum().backward()

    run(20)
    run(20)
    assert not acc.wait_for_work(timeout=0.0) and not woken
    run(8)  # a complete group within the bound: queued for the thread, which is woken
    assert acc.wait_for_work(timeout=0.0) and woken == [1]
    acc.flush()
    _close(fused.weight.grad, plain.weight.grad)


def test_eager_mode_computes_in_the_backward():
    fused, plain, acc = _pair(bias=False)
    acc.deferred = False
    for x in _inputs(1):
        fused(x).sum().backward()
        plain(x).sum().backward()
    assert not acc.wait_for_work(timeout=0.0) and acc  # nothing kept: in the buffer already
    acc.flush()
    _close(fused.weight.grad, plain.weight.grad)


def test_small_weights_keep_autograds_path_by_default(monkeypatch):
    # The fused path's Python costs more than it saves on a small weight (conftest.py fuses every
    # weight for the other tests; here the default applies).
    monkeypatch.delenv(wg.MIN_NUMEL_ENV, raising=False)
    small = nn.Linear(16, 64)  # 1 Ki elements
    large = nn.Linear(256, 512)  # 128 Ki: the smallest that is fused by default
    acc = wg.WeightGradAccumulator()
    acc.active = True
    assert large.weight.numel() == wg.DEFAULT_MIN_NUMEL
    assert wg.install({"small": small, "large": large}, lambda name: True, acc) == [large]
    assert type(small(torch.randn(2, 16, requires_grad=True)).grad_fn).__name__ == "AddmmBackward0"
    y = large(torch.randn(2, 256, requires_grad=True))
    assert type(y.grad_fn).__name__ == "_LinearAccumulatingBackward"
    wg.uninstall([large])
    monkeypatch.setenv(wg.MIN_NUMEL_ENV, "1024")
    assert wg.install({"small": small, "large": large}, lambda name: True, acc) == [small, large]
    wg.uninstall([small, large])


@pytest.mark.parametrize("value", ["-1", "big"])
def test_a_bad_minimum_weight_size_names_the_variable(monkeypatch, value):
    monkeypatch.setenv(wg.MIN_NUMEL_ENV, value)
    with pytest.raises(ValueError, match=wg.MIN_NUMEL_ENV):
        wg.install({"fc": nn.Linear(4, 4)}, lambda name: True, wg.WeightGradAccumulator())


@pytest.mark.parametrize("deferred", [True, False])
def test_cpu_autocast_takes_autograds_path_and_never_reaches_the_fused_products(deferred):
    fused, plain, acc = _pair()
    acc.deferred = deferred
    x = _inputs(1)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # (no-argument is_autocast_enabled: CUDA's)
        y = fused(x)
        assert "Accumulating" not in type(y.grad_fn).__name__ and y.dtype == torch.bfloat16
    # Autocast turned off around the forward only, as in a region that opts out of it: the fused
    # backward and the flush run under the caller's autocast, and must compute in fp32 all the same.
    xs = _inputs()
    x_grads = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for x in xs:
            with torch.autocast("cpu", enabled=False):
                out = F.gelu(fused(x)).pow(2).sum()
            out.backward()
            x_grads.append(x.grad.clone())
        acc.flush()
    _same_as_plain_autograd(fused, plain, acc, xs, x_grads)
