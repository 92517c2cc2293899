"""Usage patterns seen in real smdistributed training scripts (SageMaker examples, Hugging Face's
Trainer), each run on 2-4 processes and checked against single-process training where it trains."""

import json
import math
import os

import pytest
import torch

from smshim.testing import run_ranks
from tests.usage_helpers.models import assert_close, batches, make_model, merge_local, reference, shard

MP2 = {"partitions": 2, "microbatches": 2}
MP2_DDP = {"partitions": 2, "microbatches": 2, "ddp": True}


def _local(model):
    return {n: p.detach().clone() for n, p in model.local_named_parameters()}


# ---- smp.init at import time, @smp.step without parentheses, a dict of tensors and numbers --------

def _init_at_import():
    import smdistributed.modelparallel.torch as smp

    assert not smp.is_initialized()
    from tests.usage_helpers import init_at_import as script  # calls smp.init(...) when imported

    assert smp.is_initialized() and smp.pp_size() == 2 and smp.num_microbatches() == 2
    model = smp.DistributedModel(make_model())
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    for x, y in batches(3, 8):
        opt.zero_grad()
        out = script.train_step(model, x, y)
        opt.step()
    return {"params": _local(model), "y": y,
            "kinds": {k: type(v).__name__ for k, v in out.items()},
            "loss_outputs": [t.clone() for t in out["loss"].outputs],  # read directly
            "logits": out["logits"].concat(), "correct": out["correct"], "tag": out["tag"]}


def test_init_at_import_and_dict_step_output():
    results = run_ranks(_init_at_import, 2, timeout=120)
    assert_close(merge_local(results), reference(batches(3, 8), lambda p: torch.optim.Adam(p, lr=0.01)))
    r0, r1 = results
    assert r0["kinds"] == {"loss": "StepOutput", "logits": "StepOutput", "correct": "list", "tag": "list"}
    assert r0["tag"] == ["train", "train"]
    # Each microbatch's values, as the step body saw them, on both pipeline ranks.
    y = r0["y"]
    assert len(r0["loss_outputs"]) == 2 and r0["logits"].shape == (8, 4)
    for mb in range(2):
        sl = slice(4 * mb, 4 * mb + 4)
        want = torch.nn.functional.cross_entropy(r0["logits"][sl], y[sl])
        assert torch.allclose(r0["loss_outputs"][mb], want, atol=1e-6)
        assert r0["correct"][mb] == int((r0["logits"][sl].argmax(1) == y[sl]).sum())
        assert isinstance(r0["correct"][mb], int)
    assert r0["correct"] == r1["correct"] and torch.equal(r0["logits"], r1["logits"])
    assert all(torch.equal(a, b) for a, b in zip(r0["loss_outputs"], r1["loss_outputs"]))


# ---- auto-init from SM_HP_MP_PARAMETERS, @smp.step(), the script's own smp.init ignored ----------

def _auto_init():
    import smdistributed.modelparallel.torch as smp

    assert smp.is_initialized()  # importing smp initialised it from SM_HP_MP_PARAMETERS
    smp.init({"partitions": 2, "microbatches": 1})  # the script's call: logged, changes nothing
    assert smp.num_microbatches() == 4 and smp.pp_size() == 2

    @smp.step()
    def train_step(model, x, y):
        loss = model(x, labels=y)["loss"]
        model.backward(loss)
        return loss

    @smp.step(non_split_inputs=["scale"], input_split_axes={"x": 0})
    def eval_step(model, x, scale):
        return model(x)["logits"] * scale

    model = smp.DistributedModel(make_model())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for x, y in batches(2, 8):
        opt.zero_grad()
        train_step(model, x, y)
        opt.step()
    logits = eval_step(model, x, torch.tensor(2.0)).concat()
    return {"params": _local(model), "logits": logits}


def test_auto_init_from_environment_and_step_with_parentheses():
    env = {"SM_HP_MP_PARAMETERS": json.dumps({"partitions": 2, "microbatches": 4})}
    results = run_ranks(_auto_init, 2, env=env, timeout=120)
    data = batches(2, 8)
    want = reference(data, lambda p: torch.optim.SGD(p, lr=0.1))
    assert_close(merge_local(results), want)
    ref = make_model()
    ref.load_state_dict(want)
    assert torch.allclose(results[1]["logits"], 2 * ref(data[-1][0])["logits"], atol=1e-5)


# ---- smp.broadcast(len(loader)) on pp_rank 0, smp.recv_from on the others -----------------------

