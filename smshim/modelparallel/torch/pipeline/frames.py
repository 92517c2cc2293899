"""The bytes of a frame: a prefix of two int64 lengths, the pickled message headers, then the
tensors' bytes (transport.py assembles them in a bytearray, posts and receives them)."""

from __future__ import annotations

import struct
from typing import Dict

import numpy as np
import torch

FRAME_BYTES = 1 << 18  # a message up to 256 KiB travels in one send


_PREFIX = 16  # two int64 lengths

# A frame's first bytes: its headers' and body's lengths (native int64s), written by `_prefix`
# (header_len, body_len) -> bytes and read by `_read_prefix(buffer)` -> (header_len, body_len).
# (Bound methods of one Struct: no Python call per frame.)
_PREFIX_STRUCT = struct.Struct("=qq")
_prefix = _PREFIX_STRUCT.pack
_read_prefix = _PREFIX_STRUCT.unpack_from


def _frame_buffer(buffers: Dict[int, tuple], peer: int) -> tuple:
    """The frame-sized buffer kept for `peer` in `buffers` (made on first use), as a tensor for
    gloo and the numpy array over the same memory."""
    buf = buffers.get(peer)
    if buf is None:
        t = torch.empty(FRAME_BYTES, dtype=torch.uint8)
        buf = buffers[peer] = (t, t.numpy())
    return buf


# A tensor's dtype travels in its frame's header as a small int (`_DTYPE_CODE`; any other dtype as
# itself): pickling a torch.dtype looks its module up by name, 0.9 of a one-tensor header's 1.4 us
# hot (and 0.6 of its 1.1 us to unpickle), many times that in a hop's cold caches.
_DTYPE_LIST = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
               torch.complex128)
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPE_LIST)}
_DTYPE_OF = dict(enumerate(_DTYPE_LIST))  # `_DTYPE_OF.get(code, code)`: the dtype

# dtypes numpy holds natively: their bytes become a tensor without torch's reinterpreting views.
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
                 torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16,
                 torch.int8: np.int8, torch.uint8: np.uint8, torch.bool: np.bool_,
                 torch.complex64: np.complex64, torch.complex128: np.complex128}


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """`t`'s data as a flat uint8 array (on the CPU, contiguous; a view when it already is)."""
    if t.dtype in _NUMPY_DTYPES:
        return np.ascontiguousarray(t.numpy(force=True)).reshape(-1).view(np.uint8)
    t = t.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def _from_bytes(data: np.ndarray, dtype: torch.dtype, shape) -> torch.Tensor:
    """A tensor of `dtype` and `shape` holding a copy of `data` (fresh, aligned storage)."""
    own = data.copy()
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is not None:
        return torch.from_numpy(own.view(np_dtype).reshape(shape))
    return torch.from_numpy(own).view(dtype).reshape(shape)
