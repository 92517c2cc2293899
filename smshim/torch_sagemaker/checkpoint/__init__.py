"""`torch.sagemaker.checkpoint`: checkpoint-directory housekeeping scripts import (utils,
constants). The save/load API itself is `torch.sagemaker.distributed.checkpoint`."""
