"""A plain torch.distributed script that never calls destroy_process_group (most don't). It
replaces dist.destroy_process_group with a spy, so the launcher tests can see smshim's exit-time
teardown destroy the groups (left to finalization, gloo's threads can abort the process)."""
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
_destroy = dist.destroy_process_group


def _spy(*args, **kwargs):
    print(f"rank {dist.get_rank()}: destroy_process_group at exit", flush=True)
    return _destroy(*args, **kwargs)


dist.destroy_process_group = _spy
print(f"rank {dist.get_rank()} sum {t.item():.0f}", flush=True)
