"""`limit_num_subdirs`: keep only the newest checkpoint sub-directories."""

from __future__ import annotations

import logging
import os
import re
import shutil
from typing import Callable, List

logger = logging.getLogger("torch.sagemaker")


def SORT_BY_LAST_INT(name: str) -> int:  # noqa: N802  (SMP's public name)
    """Order names by their last integer ("..._120steps" -> 120); names without one come first."""
    numbers = re.findall(r"\d+", name)
    return int(numbers[-1]) if numbers else -1


def limit_num_subdirs(abs_path: str, num_kept: int, sort_fn: Callable[[str], int] = SORT_BY_LAST_INT,
                      regex: str = r"^.*\d+steps$", log: bool = True) -> List[str]:
    """Delete all but the `num_kept` last (by `sort_fn`) sub-directories matching `regex`; return
    the deleted paths. Call it on one rank."""
    if num_kept < 0:
        raise ValueError(f"limit_num_subdirs: num_kept={num_kept} must be >= 0")
    if not os.path.isdir(abs_path):
        return []
    pattern = re.compile(regex)
    subdirs = sorted((d for d in os.listdir(abs_path)
                      if pattern.match(d) and os.path.isdir(os.path.join(abs_path, d))), key=sort_fn)
    doomed = subdirs[:max(0, len(subdirs) - num_kept)]
    for d in doomed:
        shutil.rmtree(os.path.join(abs_path, d))
        if log:
            logger.info("removed old checkpoint %s", os.path.join(abs_path, d))
    return [os.path.join(abs_path, d) for d in doomed]
