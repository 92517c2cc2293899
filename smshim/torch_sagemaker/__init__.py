"""SMP v2, `import torch.sagemaker as tsm`, on torch's own FSDP, DeviceMesh and DCP.

`torch.sagemaker[.x]` resolves to this package through the import alias in smshim/_alias.py.
Public face: `init`, `is_initialized`, `state`, `transform`; submodules `delayed_param`,
`grad_norm`, `utils`, `logger`, `checkpoint`, `distributed.checkpoint`, mirroring SageMaker's
module paths. Folder layout: config/topology/state_handler/rng (who is where), fsdp_patch (what
init() changes in FSDP), the API modules; `parallelize/` (TP/CP/EP, behind `transform`) is a separate engine folder.
Modules here may import smshim.runtime.launch and torch, nothing from smshim.modelparallel.
"""

from smshim.torch_sagemaker.api import init, is_initialized, transform
from smshim.torch_sagemaker.state_handler import state

__version__ = "2.8.0"

__all__ = ["init", "is_initialized", "state", "transform", "__version__"]
