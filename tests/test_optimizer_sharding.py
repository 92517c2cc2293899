"""shard_optimizer_state: optimizer state split over data-parallel replicas (ZeRO-1).

pp=2 x dp=2 jobs train the Net of pipeline_models with Adam and must end where single-process
training on the same global batches ends, with each stage's optimizer state held once over its
replicas; the gathered state equals the single-process optimizer's; a sharded checkpoint written
at dp=2 (smp.save(..., v3=True), one file per replica) loads at dp=1 and training continues
exactly.
"""

import torch
import torch.nn.functional as F

from smshim.testing import run_ranks
from tests.pipeline_models import batches, make_model

TOL = 1e-5
MP_TOL = 1e-3


def _reference(steps, batch=16, dtype=None, m=4, fresh_optimizer_at=None, scale=1.0):
    model = make_model("net")
    if dtype is not None:
        model.to(dtype)
    params = list(model.parameters())
    masters = [p.detach().float().clone() for p in params] if dtype is not None else params
    opt = torch.optim.Adam(masters, lr=0.01)
    names = [n for n, _ in model.named_parameters()]
    for step, (x, y) in enumerate(batches("net", steps, batch)):
        if step == fresh_optimizer_at:
            opt = torch.optim.Adam(masters, lr=0.01)
        for p in params:
            p.grad = None
        k = batch // m
        for mb in range(m):
            xs = x[mb * k:(mb + 1) * k]
            out = model(xs.to(dtype) if dtype is not None else xs, scale=0.5)
            (F.cross_entropy(out["logits"].float(), y[mb * k:(mb + 1) * k]) * (scale / m)).backward()
        if dtype is not None:
            for w, p in zip(masters, params):
                w.grad = p.grad.float() / scale
        opt.step()
        if dtype is not None:
            with torch.no_grad():
                for p, w in zip(params, masters):
                    p.copy_(w)
    return {n: w.detach().clone() for n, w in zip(names, masters)}, opt.state_dict()


def _job(cfg, steps, batch, save_dir=None, load_dir=None, dtype_name=None, ckpt=(), manual=None):
    import smdistributed.modelparallel.torch as smp

    smp.init(cfg)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype_name)
    dp, dp_rank = smp.dp_size(), smp.dp_rank()
    module = make_model("net")
    for name in ckpt:
        smp.set_activation_checkpointing(module.get_submodule(name))
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                   **({"static_loss_scale": 64.0} if dtype_name == "fp16" else {}))
    for name, pid in (manual or {}).items():
        smp.set_partition(module.get_submodule(name), pid)

    @smp.step
    def train_step(model, x, y):
        out = model(x, scale=0.5)
        loss = F.cross_entropy(out["logits"].float(), y)
        model.backward(loss)
        return loss

    data = batches("net", steps, batch)
    if load_dir is not None:
        if load_dir.endswith("@checkpoint"):  # smp.save_checkpoint's layout
            smp.resume_from_checkpoint(load_dir[:-len("@checkpoint")], partial=True)
        else:
            # As Hugging Face's Trainer resumes: each rank reads its pp rank's files.
            model.load_state_dict(smp.load(f"{load_dir}/model", partial=True))
            opt.load_state_dict(smp.load(f"{load_dir}/optimizer", partial=True))
        data = data[3:]
    for x, y in data:
        k = batch // dp
        x, y = x[dp_rank * k:(dp_rank + 1) * k], y[dp_rank * k:(dp_rank + 1) * k]
        opt.zero_grad()
        train_step(model, x.to(dtype) if dtype is not None else x, y)
        opt.step()
    own_state = len(opt.optimizer.state)
    gathered = opt.local_state_dict(gather_if_shard=True)
    full = opt.state_dict()
    if save_dir is not None:
        # As Hugging Face's Trainer saves with shard_optimizer_state: every replica its shard.
        if smp.rdp_rank() == 0:
            smp.save(model.local_state_dict(), f"{save_dir}/model", partial=True)
        smp.save(opt.local_state_dict(gather_if_shard=False), f"{save_dir}/optimizer",
                 partial=True, v3=True)
        # And smp's own checkpoint (the sharded state is gathered over the replicas).
        smp.save_checkpoint(f"{save_dir}/ckpt", "step3", model=model, optimizer=opt)
        smp.barrier()
    weights, lowp = {}, {}
    for n, p in model.local_named_parameters():
        if p.dtype in (torch.bfloat16, torch.float16):
            lowp[n] = p.detach().clone()
            if not opt._shard.owns(p):
                continue  # its fp32 master lives on the replica that steps it
            weights[n] = opt._masters.weight(p).detach().clone()
            assert torch.equal(lowp[n], weights[n].to(p.dtype)), n
        else:
            weights[n] = p.detach().clone()
    return {"weights": weights, "lowp": lowp, "pp_rank": smp.pp_rank(), "dp_rank": dp_rank,
            "own_state": own_state, "local_params": len(list(model.local_parameters())),
            "gathered_state": len(gathered["state"]), "full": full if smp.rank() == 0 else None}


