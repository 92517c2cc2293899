"""`smp.nn.DistributedLinear`, `DistributedEmbedding` and `FusedLayerNorm`.

DistributedLinear is column-parallel: rank r holds rows r of the weight (output features) and of
the bias, computes its slice of the output, and the slices are gathered. DistributedEmbedding is
split over embedding_dim (SPEC §7): rank r looks up its columns of every row, then gathers. Sizes
given to the constructors are global.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from smshim.modelparallel.torch.tensor_parallel import collectives as tp_comm
from smshim.modelparallel.torch.errors import SMPUnsupportedError
from smshim.modelparallel.torch.tensor_parallel.nn.base import DistributedModule, linear_init, tp_rank_size

__all__ = ["DistributedLinear", "DistributedEmbedding", "FusedLayerNorm"]


def _divisible(cls: str, what: str, n: int) -> None:
    _, size = tp_rank_size()
    if n % size:
        raise ValueError(
            f"smp.nn.{cls}: {what}={n} is not divisible by tensor_parallel_degree {size}; "
            f"choose a {what} that is a multiple of {size} or use the unsplit torch.nn module")


class DistributedLinear(DistributedModule):
    """nn.Linear(in_features, out_features, bias) with the output features split over the TP
    ranks. Initialised exactly as nn.Linear (same RNG draws)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        _divisible("DistributedLinear", "out_features", out_features)
        self.in_features, self.out_features = in_features, out_features
        w, b = linear_init(out_features, in_features, bias)
        self.weight = self._sharded(w, 0)
        self.bias = self._sharded(b, 0) if b is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_region(self._local, x)

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(tp_comm.copy_to_tp(x), self.weight, self.bias)
        return tp_comm.gather_from_tp(y, -1)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, tp_split=out_features")


class DistributedEmbedding(DistributedModule):
    """nn.Embedding with embedding_dim split over the TP ranks. Initialised as nn.Embedding
    (N(0, 1), padding row zero), or from `_weight` (the full table)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 max_norm: Optional[float] = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False, sparse: bool = False,
                 _weight: Optional[torch.Tensor] = None, initializer_range: float = 0.02,
                 _skip_allgather: bool = False, _skip_scatter_and_merge: bool = False) -> None:
        super().__init__()
        if max_norm is not None:
            # Renormalising a row needs the norm of the whole row, which no rank holds.
            raise SMPUnsupportedError(
                "smp.nn.DistributedEmbedding(max_norm=...) is not supported by smshim: rows are "
                "split over the TP ranks; use max_norm=None or an unsplit nn.Embedding")
        if sparse:
            raise SMPUnsupportedError(
                "smp.nn.DistributedEmbedding(sparse=True) is not supported by smshim (gloo "
                "reduces dense gradients); use sparse=False")
        _divisible("DistributedEmbedding", "embedding_dim", embedding_dim)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.padding_idx, self.scale_grad_by_freq = padding_idx, scale_grad_by_freq
        self.initializer_range = initializer_range
        # _skip_allgather: the output stays split over embedding_dim (the caller consumes this
        # rank's columns); _skip_scatter_and_merge: the batch is not gathered (callers whose TP
        # ranks already hold the same ids).
        self._skip_allgather, self._skip_scatter = _skip_allgather, _skip_scatter_and_merge
        if _weight is None:
            full = torch.empty(num_embeddings, embedding_dim)
            nn.init.normal_(full)
            if padding_idx is not None:
                full[padding_idx].zero_()
        else:
            if list(_weight.shape) != [num_embeddings, embedding_dim]:
                raise ValueError(
                    f"smp.nn.DistributedEmbedding: _weight has shape {list(_weight.shape)}, "
                    f"expected the full table [{num_embeddings}, {embedding_dim}]")
            full = _weight
        self.weight = self._sharded(full, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self._skip_scatter:
            return self._local(ids)
        return self._forward_region(self._local, ids)

    def _local(self, ids: torch.Tensor) -> torch.Tensor:
        y = F.embedding(ids, self.weight, self.padding_idx, None, 2.0, self.scale_grad_by_freq)
        return y if self._skip_allgather else tp_comm.gather_from_tp(y, -1)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, "
                "tp_split=embedding_dim")


class FusedLayerNorm(nn.LayerNorm):
    """apex's FusedLayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True): a LayerNorm."""

    def __init__(self, normalized_shape: Any, eps: float = 1e-5, elementwise_affine: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine,
                         **kwargs)
