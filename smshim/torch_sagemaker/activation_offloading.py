"""`sm_activation_offloading`: torch's `offload_wrapper` with prefetching, installed by tsm.init.

What is patched, and why: `OffloadWrapper.forward` (torch.distributed.algorithms._checkpoint.
checkpoint_wrapper), the wrapper AWS's scripts put on the root module after activation
checkpointing. Stock, it saves every activation autograd keeps to pinned CPU memory and copies it
back only when backward needs it, so each layer's backward waits for its own copy. With
`sm_activation_offloading` on, the copies back run ahead on a side stream: when backward unpacks
saved tensor k it starts fetching the `activation_loading_horizon` tensors saved before it (with
activation checkpointing these are the earlier layers' inputs), so at most that many offloaded
inputs are back on the device at a time. Tensors already on the CPU (a CPU-only job) are kept as
they are: there is nothing to offload. With the option off, or before tsm.init, the wrapper is
torch's own.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as _cw

from smshim.torch_sagemaker.state_handler import state

_originals: Dict[str, Any] = {}


class _Offloaded:
    """One saved tensor: its CPU copy, and (once fetched) its copy back on the device."""

    def __init__(self, index: int, tensor: torch.Tensor, stream) -> None:
        self.index = index
        self.device = tensor.device
        self.cpu = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
        self.cpu.copy_(tensor, non_blocking=True)
        self._stream = stream
        self._fetched: Optional[torch.Tensor] = None
        self._event = None

    def prefetch(self) -> None:
        if self._fetched is not None:
            return
        with torch.cuda.stream(self._stream):
            self._fetched = self.cpu.to(self.device, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(self._stream)

    def get(self) -> torch.Tensor:
        self.prefetch()
        torch.cuda.current_stream(self.device).wait_event(self._event)
        out, self._fetched, self.cpu = self._fetched, None, None
        return out


class PrefetchingOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that offload device tensors and prefetch `horizon` ahead in backward."""

    def __init__(self, horizon: int) -> None:
        self.horizon = max(1, int(horizon))
        self.records: List[_Offloaded] = []
        self._stream = None
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        if tensor.device.type == "cpu":
            return tensor
        if self._stream is None:
            self._stream = torch.cuda.Stream(tensor.device)
        record = _Offloaded(len(self.records), tensor, self._stream)
        self.records.append(record)
        return record

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        for j in range(packed.index - 1, max(-1, packed.index - 1 - self.horizon), -1):
            self.records[j].prefetch()
        return packed.get()


def _forward(self, *args, **kwargs):
    if not (state.initialized and state.sm_activation_offloading):
        return _originals["OffloadWrapper.forward"](self, *args, **kwargs)
    with PrefetchingOffload(state.activation_loading_horizon):
        return self._checkpoint_wrapped_module(*args, **kwargs)


def install() -> None:
    if not _originals:
        _originals["OffloadWrapper.forward"] = _cw.OffloadWrapper.forward
        _cw.OffloadWrapper.forward = _forward


def uninstall() -> None:
    if _originals:
        _cw.OffloadWrapper.forward = _originals.pop("OffloadWrapper.forward")
