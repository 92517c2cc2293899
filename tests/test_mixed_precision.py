"""fp16/bf16 with fp32 master weights and loss scaling, overflow agreement and clip_master_grads.

Every test trains the Net of pipeline_models for 3 steps in a gloo job and compares with a
single-process run written here with plain torch (no smshim code): the model cast to the same
dtype, the batch cut into the same microbatches, each microbatch's loss scaled by S/m before its
backward, fp32 master weights stepped by a torch optimizer and copied back.
"""

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

from smshim.testing import run_ranks
from tests.pipeline_models import batches, make_model

MP_TOL = 1e-3
FP32_TOL = 1e-5
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _opt(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference(dtype, steps=3, batch=8, m=2, scale=1.0, dynamic=False, clip=None,
              inf_step=None, inf_param=None):
    """Single-process mixed-precision training; returns (fp32 weights, overflow flags, scales,
    clip norms)."""
    model = make_model("net")
    if dtype is not None:
        model.to(dtype)
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    masters = [p.detach().float().clone() for p in params] if dtype is not None else params
    opt = _opt(masters)
    flags, scales, norms = [], [], []
    for step, (x, y) in enumerate(batches("net", steps, batch)):
        for p in params:
            p.grad = None
        k = batch // m
        for mb in range(m):
            xs = x[mb * k:(mb + 1) * k]
            out = model(xs.to(dtype) if dtype is not None else xs, scale=0.5)
            loss = F.cross_entropy(out["logits"].float(), y[mb * k:(mb + 1) * k])
            (loss * (scale / m)).backward()
        if step == inf_step:
            params[names.index(inf_param)].grad.view(-1)[0] = float("inf")
        grads = [p.grad.float() / scale for p in params]
        overflow = not all(bool(torch.isfinite(g).all()) for g in grads)
        flags.append(overflow)
        scales.append(scale)
        if overflow:
            scale = scale / 2 if dynamic else scale
            continue
        for w, g in zip(masters, grads):
            w.grad = g
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(masters, clip)))
        opt.step()
        if dtype is not None:
            with torch.no_grad():
                for p, w in zip(params, masters):
                    p.copy_(w)
    return ({n: w.detach().clone() for n, w in zip(names, masters)}, flags, scales, norms)


def _train(cfg, dtype_name, opt_kwargs, steps=3, batch=8, clip=None, inf=None, ckpt=None):
    """One rank of a job; with `ckpt` (and a manual partition) blocks 2-3 and the head go to
    pp rank 1 and the named modules are checkpointed."""
    import smdistributed.modelparallel.torch as smp

    smp.init(cfg)
    dtype = DTYPES.get(dtype_name)
    dp, dp_rank = smp.dp_size(), smp.dp_rank()
    module = make_model("net")
    if ckpt:
        for name in ckpt:
            smp.set_activation_checkpointing(module.get_submodule(name))
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(_opt(model.parameters()), **opt_kwargs)
    if not cfg.get("auto_partition", True):
        for name in ("blocks.2", "blocks.3", "head"):
            smp.set_partition(module.get_submodule(name), 1)

    @smp.step
    def train_step(model, x, y):
        out = model(x, scale=0.5)
        loss = F.cross_entropy(out["logits"].float(), y)
        model.backward(loss)
        return loss

    flags, scales, norms = [], [], []
    for step, (x, y) in enumerate(batches("net", steps, batch)):
        k = batch // dp
        x, y = x[dp_rank * k:(dp_rank + 1) * k], y[dp_rank * k:(dp_rank + 1) * k]
        opt.zero_grad()
        scales.append(opt.loss_scaler.scale if opt.loss_scaler is not None else 1.0)
        train_step(model, x.to(dtype) if dtype is not None else x, y)
        if inf is not None and step == inf[0] and (smp.pp_rank(), dp_rank) == inf[2]:
            # One rank alone sees an overflow (after the DP reduction, as a bad value in its
            # own gradients would be): every rank must still skip this step.
            p = dict(model.local_named_parameters())[inf[1]]
            p.grad.view(-1)[0] = float("inf")
        if clip is not None:
            norms.append(opt.clip_master_grads(clip))
        opt.step()
        flags.append(opt.overflow)
    weights = {}
    for n, p in model.local_named_parameters():
        w = opt._masters.weight(p) if p.dtype in (torch.float16, torch.bfloat16) else p
        weights[n] = (w.detach().clone(), p.detach().clone())
    return {"weights": weights, "flags": flags, "scales": scales, "norms": norms,
            "pp_rank": smp.pp_rank(), "dp_rank": dp_rank,
            "dtypes": sorted({str(p.dtype) for _, p in model.local_named_parameters()}),
            "state_params": sum(1 for _ in opt.optimizer.state)}