def _broadcast_len():
    import smdistributed.modelparallel.torch as smp

    smp.init(MP2_DDP)
    model = smp.DistributedModel(make_model())
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))

    @smp.step
    def train_step(model, x, y):
        loss = model(x, labels=y)["loss"]
        model.backward(loss)
        return loss

    if smp.pp_rank() == 0:
        # Only the first stage loads data; it tells its pipeline how many steps there are.
        loader = [(shard(x, smp.dp_rank(), 2), shard(y, smp.dp_rank(), 2)) for x, y in batches(3, 8)]
        smp.broadcast((len(loader), smp.dp_rank()), smp.PP_GROUP)
        n = len(loader)
    else:
        n, sender_dp_rank = smp.recv_from(0, smp.RankType.PP_RANK)
        assert sender_dp_rank == smp.dp_rank()  # from this replica's pp_rank 0
        loader = [(torch.zeros(4, 8), torch.zeros(4, dtype=torch.long))] * n  # placeholders
    losses = []
    for x, y in loader:
        opt.zero_grad()
        losses.append(train_step(model, x, y).reduce_mean().item())
        opt.step()
    return {"params": _local(model), "n": n, "losses": losses, "dp_rank": smp.dp_rank(),
            "pp_rank": smp.pp_rank()}


def test_broadcast_loader_length_to_the_pipeline():
    results = run_ranks(_broadcast_len, 4, timeout=150)
    assert [r["n"] for r in results] == [3] * 4
    assert_close(merge_local(results), reference(batches(3, 8), lambda p: torch.optim.Adam(p, lr=0.01)))
    for d in (0, 1):  # the stages that had no data still got the step's outputs
        replica = [r["losses"] for r in results if r["dp_rank"] == d]
        assert replica[0] == replica[1]


# ---- torch.optim.lr_scheduler.StepLR around a DistributedOptimizer -------------------------------

def _step_lr():
    import smdistributed.modelparallel.torch as smp
    from torch.optim.lr_scheduler import StepLR

    smp.init(MP2)
    model = smp.DistributedModel(make_model())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    sched = StepLR(opt, step_size=1, gamma=0.5)

    @smp.step
    def train_step(model, x, y):
        loss = model(x, labels=y)["loss"]
        model.backward(loss)
        return loss

    lrs = []
    for x, y in batches(3, 8):
        opt.zero_grad()
        train_step(model, x, y)
        opt.step()
        sched.step()
        lrs.append((sched.get_last_lr()[0], opt.optimizer.param_groups[0]["lr"]))
    return {"params": _local(model), "lrs": lrs, "sched": sched.state_dict()}


