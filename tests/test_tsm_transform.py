"""tsm.transform's engine (smshim.torch_sagemaker.transform.apply): tensor, context and expert
parallelism of tiny Hugging Face models train exactly like one process training the plain model
on the same global batch (fp32, parameters within 1e-5 after 3 AdamW steps)."""

from __future__ import annotations

import pytest
import torch

from smshim.testing import run_ranks
from tests import tsm_models

TOL = 1e-5


def _init(mesh_shape, names):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    return init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)


def _tp_train(kind, attn="sdpa"):
    from smshim.torch_sagemaker.transform import apply, full_hf_state_dict

    mesh = _init((2,), ("tp",))
    model = apply(tsm_models.make(kind, attn=attn), tp_mesh=mesh["tp"])
    opt = tsm_models.optimizer(model)
    losses = []
    for x in tsm_models.batches():
        opt.zero_grad()
        out = model(input_ids=x, labels=x)
        assert out.logits.shape == (*x.shape, tsm_models.VOCAB)
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                for p in model.parameters())
    return {"sd": full_hf_state_dict(model), "losses": losses, "local_numel": local}


@pytest.mark.parametrize("kind,attn", [("llama", "sdpa"), ("llama", "eager"), ("gpt_neox", "sdpa"),
                                       ("mistral", "sdpa")])
def test_tp2_matches_one_process(kind, attn):
    results = run_ranks(_tp_train, 2, kind, attn, timeout=180)
    ref_sd, ref_losses = tsm_models.train_reference(kind, attn=attn)
    for r in results:
        assert tsm_models.max_diff(r["sd"], ref_sd) < TOL
        assert r["losses"] == pytest.approx(ref_losses, abs=TOL)
    full = sum(v.numel() for v in tsm_models.make(kind).parameters())
    assert results[0]["local_numel"] < 0.7 * full