def _check(results, ref, tol, dtype=None):
    merged = {}
    for r in results:
        for n, (w, p) in r["weights"].items():
            if r["dp_rank"] == 0:
                merged[n] = w
            if dtype is not None:
                # The model's reduced-precision weights are the rounded masters, on every rank.
                assert p.dtype == dtype and torch.equal(p, w.to(dtype)), n
    assert set(merged) == set(ref)
    for n, w in ref.items():
        diff = (merged[n] - w).abs().max().item()
        assert diff < tol, f"{n}: max abs diff {diff}"


@pytest.mark.parametrize("dtype_name, ckpt", [("bf16", None), ("fp16", None),
                                              ("bf16", ("blocks.0", "blocks.3"))])
def test_reduced_precision_pp2_matches_single_process(dtype_name, ckpt):
    dtype = DTYPES[dtype_name]
    cfg = {"pipeline_parallel_degree": 2, "microbatches": 2, dtype_name: True,
           "deterministic_server": True}
    if ckpt:  # checkpointed blocks on both stages
        cfg.update({"auto_partition": False, "default_partition": 0})
    results = run_ranks(_train, 2, cfg, dtype_name, {"static_loss_scale": 128.0}, 3, 8, None,
                        None, ckpt, timeout=150)
    ref, flags, _, _ = reference(dtype, scale=128.0)
    assert not any(flags)
    _check(results, ref, MP_TOL, dtype)
    for r in results:
        assert r["dtypes"] == [str(dtype)]  # the model runs in the reduced dtype
        assert r["flags"] == [False] * 3
    # The comparison can fail: one step less ends elsewhere.
    short, _, _, _ = reference(dtype, steps=2, scale=128.0)
    assert max((short[n] - ref[n]).abs().max().item() for n in ref) > 10 * MP_TOL


def test_dynamic_overflow_is_skipped_on_every_rank():
    # pp=2 x dp=2, bf16, dynamic scaling; at step 1 only (pp 1, dp 1) sees an inf gradient.
    cfg = {"pipeline_parallel_degree": 2, "microbatches": 2, "bf16": True, "ddp": True,
           "deterministic_server": True}
    opt_kwargs = {"static_loss_scale": None, "dynamic_loss_scale": True,
                  "dynamic_loss_args": {"init_scale": 2.0 ** 10, "scale_window": 1000,
                                        "min_scale": 1, "delayed_shift": 1}}
    inf = (1, "head.weight", (1, 1))
    results = run_ranks(_train, 4, cfg, "bf16", opt_kwargs, 3, 16, None, inf, timeout=150)
    ref, flags, scales, _ = reference(torch.bfloat16, batch=16, m=4, scale=2.0 ** 10,
                                      dynamic=True, inf_step=1, inf_param="head.weight")
    assert flags == [False, True, False]
    for r in results:
        assert r["flags"] == flags, (r["pp_rank"], r["dp_rank"], r["flags"])
        assert r["scales"] == scales == [1024.0, 1024.0, 512.0]
    _check(results, ref, MP_TOL, torch.bfloat16)


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_clip_master_grads_equals_clip_grad_norm(dtype_name):
    dtype = DTYPES.get(dtype_name)
    cfg = {"pipeline_parallel_degree": 2, "microbatches": 2, "deterministic_server": True}
    if dtype is not None:
        cfg[dtype_name] = True
    results = run_ranks(_train, 2, cfg, dtype_name, {}, 3, 8, 0.05, timeout=150)
    ref, _, _, norms = reference(dtype, clip=0.05)
    assert min(norms) > 0.05  # clipping really happened at every step
    for r in results:  # every stage returns the global norm
        for got, want in zip(r["norms"], norms):
            # bf16 gradients are summed over microbatches in another order here: ulp-level.
            rel = 1e-5 if dtype is None else 1e-3
            assert math.isclose(got, want, rel_tol=rel), (r["pp_rank"], r["norms"], norms)
    _check(results, ref, FP32_TOL if dtype is None else MP_TOL, dtype)


