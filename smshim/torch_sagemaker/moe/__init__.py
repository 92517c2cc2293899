"""`torch.sagemaker.moe`: the public MoE names scripts import (re-exported from
smshim.torch_sagemaker.parallelize.moe, which implements them)."""
