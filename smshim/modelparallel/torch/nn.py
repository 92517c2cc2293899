"""`smp.nn`: SageMaker's tensor-parallel modules (Adv). smshim does not implement tensor
parallelism, so constructing any of them raises NotImplementedError naming the class. They are
real nn.Module subclasses so that `isinstance` checks and imports in user code keep working.
"""

from __future__ import annotations

from typing import Any

import torch

from smshim.modelparallel.torch.errors import SMPUnsupportedError

__all__ = [
    "DistributedModule", "DistributedLinear", "DistributedEmbedding", "DistributedTransformer",
    "DistributedTransformerLayer", "DistributedAttentionLayer", "DistributedTransformerOutputLayer",
    "DistributedTransformerLMHead",
]


class DistributedModule(torch.nn.Module):
    """Base of the tensor-parallel modules; constructing one raises SMPUnsupportedError."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise SMPUnsupportedError(
            f"smp.nn.{type(self).__name__} is not supported by smshim: tensor parallelism is not "
            "implemented. Use the equivalent torch.nn module (pipeline and data parallelism still "
            "apply to it)."
        )


class DistributedLinear(DistributedModule):
    pass


class DistributedEmbedding(DistributedModule):
    pass


class DistributedTransformer(DistributedModule):
    pass


class DistributedTransformerLayer(DistributedModule):
    pass


class DistributedAttentionLayer(DistributedModule):
    pass


class DistributedTransformerOutputLayer(DistributedModule):
    pass


class DistributedTransformerLMHead(DistributedModule):
    pass
