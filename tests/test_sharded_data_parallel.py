"""SMP v1 sharded data parallelism (sharded_data_parallel_degree > 1) on torch's FSDP.

Every distributed job must end where one process training on the same global batches ends
(fp32, < 1e-5): sdp 2 on 2 ranks (FULL_SHARD), sdp 2 x 2 replicas on 4 ranks (HYBRID_SHARD),
with SGD and Adam, microbatches accumulated inside the step, sdp_gradient_clipping applied before
every step; clip_master_grads gives torch's norm; partial and full checkpoints resume exactly and
the full one loads into the plain module; bad combinations fail on every rank naming the keys.
bf16 computes in bf16 on fp32 shards (close to, not equal to, fp32 training); an fp16 overflow
skips the step on every rank and lowers the dynamic loss scale.
"""

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from smshim.testing import RankFailure, run_ranks

TOL = 1e-5
BATCH = 8
TIMEOUT = 240


class Net(nn.Module):
    # Sizes that do not divide evenly: flat shards cut through parameters.
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.norm = nn.LayerNorm(13)
        self.fc2 = nn.Linear(13, 5)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


def _batches(steps):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 7, generator=g), torch.randint(0, 5, (BATCH,), generator=g))
            for _ in range(steps)]


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    # torch's eps 1e-8 turns rounding noise of near-zero gradients into visible steps.
    return torch.optim.Adam(params, lr=0.01, eps=1e-5)


def _reference(kind, steps, clip=0.0, manual_clip=None):
    """One process, the whole global batch per step."""
    model = _model()
    opt = _optimizer(kind, model.parameters())
    norms = []
    for x, y in _batches(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if manual_clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), manual_clip)))
        elif clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def _job(cfg, kind, steps, first=0, save=None, resume=None, manual_clip=None):
    import smdistributed.modelparallel.torch as smp

    smp.init(cfg)
    model = smp.DistributedModel(_model())
    opt = smp.DistributedOptimizer(_optimizer(kind, model.parameters()))

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    if resume is not None:
        smp.resume_from_checkpoint(resume[0], partial=resume[1])
    n, r = smp.dp_size(), smp.dp_rank()
    k = BATCH // n
    norms = []
    for x, y in _batches(steps)[first:]:
        opt.zero_grad()
        train_step(model, x[r * k:(r + 1) * k], y[r * k:(r + 1) * k])
        if manual_clip is not None:
            norms.append(opt.clip_master_grads(manual_clip))
        opt.step()
    if save is not None:
        smp.save_checkpoint(save[0], "ckpt", partial=save[1], model=model, optimizer=opt)
    full = model.state_dict()  # gathered onto rank 0 (every rank calls)
    local = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"full": full, "norms": norms, "local_sizes": {n: v.numel() for n, v in local.items()}}


def _cfg(k, m=1, clip=0.0):
    return {"ddp": True, "sharded_data_parallel_degree": k, "microbatches": m,
            "sdp_gradient_clipping": clip}


def _assert_close(got, want, what):
    assert set(got) == set(want), (what, sorted(got), sorted(want))
    for name in want:
        err = (got[name] - want[name]).abs().max().item()
        assert err < TOL, f"{what}: {name} differs by {err}"


