"""Run under `mpirun -n N` with an output directory: each rank writes its collective results there."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from tests.test_dp_api import _collectives  # noqa: E402

torch.set_num_threads(1)
result = _collectives()
import smdistributed.dataparallel.torch.distributed as dist  # noqa: E402

with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(result, f)
