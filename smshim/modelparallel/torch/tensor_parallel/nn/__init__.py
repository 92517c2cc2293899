"""The distributed modules behind `smp.nn` (re-exported there): layers, the transformer family,
and the tensor-parallel forms of Hugging Face blocks (`hf_*.py`)."""


from smshim.modelparallel.torch.tensor_parallel.nn.base import DistributedModule
from smshim.modelparallel.torch.tensor_parallel.nn.layers import DistributedEmbedding, DistributedLinear, FusedLayerNorm
from smshim.modelparallel.torch.tensor_parallel.nn.transformer import (
    DistributedAttentionLayer,
    DistributedTransformer,
    DistributedTransformerLayer,
    DistributedTransformerLMHead,
    DistributedTransformerOutputLayer,
)

__all__ = [
    "DistributedModule", "DistributedLinear", "DistributedEmbedding", "DistributedTransformer",
    "DistributedTransformerLayer", "DistributedAttentionLayer", "DistributedTransformerOutputLayer",
    "DistributedTransformerLMHead", "FusedLayerNorm",
]
