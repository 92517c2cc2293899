"""`torch.sagemaker.utils`: small helpers AWS's v2 scripts import (module_utils, utils,
process_group_utils). May import torch and smshim.torch_sagemaker's state only."""
