"""`torch.sagemaker.logger.get_logger()`: the library's logger."""

import logging


def get_logger() -> logging.Logger:
    return logging.getLogger("torch.sagemaker")
