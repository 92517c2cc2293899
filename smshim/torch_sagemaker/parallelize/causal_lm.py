"""The transformed model's forward: the Hugging Face causal-LM call (`input_ids=`,
`attention_mask=`, `labels=`, ...) with the loss computed where the logits live.

With TP the LM head yields this rank's vocabulary slice: the loss comes from the slices
(vocab_parallel.py) and the returned logits are the full, gathered ones. With CP the inputs are
this rank's two chunks: positions are the tokens' global positions, labels are shifted over the
full sequence, and the loss is the mean over the whole sequence (equal on every CP rank).
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from smshim.torch_sagemaker.parallelize import context_parallel as cp
from smshim.torch_sagemaker.parallelize.vocab_parallel import gather_vocab, vocab_parallel_token_losses

IGNORE_INDEX = -100


@dataclass
class ForwardSetup:
    tp_mesh: Optional[DeviceMesh]
    cp_mesh: Optional[DeviceMesh]
    signature: Optional[inspect.Signature] = None  # of the HF class's forward, set by install


def _bind(sig: inspect.Signature, model, args, kwargs) -> dict:
    bound = sig.bind(model, *args, **kwargs).arguments
    bound.pop("self", None)
    extra = bound.pop("kwargs", {})
    bound.update(extra)
    return bound


def _loss(model, out, labels, call, setup: ForwardSetup) -> torch.Tensor:
    logits = out.logits
    if "shift_labels" in call and call["shift_labels"] is not None:
        target = call["shift_labels"]
    elif setup.cp_mesh is not None:
        target = cp.cp_shift_labels(labels, setup.cp_mesh, IGNORE_INDEX)
    else:
        target = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    target = target.reshape(-1).to(logits.device)
    flat = logits.reshape(-1, logits.shape[-1])
    if setup.tp_mesh is not None:
        per_token = vocab_parallel_token_losses(flat, target, setup.tp_mesh, IGNORE_INDEX)
    else:
        per_token = F.cross_entropy(flat.float(), target, ignore_index=IGNORE_INDEX,
                                    reduction="none")
    total = per_token.sum()
    count = call.get("num_items_in_batch")
    if count is None:
        count = (target != IGNORE_INDEX).sum()
        if setup.cp_mesh is not None:
            count = count.clone()
            torch.distributed.all_reduce(count, group=setup.cp_mesh.get_group())
    if setup.cp_mesh is not None:
        total = cp.cp_sum(total, setup.cp_mesh)
    loss = total / count
    aux = getattr(out, "aux_loss", None)
    if aux is not None:  # MoE router loss, as HF adds it when labels are given
        loss = loss + model.router_aux_loss_coef * aux.to(loss.device)
    z_losses = getattr(model, "_smshim_z_losses", None)
    if z_losses:  # router z-losses (MoEConfig.moe_z_loss_coeff), one per MoE layer
        loss = loss + sum(z_losses)
    return loss


def transformed_forward(self, *args, **kwargs):
    """Drop-in for the HF causal LM's forward (installed per instance by `install`)."""
    setup: ForwardSetup = self._smshim_forward_setup
    if getattr(self, "_smshim_z_losses", None) is not None:
        self._smshim_z_losses.clear()  # the routers append this call's z-losses
    hf_forward = type(self).forward
    call = _bind(setup.signature, self, args, kwargs)
    labels = call.pop("labels", None)
    return_dict = call.pop("return_dict", None)
    if setup.cp_mesh is not None:
        mask = call.get("attention_mask")
        if mask is not None:
            if mask.dim() != 2 or not bool(mask.all()):
                raise NotImplementedError("context parallelism supports unpadded causal batches "
                                          "only: pass attention_mask=None")
            call["attention_mask"] = None
        if call.get("position_ids") is None:
            ref = call.get("input_ids")
            if ref is None:
                ref = call["inputs_embeds"]
            n, r = setup.cp_mesh.size(), setup.cp_mesh.get_local_rank()
            cp._chunks(ref.shape[1] * n, n)
            call["position_ids"] = cp.cp_positions(ref.shape[1], r, n, ref.device).unsqueeze(0)
    loss_kwargs = {k: call.pop(k) for k in ("num_items_in_batch", "shift_labels") if k in call}
    out = hf_forward(self, **call, return_dict=True)
    if labels is not None or "shift_labels" in loss_kwargs:
        out.loss = _loss(self, out, labels, loss_kwargs, setup)
    if setup.tp_mesh is not None:
        out.logits = gather_vocab(out.logits, setup.tp_mesh)
    return out.to_tuple() if return_dict is False else out


def install(model: nn.Module, setup: ForwardSetup) -> None:
    setup.signature = inspect.signature(type(model).forward)
    model._smshim_forward_setup = setup
    model.forward = types.MethodType(transformed_forward, model)
