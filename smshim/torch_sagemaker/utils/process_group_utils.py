"""Process-group questions scripts ask (e.g. the checkpoint coordinator: min of the group)."""

from __future__ import annotations

from typing import List, Optional

import torch.distributed as dist


def get_global_ranks(process_group: Optional[dist.ProcessGroup] = None) -> List[int]:
    """The global ranks of `process_group` (default: the world), ascending."""
    return sorted(dist.get_process_group_ranks(process_group or dist.group.WORLD))