def test_dynamic_loss_scaler_rules():
    from smshim.modelparallel.torch.precision.loss_scaler import LossScaler, make_loss_scaler

    s = LossScaler(dynamic=True, init_scale=8.0, scale_window=2, delayed_shift=2, min_scale=4.0)
    seen = []
    for overflow in [True, True, False, False, True, True, True, False]:
        s.update(overflow)
        seen.append(s.scale)
    # 1st overflow only uses up the hysteresis (delayed_shift=2); a clean window of 2 steps
    # after the last overflow doubles the scale; never below min_scale.
    assert seen == [8.0, 4.0, 4.0, 8.0, 8.0, 4.0, 4.0, 4.0], seen
    assert LossScaler(static_scale=32.0).scale == 32.0
    s = make_loss_scaler(None, True, {"dynamic_loss_args": {"scale_window": 3, "init_scale": 2.0}})
    assert s.dynamic and s.scale == 2.0 and s.scale_window == 3
    assert make_loss_scaler(None, False, {}).scale == 1.0
    with pytest.raises(TypeError, match="unknown dynamic_loss_args"):
        make_loss_scaler(None, True, {"window": 3})


def test_fp16_config_validation_and_model_creation():
    import smdistributed.modelparallel.torch as smp

    with smp.model_creation(dtype=torch.bfloat16):
        layer = torch.nn.Linear(3, 3)
    assert layer.weight.dtype == torch.bfloat16 and torch.get_default_dtype() == torch.float32
    with pytest.raises(TypeError, match="floating-point"):
        with smp.model_creation(dtype=torch.int64):
            pass


def _created_in_bf16():
    import smdistributed.modelparallel.torch as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "deterministic_server": True})
    with smp.model_creation(dtype=torch.bfloat16):
        module = make_model("net")
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(_opt(model.parameters()))

    @smp.step
    def train_step(model, x, y):
        out = model(x, scale=0.5)
        loss = F.cross_entropy(out["logits"].float(), y)
        model.backward(loss)
        return loss

    for x, y in batches("net", 3, 8):
        opt.zero_grad()
        train_step(model, x.to(torch.bfloat16), y)
        opt.step()
    return {n: opt._masters.weight(p).clone() for n, p in model.local_named_parameters()}


def test_model_created_in_bf16_steps_fp32_masters():
    # fp32 config, parameters created in bf16 by smp.model_creation(dtype=): the optimizer still
    # steps fp32 masters (no loss scaling). The reference creates its model the same way (bf16
    # default dtype) and steps fp32 masters by hand.
    results = run_ranks(_created_in_bf16, 2, timeout=150)
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = make_model("net")
    finally:
        torch.set_default_dtype(prev)
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    masters = [p.detach().float().clone() for p in params]
    opt = _opt(masters)
    for x, y in batches("net", 3, 8):
        for p in params:
            p.grad = None
        for mb in range(2):
            out = model(x[mb * 4:(mb + 1) * 4].to(torch.bfloat16), scale=0.5)
            (F.cross_entropy(out["logits"].float(), y[mb * 4:(mb + 1) * 4]) / 2).backward()
        for w, p in zip(masters, params):
            w.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for p, w in zip(params, masters):
                p.copy_(w)
    merged = {**results[0], **results[1]}
    for n, w in zip(names, masters):
        assert (merged[n] - w).abs().max().item() < MP_TOL, n