def test_step_lr_scheduler_drives_the_wrapped_optimizer():
    results = run_ranks(_step_lr, 2, timeout=120)
    want = reference(batches(3, 8), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                     lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    assert_close(merge_local(results), want)
    for r in results:
        assert [a for a, _ in r["lrs"]] == pytest.approx([0.05, 0.025, 0.0125])
        assert all(a == b for a, b in r["lrs"])  # the wrapped optimizer sees the scheduler's lr
        assert r["sched"]["last_epoch"] == 3


# ---- smp.amp.GradScaler on CPU, passed into the step --------------------------------------------

def _grad_scaler(overflow_step):
    import smdistributed.modelparallel.torch as smp

    smp.init(MP2)
    model = smp.DistributedModel(make_model())
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    scaler = smp.amp.GradScaler()

    @smp.step
    def train_step(model, x, y, scaler):
        loss = model(x, labels=y)["loss"]
        model.backward(scaler.scale(loss))
        return loss

    scales, skipped = [], None
    for i, (x, y) in enumerate(batches(4, 8)):
        opt.zero_grad()
        train_step(model, x, y, scaler)
        if i == overflow_step and smp.pp_rank() == 1:
            next(model.local_parameters()).grad.view(-1)[0] = math.inf  # this stage only
        before = _local(model)
        scaler.unscale_(opt)  # as before gradient clipping
        scaler.step(opt)
        scaler.update()
        if i == overflow_step:
            skipped = all(torch.equal(before[n], p) for n, p in _local(model).items())
        scales.append(scaler.get_scale())
    return {"params": _local(model), "scales": scales, "skipped": skipped}


def test_grad_scaler_changes_nothing_without_overflow_and_skips_together():
    results = run_ranks(_grad_scaler, 2, 2, timeout=120)
    data = batches(4, 8)
    # The overflowing step is skipped on both stages: the result is training without that batch.
    want = reference(data[:2] + data[3:], lambda p: torch.optim.Adam(p, lr=0.01))
    assert_close(merge_local(results), want, tol=1e-6)
    for r in results:
        assert r["skipped"] is True
        assert r["scales"] == [65536.0, 65536.0, 32768.0, 32768.0]


# ---- the legacy smddp API and the "smddp" torch backend in one program ---------------------------

def _smddp_with_legacy_api():
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401  (registers "smddp")
    import smdistributed.dataparallel.torch.distributed as sdist
    from smdistributed.dataparallel.torch.parallel.distributed import DistributedDataParallel as SDDP

    tdist.init_process_group(backend="smddp")
    sdist.init_process_group()  # the default group exists: nothing to do
    rank, world = sdist.get_rank(), sdist.get_world_size()
    assert (rank, world) == (tdist.get_rank(), tdist.get_world_size())
    assert tdist.get_backend() == "smddp" and sdist.is_initialized()
    assert sdist.get_local_rank() == int(os.environ["LOCAL_RANK"])
    assert os.environ["SMDATAPARALLEL_LOCAL_RANK"] == os.environ["LOCAL_RANK"]

    out = {}
    t = torch.tensor([rank + 1.0])
    sdist.all_reduce(t, op=sdist.ReduceOp.AVERAGE)
    out["average"] = t.item()
    t = torch.tensor([rank * 10.0])
    sdist.broadcast(t, src=1)
    out["broadcast"] = t.item()
    parts = [torch.zeros(2) for _ in range(world)]
    sdist.all_gather(parts, torch.tensor([rank, rank + 0.5]))
    out["gather"] = torch.cat(parts).tolist()
    t = torch.tensor([1.0 + rank])
    sdist.all_reduce(t, op=sdist.ReduceOp.MAX, async_op=True).wait()
    out["max"] = t.item()
    t = torch.tensor([2.0])
    tdist.all_reduce(t)  # torch's own call on the smddp group
    out["torch_sum"] = t.item()
    sdist.barrier()

    # Torch's DDP on the smddp backend and the legacy DDP train identically, side by side.
    models = [TorchDDP(make_model()), SDDP(make_model())]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for x, y in batches(3, 8):
        xs, ys = shard(x, rank, world), shard(y, rank, world)
        for m, o in zip(models, opts):
            o.zero_grad()
            m(xs, labels=ys)["loss"].backward()
            o.step()
    out["params"] = [{n: p.detach().clone() for n, p in m.module.named_parameters()} for m in models]
    return out


def test_smddp_backend_and_legacy_api_in_one_program():
    results = run_ranks(_smddp_with_legacy_api, 2, timeout=120)
    want = reference(batches(3, 8), lambda p: torch.optim.SGD(p, lr=0.1))
    for r in results:
        assert r["average"] == 1.5 and r["broadcast"] == 10.0 and r["max"] == 2.0
        assert r["gather"] == [0.0, 0.5, 1.0, 1.5] and r["torch_sum"] == 4.0
        for params in r["params"]:
            assert_close(params, want)


def _legacy_init_then_torch_init(guarded):
    import torch.distributed as tdist

    import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401
    import smdistributed.dataparallel.torch.distributed as sdist

    sdist.init_process_group()
    # What a library does afterwards: Accelerate (used by the Hugging Face Trainer) checks first.
    if not guarded or not tdist.is_initialized():
        tdist.init_process_group(backend="smddp")
    t = torch.tensor([1.0])
    tdist.all_reduce(t)
    sdist.all_reduce(t)
    return t.item()


def test_legacy_init_then_guarded_torch_init():
    assert run_ranks(_legacy_init_then_torch_init, 2, True, timeout=60) == [4.0, 4.0]


def test_legacy_init_then_unconditional_torch_init():
    assert run_ranks(_legacy_init_then_torch_init, 2, False, timeout=60) == [4.0, 4.0]


# ---- a Hugging Face Trainer-style loop (the calls listed in SPEC section 5) ----------------------

GA = 2          # gradient accumulation: step calls per optimizer step (backward_passes_per_step)
OPT_STEPS = 4   # optimizer steps in the whole run
SAVE_AT = 2     # checkpoint after this many optimizer steps


def _hf_build(smp, seed):
    model = smp.DistributedModel(make_model(seed), backward_passes_per_step=GA)
    assert isinstance(model, smp.model.DistributedModel)
    # Hugging Face creates the optimizer after wrapping the model, from the wrapper's parameters.
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _hf_train(smp, hf, model, opt, sched, start, stop, ckpt=None, after_step_call=None):
    data = batches(OPT_STEPS * GA, 8)
    losses = []
    model.train()
    for i in range(start * GA, stop * GA):
        x, y = data[i]
        inputs = {"x": shard(x, smp.dp_rank(), smp.dp_size()),
                  "labels": shard(y, smp.dp_rank(), smp.dp_size())}
        loss_mb = hf.smp_forward_backward(model, inputs, GA)
        losses.append(loss_mb.reduce_mean().detach().item())
        if after_step_call is not None:
            after_step_call()
        if (i + 1) % GA == 0:
            opt.step()
            sched.step()
            model.zero_grad()
            if ckpt is not None and (i + 1) // GA == SAVE_AT:
                _hf_save(smp, model, opt, sched, ckpt)
    return losses


def _hf_save(smp, model, opt, sched, out):
    """Trainer._save_checkpoint with smp >= 1.10."""
    state_dict = model.state_dict()  # on every rank: gathered over the pipeline
    if smp.rank() == 0:
        os.makedirs(out, exist_ok=True)
        torch.save(state_dict, os.path.join(out, "pytorch_model.bin"))
        open(os.path.join(out, "user_content.pt"), "a").close()
        torch.save(sched.state_dict(), os.path.join(out, "scheduler.pt"))
    opt_state_dict = opt.local_state_dict(gather_if_shard=False)
    smp.barrier()
    if smp.rdp_rank() == 0 or smp.state.cfg.shard_optimizer_state:
        smp.save(opt_state_dict, os.path.join(out, "optimizer.pt"), partial=True,
                 v3=smp.state.cfg.shard_optimizer_state)
    smp.barrier()


def _hf_resume(smp, model, sched, ckpt):
    """Trainer._load_from_checkpoint + _load_optimizer_and_scheduler with smp."""
    import glob

    assert os.path.isfile(os.path.join(ckpt, "user_content.pt"))
    smp.resume_from_checkpoint(path=ckpt, tag="pytorch_model.bin", partial=False, load_optimizer=False)
    assert glob.glob(os.path.join(ckpt, "optimizer.pt") + "_*")

    def opt_load_hook(mod, opt):
        opt.load_state_dict(smp.load(os.path.join(ckpt, "optimizer.pt"), partial=True))

    model.register_post_step_hook(opt_load_hook)
    sched.load_state_dict(torch.load(os.path.join(ckpt, "scheduler.pt")))


def _hf_eval(smp, hf, model):
    import torch.distributed as tdist

    x, y = batches(1, 8, seed=7)[0]
    inputs = {"x": shard(x, smp.dp_rank(), smp.dp_size()), "labels": shard(y, smp.dp_rank(), smp.dp_size())}
    model.eval()
    with torch.no_grad():
        raw = hf.smp_forward_only(model, inputs)
    loss = raw["loss"].reduce_mean().detach().cpu()
    logits = hf.smp_nested_concat(raw["logits"])
    assert torch.equal(logits, raw["logits"].detach().concat())
    total = loss.clone()
    tdist.all_reduce(total, group=smp.get_dp_process_group())  # a user's own collective
    smp.barrier()
    return {"eval_loss": loss, "eval_loss_sum": total, "eval_logits": hf.smp_gather(logits),
            "eval_losses": hf.smp_gather(loss)}


def _trainer_loop(ckpt, shard=False):
    from tests.usage_helpers import hf_style as hf  # its @smp.step()s are made before smp.init

    import smdistributed.modelparallel.torch as smp

    smp.init(dict(MP2_DDP, shard_optimizer_state=shard))
    cfg = smp.state.cfg
    assert (cfg.fp16, cfg.prescaled_batch, cfg.shard_optimizer_state) == (False, False, shard)
    assert isinstance(smp.state.module_manager.translate_functions, list)
    assert tuple(int(v) for v in smp.__version__.split(".")[:2]) >= (1, 10)
    assert (smp.rdp_rank(), smp.rdp_size()) == (smp.dp_rank(), smp.dp_size())

    # Uninterrupted run, checkpointing on the way. A counting communication hook shows when the
    # gradients are averaged over the replicas.
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    model, opt, sched = _hf_build(smp, seed=0)
    reductions, tally = [], []

    def counting_hook(group, bucket):
        reductions.append(bucket.index())
        return allreduce_hook(group, bucket)

    model.register_comm_hook(smp.get_dp_process_group(), counting_hook)
    losses = _hf_train(smp, hf, model, opt, sched, 0, OPT_STEPS, ckpt=ckpt,
                       after_step_call=lambda: tally.append(len(reductions)))
    out = {"params": _local(model), "losses": losses, "dp_rank": smp.dp_rank(), "tally": tally}
    out.update(_hf_eval(smp, hf, model))

    # A new run resumed from the checkpoint (different initial weights: the load must matter).
    smp.reset()
    model, opt, sched = _hf_build(smp, seed=5)
    _hf_resume(smp, model, sched, ckpt)
    out["resumed_losses"] = _hf_train(smp, hf, model, opt, sched, SAVE_AT, SAVE_AT + 1)
    out["resumed_params_1"] = _local(model)  # one optimizer step after the resume
    out["resumed_losses"] += _hf_train(smp, hf, model, opt, sched, SAVE_AT + 1, OPT_STEPS)
    out["resumed_params"] = _local(model)
    return out


def _hf_reference(opt_steps):
    return reference(batches(OPT_STEPS * GA, 8)[:opt_steps * GA], lambda p: torch.optim.AdamW(p, lr=0.01),
                     lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)), ga=GA)


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("trainer") / "checkpoint-2"
    return run_ranks(_trainer_loop, 4, str(ckpt), timeout=180), ckpt