def _check(results, ref, tol):
    merged, lowp = {}, {}
    for r in results:
        for n, p in r["lowp"].items():  # replicas' bf16 weights are identical
            assert n not in lowp or torch.equal(lowp[n], p), n
            lowp[n] = p
        for n, w in r["weights"].items():
            if n in merged:  # replicas stay identical
                assert (merged[n] - w).abs().max().item() == 0, n
            merged[n] = w
    assert set(merged) == set(ref)
    for n, w in ref.items():
        diff = (merged[n] - w).abs().max().item()
        assert diff < tol, f"{n}: max abs diff {diff}"


def _check_sharded(results):
    for pp in sorted({r["pp_rank"] for r in results}):
        stage = [r for r in results if r["pp_rank"] == pp]
        n = stage[0]["local_params"]
        # Each replica keeps the state of only its share; together exactly every parameter.
        assert all(0 < r["own_state"] < n for r in stage), [r["own_state"] for r in stage]
        assert sum(r["own_state"] for r in stage) == n
        assert all(r["gathered_state"] == n for r in stage)


def _assert_state_close(a, b, tol):
    assert sorted(a["state"]) == sorted(b["state"])
    for i in a["state"]:
        for k, v in a["state"][i].items():
            diff = (v.float() - b["state"][i][k].float()).abs().max().item()
            assert diff < tol, (i, k, diff)


def test_sharded_pp2_dp2_matches_single_process():
    cfg = {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True,
           "shard_optimizer_state": True}
    results = run_ranks(_job, 4, cfg, 3, 16, timeout=150)
    ref, ref_opt = _reference(3)
    _check(results, ref, TOL)
    _check_sharded(results)
    _assert_state_close(results[0]["full"], ref_opt, TOL)


def test_sharded_fp16_pp1_dp2():
    cfg = {"microbatches": 2, "ddp": True, "fp16": True, "shard_optimizer_state": True}
    results = run_ranks(_job, 2, cfg, 3, 16, None, None, "fp16", timeout=150)
    ref, _ = _reference(3, dtype=torch.float16, scale=64.0)
    _check(results, ref, MP_TOL)
    _check_sharded(results)


def test_sharded_bf16_with_checkpointed_layers_on_both_stages():
    cfg = {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True, "bf16": True,
           "shard_optimizer_state": True, "auto_partition": False, "default_partition": 0,
           "deterministic_server": True}
    # Manual partition: blocks 0-1 on stage 0, blocks 2-3 and the head on stage 1.
    manual = {"blocks.2": 1, "blocks.3": 1, "head": 1}
    results = run_ranks(_job, 4, cfg, 3, 16, None, None, "bf16",
                        ("blocks.0", "blocks.1", "blocks.2", "blocks.3"), manual, timeout=150)
    ref, _ = _reference(3, dtype=torch.bfloat16)
    _check(results, ref, MP_TOL)
    _check_sharded(results)


def test_sharded_checkpoint_saved_at_dp2_loads_at_dp1(tmp_path):
    cfg2 = {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True,
            "shard_optimizer_state": True}
    run_ranks(_job, 4, cfg2, 3, 16, str(tmp_path), timeout=150)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["ckpt", "model_0_0", "model_1_0", "optimizer_0_0_0", "optimizer_0_0_1",
                     "optimizer_1_0_0", "optimizer_1_0_1"], files
    # dp=1: the two shards of each stage are merged on load; one more step on the full batch.
    cfg1 = {"pipeline_parallel_degree": 2, "microbatches": 4}
    results = run_ranks(_job, 2, cfg1, 4, 16, None, str(tmp_path), timeout=150)
    ref, ref_opt = _reference(4)
    _check(results, ref, TOL)
    _assert_state_close(results[0]["full"], ref_opt, TOL)
    # The same through smp.save_checkpoint / smp.resume_from_checkpoint.
    results = run_ranks(_job, 2, cfg1, 4, 16, None, f"{tmp_path}/ckpt@checkpoint", timeout=150)
    _check(results, ref, TOL)
    _assert_state_close(results[0]["full"], ref_opt, TOL)
    # And it can fail: without the saved optimizer state the continued run ends elsewhere.
    fresh, _ = _reference(4, fresh_optimizer_at=3)
    assert max((fresh[n] - ref[n]).abs().max().item() for n in ref) > 100 * TOL
