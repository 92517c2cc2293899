"""Run under `mpirun -n N`: DDP training must equal single-process training (prints RESULT lines)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from tests.test_dp_ddp import _train_ddp  # noqa: E402

torch.set_num_threads(1)
diff = _train_ddp(None)[0]
import smdistributed.dataparallel.torch.distributed as dist  # noqa: E402

print(f"RESULT {dist.get_rank()} {diff:.3e}", flush=True)