@pytest.mark.parametrize("world,k,kind,m,clip", [
    (2, 2, "sgd", 1, 0.0),
    (2, 2, "adam", 2, 0.5),
    (4, 2, "sgd", 2, 0.0),
    (4, 2, "adam", 1, 0.5),
])
def test_training_equals_one_process(world, k, kind, m, clip):
    steps = 4
    res = run_ranks(_job, world, _cfg(k, m, clip), kind, steps, timeout=TIMEOUT)
    want, _ = _reference(kind, steps, clip)
    _assert_close(res[0]["full"], want, f"sdp {k} of {world} ranks, {kind}, m={m}")
    assert all(r["full"] == {} for r in res[1:])  # gathered onto rank 0 only
    # Each rank holds a shard: the pieces of a replica add up to the model, once.
    total = sum(v.numel() for v in want.values())
    for rep in range(world // k):
        held = sum(sum(res[rep * k + s]["local_sizes"].values()) for s in range(k))
        assert held == total, (rep, held, total)
    assert sum(res[0]["local_sizes"].values()) < total


def test_clip_master_grads_is_torchs_global_norm():
    res = run_ranks(_job, 4, _cfg(2, clip=1.0), "sgd", 3, 0, None, None, 0.05, timeout=TIMEOUT)
    want, norms = _reference("sgd", 3, manual_clip=0.05)
    for r in res:
        assert len(r["norms"]) == 3
        for got, ref in zip(r["norms"], norms):
            assert abs(got - ref) < 1e-5 * max(1.0, ref), (got, ref)
    # The script's own clip replaces sdp_gradient_clipping's for that step.
    _assert_close(res[0]["full"], want, "clip_master_grads(0.05)")


@pytest.mark.parametrize("partial", [True, False])
def test_checkpoint_resumes_exactly(tmp_path, partial):
    path = str(tmp_path / "ckpt")
    run_ranks(_job, 4, _cfg(2), "adam", 2, 0, (path, partial), timeout=TIMEOUT)
    if partial:
        files = sorted(os.listdir(os.path.join(path, "ckpt_partial")))
        assert files == ["model_0_0_sdp0.pt", "model_0_0_sdp1.pt", "optimizer_0_0_sdp0.pt",
                         "optimizer_0_0_sdp1.pt", "user_content.pt"], files
    else:
        # The full checkpoint is the plain module's state dict and torch's optimizer format.
        plain = _model()
        plain.load_state_dict(torch.load(os.path.join(path, "ckpt")))
        want2, _ = _reference("adam", 2)
        _assert_close(plain.state_dict(), want2, "full checkpoint in a plain module")
        osd = torch.load(os.path.join(path, "ckpt_optimizer.pt"))
        ref_opt = _optimizer("adam", plain.parameters())
        ref_opt.load_state_dict(osd)  # torch's own format, index-keyed
        assert sorted(osd["state"]) == list(range(len(list(plain.parameters()))))
    # A full checkpoint loads at any degree: resumed at sdp 4 (FULL_SHARD over the 4 ranks).
    resume_cfg = _cfg(2) if partial else _cfg(4)
    res = run_ranks(_job, 4, resume_cfg, "adam", 4, 2, None, (path, partial), timeout=TIMEOUT)
    want, _ = _reference("adam", 4)
    _assert_close(res[0]["full"], want, f"resumed from a {'partial' if partial else 'full'} "
                                        "checkpoint")


def test_partial_checkpoint_at_another_degree_fails_on_every_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_job, 2, _cfg(2), "sgd", 1, 0, (path, True), timeout=TIMEOUT)
    with pytest.raises(RankFailure) as e:
        run_ranks(_job, 4, _cfg(4), "sgd", 2, 1, None, (path, True), timeout=TIMEOUT)
    assert "sharded_data_parallel_degree" in str(e.value)


