"""An smp script with a one-key typo in its config (microbatchs), for the failure-output test."""
import smdistributed.modelparallel.torch as smp

smp.init({"pipeline_parallel_degree": 2, "microbatchs": 2, "ddp": True})
