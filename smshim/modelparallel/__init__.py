"""smdistributed.modelparallel (v1 API) on torch.distributed (`import smdistributed.modelparallel.torch as smp`)."""

# Hugging Face compares this with "1.10" to pick the post-1.10 code paths, which we implement.
__version__ = "1.15.0"
