"""Dropout inside split modules draws from a TP-local random stream seeded with
random_seed + tp_rank (each rank's heads get their own masks), while dropout on replicated
activations keeps the default stream, which must stay equal on every TP rank.

A forward pre-hook swaps the local stream in, a forward hook swaps it back out. (A module
re-run by reentrant activation checkpointing draws from the local stream's current state, not
its state at the first run: use dropout 0 with checkpointing, as the tests and AWS examples do.)
"""

from __future__ import annotations

import torch


class LocalStream:
    """One module family's private generator state (CPU and, if present, the current CUDA device)."""

    def __init__(self, seed: int):
        self.cpu = torch.Generator().manual_seed(seed).get_state()
        self.cuda = None
        if torch.cuda.is_available():
            g = torch.Generator(device="cuda").manual_seed(seed)
            self.cuda = g.get_state()
        self._saved = None

    def enter(self, *_):
        self._saved = (torch.get_rng_state(),
                       torch.cuda.get_rng_state() if self.cuda is not None else None)
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)

    def leave(self, *_):
        self.cpu = torch.get_rng_state()
        torch.set_rng_state(self._saved[0])
        if self.cuda is not None:
            self.cuda = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(self._saved[1])
        self._saved = None


def seed_split_modules(modules, seed: int) -> LocalStream:
    stream = LocalStream(seed)
    for m in modules:
        m.register_forward_pre_hook(stream.enter)
        m.register_forward_hook(stream.leave)
    return stream
