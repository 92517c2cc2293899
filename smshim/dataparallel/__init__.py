"""smdistributed.dataparallel on torch.distributed (`import smdistributed.dataparallel.torch...`)."""

__version__ = "1.8.0"
