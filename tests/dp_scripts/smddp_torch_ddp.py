"""Run under `mpirun -n N`: torch DDP on the smddp backend equals single-process training."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from smshim.runtime.launch import detect_launch  # noqa: E402

launcher = detect_launch().launcher  # before the import below exports torchrun-style variables
assert "RANK" not in os.environ and "MASTER_PORT" not in os.environ, "torch env already set"

from tests.test_smddp_backend import _torch_ddp_on_smddp  # noqa: E402

torch.set_num_threads(1)
result = _torch_ddp_on_smddp()
diff, local = result[0], result[-1]
assert local == int(os.environ["RANK"]), (local, os.environ["RANK"])
print(f"RESULT {os.environ['RANK']} {diff:.3e} {launcher}", flush=True)
