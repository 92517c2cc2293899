"""The exception classes of `smdistributed.modelparallel.torch`, shared by the whole package.

Every class derives from `SMPError` and from the builtin a caller would naturally catch
(ValueError for bad input, RuntimeError for misuse at run time, NotImplementedError for the
Adv features smshim rejects), so both `except smp.SMPError` and `except ValueError` work.
"""

from __future__ import annotations

import pickle

__all__ = [
    "SMPError", "SMPValidationError", "SMPConfigError", "SMPUnsupportedError", "SMPRuntimeError",
    "SMPNotInitializedError", "FwdExecutionNotInStepFnError", "BwdExecutionNotInStepFnError",
    "MultipleDistributedModelError", "InvalidPartitionIDError", "TensorSplitError",
    "UnsafeCheckpointError",
]


class SMPError(Exception):
    """Base class of every smp error."""


class SMPValidationError(SMPError, ValueError):
    """An argument or input has a value smp cannot accept."""


class SMPConfigError(SMPValidationError):
    """The smp configuration (init() dict merged with SM_HP_MP_PARAMETERS) is invalid.

    The message names the key, the value given and what is allowed.
    """


class SMPUnsupportedError(SMPError, NotImplementedError):
    """An Adv feature (e.g. tensor parallelism, activation offloading) that smshim does not implement."""


class SMPRuntimeError(SMPError, RuntimeError):
    """smp was used in a way or a state that cannot work."""


class SMPNotInitializedError(SMPRuntimeError):
    """An smp function that needs `smp.init()` was called before it."""


class FwdExecutionNotInStepFnError(SMPRuntimeError):
    """A DistributedModel forward with pp > 1 outside an @smp.step function."""


class BwdExecutionNotInStepFnError(SMPRuntimeError):
    """DistributedModel.backward() outside an @smp.step function."""


class MultipleDistributedModelError(SMPRuntimeError):
    """A second DistributedModel in one process (smp supports one; call smp.reset() first)."""


class InvalidPartitionIDError(SMPValidationError):
    """A partition index outside [0, pipeline_parallel_degree)."""


class TensorSplitError(SMPError, ValueError):
    """A step input cannot be split evenly into microbatches."""


class UnsafeCheckpointError(SMPRuntimeError, pickle.UnpicklingError):
    """A checkpoint file holds objects that only full unpickling (which can run code) would
    load, and the caller did not opt in to it."""