def test_trainer_style_loop(trainer_run):
    results, ckpt = trainer_run
    files = sorted(os.listdir(ckpt))
    assert files == ["optimizer.pt_0_0", "optimizer.pt_1_0", "pytorch_model.bin", "scheduler.pt",
                     "user_content.pt"]
    want = _hf_reference(OPT_STEPS)
    assert_close(merge_local(results), want)
    # backward_passes_per_step=GA: gradients are averaged over the replicas on every GA-th step
    # call only (the accumulation in between stays local).
    for r in results:
        per_call = [b - a for a, b in zip([0] + r["tally"][:-1], r["tally"])]
        assert [n > 0 for n in per_call] == [(i + 1) % GA == 0 for i in range(OPT_STEPS * GA)], per_call
    # The full state_dict saved by rank 0: the unwrapped module's keys, the weights at SAVE_AT.
    full = torch.load(ckpt / "pytorch_model.bin")
    assert_close(full, _hf_reference(SAVE_AT))

    # Evaluation: each replica's loss, gathered over the DP group, and the logits of both shards.
    ref = make_model()
    ref.load_state_dict(want)
    ref.eval()
    x, y = batches(1, 8, seed=7)[0]
    with torch.no_grad():
        ref_out = [ref(x[i:i + 4], labels=y[i:i + 4]) for i in (0, 4)]
    for r in results:
        assert torch.allclose(r["eval_logits"], torch.cat([o["logits"] for o in ref_out]), atol=1e-5)
        assert torch.allclose(r["eval_losses"], torch.stack([o["loss"] for o in ref_out]), atol=1e-5)
        assert torch.allclose(r["eval_loss_sum"], r["eval_losses"].sum(), atol=1e-6)

    # Resumed from the checkpoint (model via resume_from_checkpoint, optimizer via the post-step
    # hook): the first optimizer step after the resume is the uninterrupted run's.
    assert_close(merge_local(results, "resumed_params_1"), _hf_reference(SAVE_AT + 1))
    for r in results:
        assert r["resumed_losses"][:GA] == pytest.approx(r["losses"][SAVE_AT * GA:(SAVE_AT + 1) * GA],
                                                         abs=1e-6)


def test_trainer_resume_continues_like_the_uninterrupted_run(trainer_run):
    results, _ = trainer_run
    assert_close(merge_local(results, "resumed_params"), _hf_reference(OPT_STEPS))


def test_trainer_style_loop_with_sharded_optimizer_state(tmp_path):
    # The same Trainer calls with "shard_optimizer_state": every replica saves its shard
    # (v3 files), the resumed run merges them back: same results as the unsharded run.
    ckpt = tmp_path / "checkpoint-2"
    results = run_ranks(_trainer_loop, 4, str(ckpt), True, timeout=180)
    files = sorted(os.listdir(ckpt))
    assert files == ["optimizer.pt_0_0_0", "optimizer.pt_0_0_1", "optimizer.pt_1_0_0",
                     "optimizer.pt_1_0_1", "pytorch_model.bin", "scheduler.pt",
                     "user_content.pt"], files
    assert_close(merge_local(results), _hf_reference(OPT_STEPS))
    assert_close(merge_local(results, "resumed_params_1"), _hf_reference(SAVE_AT + 1))
    assert_close(merge_local(results, "resumed_params"), _hf_reference(OPT_STEPS))
