"""SMP v2, `import torch.sagemaker as tsm`, on torch's own FSDP, DeviceMesh and DCP.

`torch.sagemaker[.x]` resolves to this package through the import alias in smshim/_alias.py.
Public face: `init`, `is_initialized`, `state`, `transform`; submodules `delayed_param`,
`grad_norm`, `utils`, `logger`, `checkpoint`, `distributed.checkpoint`, mirroring SageMaker's
module paths. Folder layout: config/topology/state_handler/rng (who is where), fsdp_patch (what
init() changes in FSDP), the API modules; `transform/` (TP/CP/EP) is a separate engine folder.
Modules here may import smshim.runtime.launch and torch, nothing from smshim.modelparallel.
"""

from smshim.torch_sagemaker.api import init, is_initialized, transform
from smshim.torch_sagemaker.state_handler import state

__version__ = "2.8.0"

__all__ = ["init", "is_initialized", "state", "transform", "__version__"]

# The TP/CP/EP engine folder is also named `transform`: once imported (by anyone), Python binds the
# package attribute `transform` to that subpackage. Import it here, if this installation has it,
# and bind the public function last, so `tsm.transform` is always the function.
import importlib.util as _util  # noqa: E402

if _util.find_spec(__name__ + ".transform") is not None:
    import importlib as _importlib

    _importlib.import_module(__name__ + ".transform")
from smshim.torch_sagemaker.api import transform  # noqa: E402,F811
