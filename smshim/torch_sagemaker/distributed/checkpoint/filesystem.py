"""DCP's file-system reader and writer, with SMP's hooks and attributes."""

from __future__ import annotations

import os
from typing import Callable, List, Optional, Sequence, Union

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

Hook = Callable[["DistributedFileSystemWriter"], None]


class DistributedFileSystemWriter(FileSystemWriter):
    """Writes one file per rank under `path`; `pre_write_hooks` run on every rank before the
    write, `post_write_hooks` on the coordinator once the metadata is written."""

    def __init__(self, path: Union[str, os.PathLike], pre_write_hooks: Optional[Sequence[Hook]] = None,
                 post_write_hooks: Optional[Sequence[Hook]] = None, **kwargs) -> None:
        super().__init__(path, **kwargs)
        self.pre_write_hooks: List[Hook] = list(pre_write_hooks or [])
        self.post_write_hooks: List[Hook] = list(post_write_hooks or [])
        self.is_coordinator = False

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        for hook in self.pre_write_hooks:
            hook(self)

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        for hook in self.post_write_hooks:
            hook(self)


class DistributedFileSystemReader(FileSystemReader):
    """DCP's reader; `path` is the checkpoint directory."""
