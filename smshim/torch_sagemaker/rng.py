"""A named RNG-state tracker (what `tsm.state.get_rng_state_tracker()` returns).

Tensor-parallel code draws dropout masks inside `tracker.fork()`, from a stream seeded with
random_seed + tp/ep rank, so ranks of one TP group draw different masks and the default stream
stays in step across ranks (TE's checkpoint saves and restores these states).
"""

from __future__ import annotations

import contextlib
from typing import Dict

import torch

DEFAULT_NAME = "model-parallel-rng"


class RngStateTracker:
    def __init__(self) -> None:
        self._states: Dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        self._states = {}

    def get_states(self) -> Dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self._states.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        self._states = {k: v.clone() for k, v in states.items()}

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists")
        gen = torch.Generator().manual_seed(seed)
        self._states[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = DEFAULT_NAME):
        """Draw from the named stream inside the block; the default stream is left as it was."""
        if name not in self._states:
            raise KeyError(f"RNG state {name!r} was never added (have {sorted(self._states)})")
        outer = torch.get_rng_state()
        torch.set_rng_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = torch.get_rng_state()
            torch.set_rng_state(outer)
