"""`smp.nn` (also `smdistributed.modelparallel.torch.nn`): SageMaker's tensor-parallel modules.

Each module's parameters are split over the ranks of its tensor-parallel group
(`tensor_parallel_degree`), and it computes exactly what the unsplit module computes. Before
`smp.init()`, or with tensor_parallel_degree 1, they hold the whole tensors and act as plain
modules. How the collectives stay safe under the pipeline's concurrent microbatches:
tensor_parallel/collectives.py. How parameters are split and gathered:
tensor_parallel/shard.py. The modules themselves live in tensor_parallel/nn/.
"""

from smshim.modelparallel.torch.nn import huggingface  # smp.nn.huggingface.<family>: the state-dict translators (SPEC §7.6)
from smshim.modelparallel.torch.tensor_parallel.nn import (
    DistributedAttentionLayer,
    DistributedEmbedding,
    DistributedLinear,
    DistributedModule,
    DistributedTransformer,
    DistributedTransformerLayer,
    DistributedTransformerLMHead,
    DistributedTransformerOutputLayer,
    FusedLayerNorm,
)

__all__ = [
    "DistributedModule", "DistributedLinear", "DistributedEmbedding", "DistributedTransformer",
    "DistributedTransformerLayer", "DistributedAttentionLayer", "DistributedTransformerOutputLayer",
    "DistributedTransformerLMHead", "FusedLayerNorm", "huggingface",
]
