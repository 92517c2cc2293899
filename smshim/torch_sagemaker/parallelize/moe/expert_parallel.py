"""Experts split over the EP group, tokens dispatched to their experts' ranks with all-to-all.

Each EP rank keeps E/ep experts (DTensor Shard(0) of HF's stacked expert weights, so the module
tree and state-dict keys stay HF's) and its own tokens (EP ranks are data-parallel ranks). Per MoE
layer: route locally, send each (token, expert) pair to the expert's rank, run the local experts,
send the outputs back, and weight them by the router there (so the router gets its gradient).
Expert gradients arrive summed over the EP ranks' tokens; they are scaled by 1/ep, so that the
data-parallel average the other parameters get (FSDP/DDP over the EP group, with the experts
kept out of it, e.g. FSDP1 ignored_modules) yields the gradient of the mean loss for both.
"""

from __future__ import annotations

import logging
from typing import List

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from smshim.torch_sagemaker.parallelize.moe.moe_config import MoEConfig
from smshim.torch_sagemaker.parallelize.moe.routing import install_router

logger = logging.getLogger(__name__)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits: List[int], in_splits: List[int], group):  # noqa: D102
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):  # noqa: D102
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return grad * ctx.scale, None


class ExpertParallelExperts(nn.Module):
    """Drop-in for HF's stacked experts module (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I],
    called as experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]))."""

    def __init__(self, experts: nn.Module, mesh: DeviceMesh):
        super().__init__()
        self.mesh = mesh
        self.num_experts = experts.num_experts
        self.act_fn = experts.act_fn
        ep, r = mesh.size(), mesh.get_local_rank()
        self.per_rank = self.num_experts // ep
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name).detach()
            local = full.chunk(ep, dim=0)[r].contiguous()
            self.register_parameter(name, nn.Parameter(
                DTensor.from_local(local, mesh, [Shard(0)], run_check=False)))

    def _run_local(self, x, local_expert):
        ep = self.mesh.size()
        w1 = _ScaleGrad.apply(self.gate_up_proj.to_local(), 1.0 / ep)
        w2 = _ScaleGrad.apply(self.down_proj.to_local(), 1.0 / ep)
        out = x.new_zeros(x.shape[0], w2.shape[1])
        for j in range(self.per_rank):
            rows = (local_expert == j).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            gate, up = nn.functional.linear(x[rows], w1[j]).chunk(2, dim=-1)
            y = nn.functional.linear(self.act_fn(gate) * up, w2[j])
            out = out.index_add(0, rows, y)
        return out

    def forward(self, hidden_states, top_k_index, top_k_weights):  # noqa: D102
        group, ep = self.mesh.get_group(), self.mesh.size()
        T, k = top_k_index.shape
        token = torch.arange(T, device=hidden_states.device).repeat_interleave(k)
        expert = top_k_index.reshape(-1)
        order = torch.argsort(expert, stable=True)
        token, expert = token[order], expert[order]
        weight = top_k_weights.reshape(-1)[order]
        send = torch.bincount(expert // self.per_rank, minlength=ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        send_l, recv_l = send.tolist(), recv.tolist()
        x = _AllToAll.apply(hidden_states[token], recv_l, send_l, group)
        e_in = torch.empty(sum(recv_l), dtype=expert.dtype)
        dist.all_to_all_single(e_in, expert.contiguous(), recv_l, send_l, group=group)
        y = self._run_local(x, e_in - self.mesh.get_local_rank() * self.per_rank)
        y = _AllToAll.apply(y, send_l, recv_l, group)
        y = y * weight.unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(hidden_states).index_add(0, token, y.to(hidden_states.dtype))


def _moe_blocks(model, plan):
    for layer in model.get_submodule(plan.layers):
        block = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
        if block is None or not hasattr(block, "experts") or not hasattr(block, "gate"):
            raise TypeError(f"{type(layer).__name__} has no MoE block (mlp.gate + mlp.experts) "
                            "that expert parallelism knows")
        yield block


def apply_routing(model: nn.Module, plan, config: MoEConfig) -> List[torch.Tensor]:
    """Install the MoEConfig's router and loss settings; returns the list z-losses collect in."""
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig for {type(model).__name__}, got "
                        f"{type(config).__name__}")
    z_losses: List[torch.Tensor] = []
    for block in _moe_blocks(model, plan):
        install_router(block.gate, config, z_losses)
    if config.moe_load_balancing == "aux_loss":
        model.config.output_router_logits = True
        model.router_aux_loss_coef = config.moe_aux_loss_coeff
    else:
        model.config.output_router_logits = False
    model._smshim_z_losses = z_losses
    return z_losses


def parallelize_experts(model: nn.Module, plan, mesh: DeviceMesh, config) -> frozenset:
    """Split every MoE layer's experts over `mesh`; returns the split parameters' names."""
    config = config if config is not None else MoEConfig()
    E = model.config.num_local_experts
    if E % mesh.size():
        raise ValueError(f"expert_parallel_degree {mesh.size()} must divide the "
                         f"{E} experts of {type(model).__name__}")
    apply_routing(model, plan, config)
    for block in _moe_blocks(model, plan):
        block.experts = ExpertParallelExperts(block.experts, mesh)
    return frozenset(n for n, p in model.named_parameters() if isinstance(p, DTensor))
