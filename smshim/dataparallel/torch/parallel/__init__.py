"""`smdistributed.dataparallel.torch.parallel`: DistributedDataParallel."""

from smshim.dataparallel.torch.parallel.distributed import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
