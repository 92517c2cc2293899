"""Hugging Face transformers/accelerate on smshim: what runs on a CPU machine.

transformers detects SageMaker MP/DP from the environment `smshim run --distribution` sets, imports
`smdistributed.modelparallel.torch` (ours) and calls `smp.init()`. Its Trainer then hard-codes CUDA
for MP and accelerate's SageMaker-DP path hard-codes a CUDA device, so on CPU we test the pieces
they call: transformers' own `smp_forward_backward` / `smp_forward_only` / `smp_gather` /
`smp_nested_concat` on a real (tiny, locally built) GPT-2, and accelerate's `smddp` process group.
"""

import json
import os
import sys

import pytest
import torch

from smshim.testing import run_command, run_ranks

transformers = pytest.importorskip("transformers")

HERE = os.path.dirname(__file__)
MP_ENV = {"SM_HP_MP_PARAMETERS": json.dumps({"partitions": 2, "microbatches": 2}),
          "SM_FRAMEWORK_PARAMS": json.dumps({"sagemaker_mpi_enabled": True})}


@pytest.mark.parametrize("kind", ["modelparallel", "dataparallel"])
def test_transformers_detects_sagemaker_under_smshim_run(tmp_path, kind):
    dist = ({"smdistributed": {"modelparallel": {"enabled": True, "parameters": {"partitions": 2}}},
             "mpi": {"enabled": True, "processes_per_host": 2}} if kind == "modelparallel"
            else {"smdistributed": {"dataparallel": {"enabled": True}}})
    run_command([sys.executable, "-m", "smshim", "run", "-n", "2", "--distribution", json.dumps(dist),
                 os.path.join(HERE, "scripts", "hf_detect.py")], timeout=180,
                env={"DUMP_DIR": str(tmp_path), "SM_HP_MP_PARAMETERS": None}, cwd=str(tmp_path))
    for rank in range(2):
        info = json.loads((tmp_path / f"hf{rank}.json").read_text())
        if kind == "modelparallel":
            assert info["smp_post_1_10"] is True  # from smdistributed.modelparallel.__version__
            assert info["mp"] and not info["dp"]
            assert info["initialized"] and info["pp_size"] == 2 and info["rank"] == rank
        else:
            assert info["dp"] and not info["mp"]


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=4, n_head=2,
                     use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def _ids():
    return torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(0))


def _hf_trainer_calls():
    from transformers import trainer_pt_utils as tpu

    import smdistributed.modelparallel.torch as smp

    model = smp.DistributedModel(_tiny_gpt2())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ids = _ids()
    losses = []
    for _ in range(2):
        opt.zero_grad()
        loss = tpu.smp_forward_backward(model, {"input_ids": ids, "labels": ids}, 1)
        opt.step()
        losses.append(loss.reduce_mean().item())
    out = tpu.smp_forward_only(model, {"input_ids": ids})
    logits = tpu.smp_nested_concat(out["logits"])  # StepOutput.detach().concat()
    gathered = tpu.smp_gather(torch.tensor([float(smp.rank())]))  # allgather over DP_GROUP
    return {"losses": losses, "logits": logits, "gathered": gathered.tolist(),
            "params": {n: p.detach() for n, p in model.local_named_parameters()}}


def test_transformers_smp_calls_pipeline_a_gpt2_like_single_process():
    results = run_ranks(_hf_trainer_calls, 2, timeout=180, env=MP_ENV)
    ref = _tiny_gpt2()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ids = _ids()
    ref_losses = []
    for _ in range(2):
        opt.zero_grad()
        # smp averages over the two microbatches of 2 sequences
        loss = sum(ref(input_ids=ids[i:i + 2], labels=ids[i:i + 2]).loss for i in (0, 2)) / 2
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    merged = {}
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, abs=1e-5)
        merged.update(r["params"])
        assert r["gathered"] == [0.0] if r is results[0] else [1.0]  # dp=1: each its own
    names = [n for n, _ in ref.named_parameters()]
    assert sorted(merged) == sorted(names)
    for n, p in ref.named_parameters():
        assert (merged[n] - p.detach()).abs().max() < 1e-5, n
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
    for r in results:
        assert torch.allclose(r["logits"], expected, atol=1e-5)


def _gpt2_split_by_hand(steps):
    import smdistributed.modelparallel.torch as smp
    from smshim.modelparallel.torch.pipeline import weight_grad

    torch.set_num_threads(1)
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4, "auto_partition": False,
              "default_partition": 0})
    module = _tiny_gpt2()
    model = smp.DistributedModel(module)
    for block in module.transformer.h[2:]:
        smp.set_partition(block, 1)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train_step(model, ids):
        out = model(input_ids=ids, labels=ids)
        model.backward(out.loss)
        return out.loss

    for _ in range(steps):
        train_step(model, _ids())
        opt.step()
        opt.zero_grad()
    # The Conv1D projections of this rank's blocks took the fused weight-gradient path.
    fused = [name for name, m in module.named_modules()
             if getattr(m.__dict__.get("forward"), "__qualname__", "").startswith(
                 weight_grad.fused_forward.__name__)]
    return fused, {n: p.detach() for n, p in model.local_named_parameters()}


def test_gpt2_split_by_hand_trains_as_one_process():
    # GPT-2's blocks on two ranks, four microbatches of one sequence: the parameters after three
    # steps equal single-process training on the whole batch.
    results = run_ranks(_gpt2_split_by_hand, 2, 3, timeout=180)
    ref = _tiny_gpt2()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ids = _ids()
    for _ in range(3):
        opt.zero_grad()
        loss = sum(ref(input_ids=ids[i:i + 1], labels=ids[i:i + 1]).loss for i in range(4)) / 4
        loss.backward()
        opt.step()
    for rank, (fused, _) in enumerate(results):
        # (pp_rank 0 also owns the head, a Linear, tied to the embedding.)
        assert fused == [f"transformer.h.{b}.{p}" for b in (2 * rank, 2 * rank + 1)
                         for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")] + (
                             ["lm_head"] if rank == 0 else [])
    merged = {**results[0][1], **results[1][1]}
    assert sorted(merged) == sorted(n for n, _ in ref.named_parameters())
    for n, p in ref.named_parameters():
        assert (merged[n] - p.detach()).abs().max() < 1e-5, n


def _accelerate_smddp():
    import torch.distributed as dist
    from accelerate import PartialState

    try:
        state = PartialState(_use_sagemaker_dp=True)
        stopped_at = None
        assert state.num_processes == 2
    except ZeroDivisionError as e:  # accelerate picks a CUDA device for SageMaker DP
        stopped_at = f"{type(e).__name__} in accelerate's device selection"
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_backend(), t.item(), stopped_at


def test_accelerate_sagemaker_dp_brings_up_smddp():
    pytest.importorskip("accelerate")
    env = {"SM_FRAMEWORK_PARAMS": json.dumps({"sagemaker_distributed_dataparallel_enabled": True})}
    for backend, total, stopped_at in run_ranks(_accelerate_smddp, 2, timeout=120, env=env):
        assert backend == "smddp" and total == 3.0
        # On a CPU machine accelerate stops after our process group is up (documented in the
        # README); on a GPU machine it goes on.
        assert stopped_at is None or torch.cuda.device_count() == 0
