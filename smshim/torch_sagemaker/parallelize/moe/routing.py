"""Router top-k selection with the MoEConfig load-balancing modes, replacing the forward of the
HF router module in place (its `weight` keeps its HF name). The selection returns what HF's
MixtralTopKRouter returns: (router_logits, top-k weights renormalised to sum 1, top-k indices)."""

from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F


def sinkhorn(cost: torch.Tensor, iters: int = 8, tol: float = 1e-4) -> torch.Tensor:
    """Sinkhorn normalisation of exp(logits) towards uniform token and expert marginals."""
    cost = torch.exp(cost - cost.max())
    d0 = torch.ones(cost.size(0), dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), dtype=cost.dtype)
    eps = 1e-8
    for _ in range(iters):
        d0_new = (1 / d0.size(0)) / ((cost * d1).sum(1) + eps)
        d1_new = (1 / d1.size(0)) / ((d0_new.unsqueeze(1) * cost).sum(0) + eps)
        done = (d1_new - d1).abs().mean() < tol
        d0, d1 = d0_new, d1_new
        if done:
            break
    return d1 * cost * d0.unsqueeze(1)


def balanced_topk(probs: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k experts per token, each expert taking about ceil(T·k/E) tokens: tokens are served
    in order of their best probability, each getting its most probable experts with room left
    (a token served late that finds fewer than k with room overflows)."""
    T, E = probs.shape
    cap = math.ceil(T * k / E)
    load = [0] * E
    ranked = probs.argsort(dim=-1, descending=True).tolist()
    order = probs.max(dim=-1).values.argsort(descending=True).tolist()
    out = torch.empty(T, k, dtype=torch.long)
    for t in order:
        chosen = [e for e in ranked[t] if load[e] < cap][:k]
        # The last tokens may find fewer than k experts with room: they overflow onto their
        # most probable remaining experts (never the same expert twice).
        chosen += [e for e in ranked[t] if e not in chosen][:k - len(chosen)]
        for e in chosen:
            load[e] += 1
        out[t] = torch.tensor(chosen)
    return out


def _route(self, hidden_states):
    cfg = self._smshim_moe
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    probs = torch.softmax(logits.float(), dim=-1)
    mode = cfg.moe_load_balancing
    if self.training and mode == "sinkhorn":
        with torch.no_grad():
            index = torch.topk(sinkhorn(logits.detach().float()), self.top_k, dim=-1).indices
    elif self.training and mode == "balanced":
        with torch.no_grad():
            index = balanced_topk(probs.detach(), self.top_k)
    else:
        index = torch.topk(probs, self.top_k, dim=-1).indices
    weights = probs.gather(-1, index)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    if self.training and mode != "none" and cfg.moe_z_loss_coeff:
        z = torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
        self._smshim_z_losses.append(cfg.moe_z_loss_coeff * z)
    return logits, weights, index


def install_router(router: torch.nn.Module, cfg, z_losses: list) -> None:
    router._smshim_moe = cfg
    router._smshim_z_losses = z_losses
    router.forward = types.MethodType(_route, router)
