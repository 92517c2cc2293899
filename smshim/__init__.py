"""smshim: a drop-in runtime for SageMaker's smdistributed libraries on plain torch.distributed.

Kept free of heavy imports: this module is imported at interpreter start-up by the
`smdistributed` alias (smshim/_alias.py).
"""

__version__ = "0.1.0"
