"""Used by the Hugging Face tests: what transformers detects under `smshim run --distribution`."""
import json
import os

from transformers import modeling_utils
from transformers.utils import is_sagemaker_dp_enabled, is_sagemaker_mp_enabled

info = {"mp": is_sagemaker_mp_enabled(), "dp": is_sagemaker_dp_enabled(),
        "smp_post_1_10": getattr(modeling_utils, "IS_SAGEMAKER_MP_POST_1_10", None)}
if info["mp"]:
    import transformers.training_args  # noqa: F401  (calls smp.init() at import, as on SageMaker)
    import smdistributed.modelparallel.torch as smp

    info.update(initialized=smp.is_initialized(), pp_size=smp.pp_size(), rank=smp.rank())
with open(os.path.join(os.environ["DUMP_DIR"], f"hf{os.environ['RANK']}.json"), "w") as f:
    json.dump(info, f)
