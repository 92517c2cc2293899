"""Where a frame's tensors travel (transport.py): the host channel or the device channel.

The host channel is the frame itself: a tensor's bytes are copied into the gloo frame after the
headers (frames.py). It is the only path on the CPU, and the path of a CUDA tensor when its
ranks share a GPU or the job runs on gloo; its cost is today's, untouched.

The device channel sends the CUDA tensors of a frame apart from it, never through host memory:
on process groups of their own (NCCL), one per ordered pair of pp ranks, posted right after
their frame on the gloo group and in header order. Frames to a peer are posted one at a time and
a peer's frames are received one at a time (transport.py), so the receiver, which reads a frame's
headers first (they name each tensor's shape and dtype and mark it `APART`), posts the matching
receives in the same order as the sends. One group per ordered pair keeps each NCCL communicator
one-way with a single sender and a single receiver thread, so no two pairs' transfers can wait
on each other, whatever torch does with the communicators of a group.

The choice is made per tensor by its device (`takes`); a transport without a device channel
(every CPU job: `channel_backend` gives None) makes no check at all.

SMSHIM_DEVICE_CHANNEL: unset or "auto" = NCCL when the job computes on GPUs of their own
(`smshim.runtime.devices`); "host" = never (everything through the frames); "gloo-test" = FOR
TESTS ONLY, on CPU: the device channel's groups are gloo and it takes every tensor, so the
device path's ordering runs (and is checked against single-process training) without a GPU.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = ["ENV", "APART", "channel_backend", "create_pair_groups", "takes_device_path",
           "DeviceChannel"]

ENV = "SMSHIM_DEVICE_CHANNEL"
# A tensor's byte count in its frame's header when its bytes travel on the device channel.
APART = -1


def channel_backend(device_backend: Optional[str], env: Mapping[str, str]) -> Optional[str]:
    """The backend of the device channel's groups, or None for no device channel.
    `device_backend`: `smshim.runtime.devices.device_backend()` ("nccl" or None)."""
    value = env.get(ENV, "") or "auto"
    if value == "auto":
        return device_backend
    if value == "host":
        return None
    if value == "gloo-test":
        return "gloo"
    raise ValueError(f"{ENV}={value!r}: use 'auto' (the default), 'host' or, in tests on CPU "
                     "only, 'gloo-test'")


def takes_device_path(t: Any, everything: bool) -> bool:
    """Whether tensor `t` travels on the device channel: a CUDA tensor does, a CPU one only
    under the test stand-in (`everything`); an empty one never (nothing to send)."""
    return (everything or t.is_cuda) and t.numel() > 0


def create_pair_groups(ranks: Sequence[int], my_rank: int, backend: str,
                       timeout: datetime.timedelta) -> Dict[Tuple[int, int], Any]:
    """One two-rank group per ordered pair (src, dst) of pp ranks of the pipeline `ranks`
    (global ranks in pp-rank order). A collective over the whole job: every rank calls it for
    every pipeline, in the same order. Returns this rank's groups, by (src, dst) pp ranks."""
    mine: Dict[Tuple[int, int], Any] = {}
    for src in range(len(ranks)):
        for dst in range(len(ranks)):
            if src == dst:
                continue
            group = dist.new_group([ranks[src], ranks[dst]], backend=backend, timeout=timeout)
            if my_rank in (ranks[src], ranks[dst]):
                mine[(src, dst)] = group
    return mine


class DeviceChannel:
    """A frame's device tensors, sent and received apart from it (see the module docstring)."""

    def __init__(self, me: int, ranks: Sequence[int], groups: Dict[Tuple[int, int], Any],
                 device: torch.device, everything: bool = False) -> None:
        self.me = me
        self.ranks = list(ranks)
        self.groups = groups
        self.device = device
        self.everything = everything  # the gloo-test stand-in takes CPU tensors too
        # A NCCL work's wait() only makes the calling thread's stream wait. The transport's
        # sender thread waits for sent frames to know their buffers are free: it waits on a
        # stream of its own, then for that stream (the compute stream never waits on a send).
        # One stream per peer: one peer's sender thread never waits for another peer's sends.
        self._side = ({peer: torch.cuda.Stream(device) for peer in range(len(self.ranks))
                       if peer != me} if device.type == "cuda" else None)

    def takes(self, t: torch.Tensor) -> bool:
        return takes_device_path(t, self.everything)

    def send(self, peer: int, tensors: List[torch.Tensor]) -> Tuple[list, list]:
        """Post `tensors` to pp rank `peer`, in order. Returns the works and the tensors they
        read (to keep until the works complete)."""
        group = self.groups[(self.me, peer)]
        keep = [t.detach().contiguous() for t in tensors]
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, t, self.ranks[peer], group) for t in keep])
        if self._side is not None:
            works = [_HostWait(w, self._side[peer]) for w in works]
        return works, keep

    def recv(self, peer: int, specs: List[Tuple[tuple, torch.dtype]]) -> List[torch.Tensor]:
        """Receive the tensors `specs` (shape, dtype) names from pp rank `peer`, in order.
        On CUDA, the values are ready for work queued after this on the calling thread's
        stream (the host does not wait for them)."""
        group = self.groups[(peer, self.me)]
        out = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in specs]
        for work in dist.batch_isend_irecv(
                [dist.P2POp(dist.irecv, t, self.ranks[peer], group) for t in out]):
            work.wait()
        return out


class _HostWait:
    """A device work whose `wait` returns once the transfer is done (see DeviceChannel)."""

    def __init__(self, work: Any, stream: "torch.cuda.Stream") -> None:
        self.work, self.stream = work, stream

    def wait(self) -> None:
        with torch.cuda.stream(self.stream):
            self.work.wait()
        self.stream.synchronize()