def _bad_init(cfg):
    import smdistributed.modelparallel.torch as smp

    try:
        smp.init(cfg)
    except Exception as e:  # every rank must fail before any collective
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.parametrize("cfg,keys", [
    ({"ddp": True, "sharded_data_parallel_degree": 2, "pipeline_parallel_degree": 2},
     ["'sharded_data_parallel_degree'=2", "'pipeline_parallel_degree'=2"]),
    ({"ddp": True, "sharded_data_parallel_degree": 2, "shard_optimizer_state": True},
     ["'sharded_data_parallel_degree'=2", "'shard_optimizer_state'=True"]),
    ({"ddp": True, "sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2},
     ["'sharded_data_parallel_degree'=2", "'tensor_parallel_degree'=2"]),
    ({"ddp": True, "sharded_data_parallel_degree": 4},
     ["'sharded_data_parallel_degree'=4", "world size 2"]),
])
def test_bad_combination_names_the_keys_on_every_rank(cfg, keys):
    res = run_ranks(_bad_init, 2, cfg, timeout=60)
    for msg in res:
        assert msg is not None and all(k in msg for k in keys), msg


def _mixed_job(cfg, steps, opt_kwargs):
    import smdistributed.modelparallel.torch as smp

    smp.init(cfg)
    model = smp.DistributedModel(_model())
    opt = smp.DistributedOptimizer(_optimizer("sgd", model.parameters()), **opt_kwargs)

    seen = []

    @smp.step
    def train_step(model, x, y):
        out = model(x)
        seen.append(str(out.dtype))
        loss = F.cross_entropy(out.float(), y)
        model.backward(loss)
        return loss

    n, r = smp.dp_size(), smp.dp_rank()
    k = BATCH // n
    trace = []
    for x, y in _batches(steps):
        opt.zero_grad()
        train_step(model, x[r * k:(r + 1) * k], y[r * k:(r + 1) * k])
        opt.step()
        trace.append((seen[-1], bool(opt.overflow),
                      opt.loss_scaler.scale if opt.loss_scaler else None))
    return {"full": model.state_dict(), "trace": trace,
            "dtypes": sorted({str(p.dtype) for p in model.parameters()})}


def test_bf16_computes_in_bf16_on_fp32_shards():
    cfg = dict(_cfg(2), bf16=True)
    res = run_ranks(_mixed_job, 2, cfg, 3, {}, timeout=TIMEOUT)
    assert res[0]["dtypes"] == ["torch.float32"]  # the shards are the fp32 master weights
    assert all(t[0] == "torch.bfloat16" and not t[1] for t in res[0]["trace"]), res[0]["trace"]
    want, _ = _reference("sgd", 3)
    worst = max((res[0]["full"][n] - want[n]).abs().max().item() for n in want)
    assert 0 < worst < 2e-2, worst  # bf16 rounding, not another training


def test_fp16_overflow_skips_the_step_on_every_rank():
    # A dynamic loss scale of 2**40 overflows fp16 in the first backward: the step is skipped
    # on every rank (the weights stay the initial ones) and the scale halves.
    cfg = dict(_cfg(2), fp16=True)
    res = run_ranks(_mixed_job, 4, cfg, 1, {"dynamic_loss_scale": True,
                                           "dynamic_loss_args": {"init_scale": 2.0 ** 40}},
                    timeout=TIMEOUT)
    for r in res:
        assert r["trace"] == [("torch.float16", True, 2.0 ** 39)], r["trace"]
    _assert_close(res[0]["full"], _model().state_dict(), "after the skipped step")


def _checkpointed_job(cfg, steps):
    import smdistributed.modelparallel.torch as smp

    smp.init(cfg)
    net = _model()
    model = smp.DistributedModel(net)
    smp.set_activation_checkpointing(net.fc1)
    smp.set_activation_checkpointing(net.norm)
    opt = smp.DistributedOptimizer(_optimizer("adam", model.parameters()))

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    n, r = smp.dp_size(), smp.dp_rank()
    k = BATCH // n
    for x, y in _batches(steps):
        opt.zero_grad()
        train_step(model, x[r * k:(r + 1) * k], y[r * k:(r + 1) * k])
        opt.step()
    return model.state_dict()


def test_activation_checkpointing_inside_the_sharded_model():
    res = run_ranks(_checkpointed_job, 4, _cfg(2, m=2), 3, timeout=TIMEOUT)
    want, _ = _reference("adam", 3)
    _assert_close(res[0], want, "sdp 2 x 2 replicas with checkpointed fc1 and norm")


def _smp_save_job(cfg, path):
    import smdistributed.modelparallel.torch as smp

    smp.init(cfg)
    model = smp.DistributedModel(_model())
    opt = smp.DistributedOptimizer(_optimizer("adam", model.parameters()))

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    x, y = _batches(1)[0]
    k = BATCH // smp.dp_size()
    r = smp.dp_rank()
    train_step(model, x[r * k:(r + 1) * k], y[r * k:(r + 1) * k])
    opt.step()
    # smp.save / smp.load of the local state dicts, as Hugging Face's Trainer resumes.
    smp.save(model.local_state_dict(), f"{path}/model", partial=True)
    smp.save(opt.local_state_dict(), f"{path}/optimizer", partial=True)
    smp.barrier()
    before = model.state_dict()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(smp.load(f"{path}/model", partial=True))
    opt.load_state_dict(smp.load(f"{path}/optimizer", partial=True))
    return before, model.state_dict(), sorted(os.listdir(path)) if smp.rank() == 0 else None


def test_smp_save_and_load_of_local_state_dicts(tmp_path):
    res = run_ranks(_smp_save_job, 2, _cfg(2), str(tmp_path), timeout=TIMEOUT)
    before, after, files = res[0]
    _assert_close(after, before, "smp.load of smp.save(model.local_state_dict())")
    assert files == ["model_0_0_sdp0", "model_0_0_sdp1", "optimizer_0_0_sdp0",
                     "optimizer_0_0_sdp1"], files
