"""Used by the runtime tests: init the smddp API with no arguments and all_reduce once."""
import torch
import smdistributed.dataparallel.torch.distributed as dist
dist.init_process_group()
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {t.item()}", flush=True)
assert t.item() == dist.get_world_size() * (dist.get_world_size() + 1) / 2
