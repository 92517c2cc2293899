"""`torch.sagemaker.moe.moe_config.MoEConfig` (implemented in transform/moe/moe_config.py)."""

from smshim.torch_sagemaker.parallelize.moe.moe_config import LOAD_BALANCING, MoEConfig

__all__ = ["MoEConfig", "LOAD_BALANCING"]
