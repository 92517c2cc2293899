"""Used by the MPI tests: an unmodified-style smp training script run under mpirun.

smp is initialised on import from SM_HP_MP_PARAMETERS (as under SageMaker); the script trains the
test Net for 3 steps and writes each rank's local parameters to $RESULT_DIR/rank<r>.pt.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import smdistributed.modelparallel.torch as smp  # noqa: E402  (auto-init under MPI)
from tests.pipeline_models import batches, make_model, make_train_step  # noqa: E402

assert smp.is_initialized(), "smp should initialise on import under mpirun"
model = smp.DistributedModel(make_model("net"))
opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
train_step = make_train_step("net")


for x, y in batches("net", 3, 8):
    opt.zero_grad()
    train_step(model, x, y)
    opt.step()
torch.save({n: p.detach() for n, p in model.local_named_parameters()},
           os.path.join(os.environ["RESULT_DIR"], f"rank{smp.rank()}.pt"))
