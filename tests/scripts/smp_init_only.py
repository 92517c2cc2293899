"""smp.init() with no config of its own, as SageMaker scripts call it."""
import smdistributed.modelparallel.torch as smp

smp.init()
print(f"smp up: pp {smp.pp_size()} dp {smp.dp_size()}", flush=True)
