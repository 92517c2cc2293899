"""Checkpoint files of `smp` (engine folder): writing, reading and trusting them.

Holds signing.py (the signatures on the files smshim writes). It may import the standard library,
torch and `smshim.modelparallel.torch.errors`; never the API face (`smp.*` modules) above it.
"""
