"""`tsm.transform`'s engine: tensor, context and expert parallelism for Hugging Face causal LMs on
DTensor and torch.distributed.tensor.parallel. Takes its DeviceMeshes as arguments (never reads
tsm.state); imports torch and transformers only.

Public: `apply` (the transform), `clip_grad_norm_` (exact norm over TP and FSDP shards),
`full_hf_state_dict` (HF-layout full state dict of a transformed model), `split_for_cp` (the
load-balanced context-parallel slice of a batch), `moe.moe_config.MoEConfig`.
"""

from smshim.torch_sagemaker.parallelize.api import SUPPORTED, UnsupportedModelError, apply
from smshim.torch_sagemaker.parallelize.context_parallel import split_for_cp
from smshim.torch_sagemaker.parallelize.grad_norm import clip_grad_norm_
from smshim.torch_sagemaker.parallelize.hf_state_dict import full_hf_state_dict

__all__ = ["apply", "clip_grad_norm_", "full_hf_state_dict", "split_for_cp", "SUPPORTED",
           "UnsupportedModelError"]
