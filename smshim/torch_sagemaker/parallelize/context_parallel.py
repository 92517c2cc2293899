"""Context parallelism: each CP rank holds 2 of the 2·cp sequence chunks (rank r: chunks r and
2·cp−1−r, which balances causal work) and attends exactly over the whole sequence, by passing K/V
around the ring ("p2p") or all-gathering them ("all_gather").

Installed as a Hugging Face attention implementation ("smshim_cp"): the HF attention modules
still project, rotate and reshape; only the score/softmax/value step is replaced. Each block of
keys is attended with its own log-sum-exp, and the blocks are merged exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

ATTN_IMPLEMENTATION = "smshim_cp"
COMM_TYPES = ("p2p", "all_gather")


def _chunks(size: int, cp_size: int) -> int:
    if size % (2 * cp_size):
        raise ValueError(f"context parallelism over {cp_size} ranks splits sequences into "
                         f"{2 * cp_size} chunks; the sequence length {size} does not divide by "
                         f"{2 * cp_size}: pad it to a multiple")
    return size // (2 * cp_size)


def split_for_cp(t: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's part of a full-length batch tensor: chunks r and 2·cp−1−r of 2·cp."""
    if cp_size == 1:
        return t
    c = _chunks(t.shape[dim], cp_size)
    parts = t.split(c, dim=dim)
    return torch.cat([parts[cp_rank], parts[2 * cp_size - 1 - cp_rank]], dim=dim)


def merge_cp_parts(parts: List[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of split_for_cp: the full tensor from every CP rank's part, in CP-rank order."""
    cp_size = len(parts)
    chunks: List[Optional[torch.Tensor]] = [None] * (2 * cp_size)
    for r, p in enumerate(parts):
        first, second = p.chunk(2, dim=dim)
        chunks[r], chunks[2 * cp_size - 1 - r] = first, second
    return torch.cat(chunks, dim=dim)


def cp_positions(local_len: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Global token positions of a CP rank's local tokens, shape [local_len]."""
    c = local_len // 2
    a = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    b = torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c, device=device)
    return torch.cat([a, b])


class _RingShift(torch.autograd.Function):
    """Send to the next CP rank, receive from the previous; the gradient goes the other way."""

    @staticmethod
    def forward(ctx, t, group):  # noqa: D102
        ctx.group = group
        return _shift(t, group, +1)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return _shift(grad.contiguous(), ctx.group, -1), None


def _shift(t: torch.Tensor, group, step: int) -> torch.Tensor:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    out = torch.empty_like(t)
    dst = dist.get_global_rank(group, (r + step) % n)
    src = dist.get_global_rank(group, (r - step) % n)
    ops = [dist.P2POp(dist.isend, t.contiguous(), dst, group), dist.P2POp(dist.irecv, out, src, group)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return out


class _AllGatherSeq(torch.autograd.Function):
    """Concatenate every CP rank's tensor along dim 0; the gradient of each part is summed over
    the ranks that used it (all-reduce, then this rank's slice: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, t, group):  # noqa: D102
        ctx.group = group
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(n, dim=0)[r], None


def _block(q, k, v, pq, pk, scaling):
    """Causal attention of q over one block of keys: (output [B,H,Lq,D], logsumexp [B,H,Lq])."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    allowed = pk.unsqueeze(0) <= pq.unsqueeze(1)
    # A finite fill: a row with no allowed key gets a weight of exactly 0 in the merge.
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), v)
    return out, lse


def _merge(outs, lses):
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    return sum(o * (l - lse).exp().unsqueeze(-1) for o, l in zip(outs, lses))


@dataclass
class CPContext:
    """Attached to every attention module as `_smshim_cp`."""

    mesh: DeviceMesh
    comm_type: str = "p2p"


def _repeat_kv(t: torch.Tensor, n: int) -> torch.Tensor:
    return t if n == 1 else t.repeat_interleave(n, dim=1)


def cp_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                         **kwargs):
    """HF attention-interface function: query [B,H,L,D], key/value [B,Hkv,L,D] of this CP
    rank's local tokens → (output [B,L,H,D], None)."""
    ctx: CPContext = module._smshim_cp
    if attention_mask is not None:
        raise NotImplementedError("context parallelism supports causal attention without an "
                                  "attention_mask only (pass attention_mask=None)")
    if dropout and module.training:
        raise NotImplementedError("context parallelism does not support attention dropout; set "
                                  "the config's attention_dropout to 0")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    group = ctx.mesh.get_group()
    n, r = ctx.mesh.size(), ctx.mesh.get_local_rank()
    rep = getattr(module, "num_key_value_groups", 1)
    L = query.shape[2]
    pq = cp_positions(L, r, n, query.device)
    kv = torch.stack([key, value])
    if ctx.comm_type == "all_gather":
        kv_all = _AllGatherSeq.apply(kv.transpose(0, 3).contiguous(), group).transpose(0, 3)
        pk = torch.cat([cp_positions(L, j, n, query.device) for j in range(n)])
        out, _ = _block(query, _repeat_kv(kv_all[0], rep), _repeat_kv(kv_all[1], rep), pq, pk,
                        scaling)
    else:
        outs, lses = [], []
        for step in range(n):
            if step:
                kv = _RingShift.apply(kv, group)
            pk = cp_positions(L, (r - step) % n, n, query.device)
            o, l = _block(query, _repeat_kv(kv[0], rep), _repeat_kv(kv[1], rep), pq, pk, scaling)
            outs.append(o)
            lses.append(l)
        out = _merge(outs, lses)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make "smshim_cp" a Hugging Face attention implementation (idempotent). Its name is not a
    mask implementation, so HF builds no mask for it: the causal mask comes from positions."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, cp_attention_forward)


class _SumScaledGrad(torch.autograd.Function):
    """All-reduce a sum over the CP group; the backward multiplies by the CP size, so that the
    data-parallel gradient average over CP ranks (they are inside the sharding group) yields the
    exact gradient of the summed loss."""

    @staticmethod
    def forward(ctx, t, group):  # noqa: D102
        ctx.n = dist.get_world_size(group)
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return grad * ctx.n, None


def cp_sum(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return _SumScaledGrad.apply(t, mesh.get_group())


def cp_shift_labels(labels: torch.Tensor, mesh: DeviceMesh, ignore_index: int = -100) -> torch.Tensor:
    """Next-token targets for this CP rank's tokens: the shift happens on the full sequence (a
    chunk's last token predicts the first token of the next chunk, held by another rank)."""
    n, r = mesh.size(), mesh.get_local_rank()
    parts = [torch.empty_like(labels) for _ in range(n)]
    dist.all_gather(parts, labels.contiguous(), group=mesh.get_group())
    full = merge_cp_parts(parts, dim=1)
    shifted = torch.nn.functional.pad(full, (0, 1), value=ignore_index)[..., 1:]
    return split_for_cp(shifted, r, n, dim=1)