# ---- torch.autocast inside the step function, or around its call ---------------------------------

AUTOCAST_PARTS = ("blocks.2", "blocks.3", "head")  # on pp rank 1
# bf16 sums of gradients group differently across module boundaries: a value that three ops use,
# two of them inside a module, gets ((a + b) + c) here and autograd's order in one process; and
# `shared`, called twice, has its weight cast once per autocast region in one process (autocast's
# cache), so its two calls' gradients meet in bf16 there, in fp32 here. (In fp32 the same
# groupings differ by ~1e-8.) What must hold exactly: every module computes in bf16.
AUTOCAST_TOL = 2e-4


def _autocast_reference(steps=1, batch=8, m=2):
    """Single process: the same microbatches, each forward under CPU bf16 autocast."""
    model = make_model("net")
    opt = _opt(model.parameters())
    for x, y in batches("net", steps, batch):
        opt.zero_grad()
        k = batch // m
        for mb in range(m):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x[mb * k:(mb + 1) * k], scale=0.5)
            (F.cross_entropy(out["logits"].float(), y[mb * k:(mb + 1) * k]) / m).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _autocast_train(where, ckpt=False, steps=1, batch=8):
    import smdistributed.modelparallel.torch as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False,
              "default_partition": 0, "deterministic_server": True})
    module = make_model("net")
    if ckpt:  # recomputed in the backward, under the autocast its forward had
        for name in ("blocks.0", "blocks.3"):
            smp.set_activation_checkpointing(module.get_submodule(name))
    model = smp.DistributedModel(module)
    for name in AUTOCAST_PARTS:
        smp.set_partition(module.get_submodule(name), 1)
    opt = smp.DistributedOptimizer(_opt(model.parameters()))
    seen = {}  # linear layer -> dtypes of its outputs (where its call was made)

    def record(name):
        return lambda mod, args, out: seen.setdefault(name, set()).add(str(out.dtype))

    for name, mod in module.named_modules():
        if isinstance(mod, torch.nn.Linear):
            mod.register_forward_hook(record(name))
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    inside = autocast if where == "inside" else contextlib.nullcontext
    outside = autocast if where == "outside" else contextlib.nullcontext

    @smp.step
    def train_step(model, x, y):
        with inside():
            out = model(x, scale=0.5)
        loss = F.cross_entropy(out["logits"].float(), y)
        model.backward(loss)
        return loss

    for x, y in batches("net", steps, batch):
        opt.zero_grad()
        with outside():
            train_step(model, x, y)
        opt.step()
    return {"weights": {n: p.detach().clone() for n, p in model.local_named_parameters()},
            "seen": seen}


@pytest.mark.parametrize("where, ckpt", [("inside", False), ("outside", False), ("inside", True)])
def test_autocast_reaches_every_stage(where, ckpt):
    """The modules of every stage (and pp_rank 0's step bodies, for autocast around the step
    call) run under the caller's autocast, as in one process: the same weights after a step."""
    results = run_ranks(_autocast_train, 2, where, ckpt, timeout=180)
    for r in results:
        assert r["seen"] and all(d == {"torch.bfloat16"} for d in r["seen"].values()), r["seen"]
    assert "blocks.3.lin" in results[1]["seen"]  # (called on pp rank 1)
    merged = {n: w for r in results for n, w in r["weights"].items()}
    ref = _autocast_reference()
    assert set(merged) == set(ref)
    for n, w in ref.items():
        diff = (merged[n] - w).abs().max().item()
        assert diff < AUTOCAST_TOL, f"{n}: max abs diff {diff}"
