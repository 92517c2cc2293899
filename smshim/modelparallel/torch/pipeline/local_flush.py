"""pp_rank 0's own modules that sit beside modules of other ranks send what the step body holds
before they compute.

pp_rank 0's step body holds its calls to other ranks back so that a stage's calls leave as one
frame (`Transport.send`'s `hold`), and posts them before it waits for anything or calls another
rank. A module of its own that does not read those calls' results (a branch of the model
computed beside another rank's, say) is neither: what the body held would wait for it, up to
the hold's deadline. These forward pre-hooks post it first. A module that runs before any call
of its microbatch to another rank (a first stage's blocks, in a loop with the later stages')
never finds anything held: its hook removes itself after a few steps, so that it does not cost a
Python call every time the module runs."""

from __future__ import annotations

from typing import Callable, Dict, List

import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from smshim.modelparallel.torch.pipeline.context import ctx
from smshim.modelparallel.torch.pipeline.partitioner import ancestors

# Steps a hook watches (pp_rank 0's step bodies calling its module, holding nothing) before it
# removes itself. (The first step holds nothing anywhere: it waits for its calls' output shapes.)
_PROBE_STEPS = 3


class _FlushFirst:
    """A forward pre-hook: `flush()` (True if it sent anything) before the module computes."""

    __slots__ = ("flush", "handle", "found", "steps", "last_step")

    def __init__(self, flush: Callable[[], bool]) -> None:
        self.flush = flush
        self.handle: RemovableHandle = None  # type: ignore[assignment]  (set once registered)
        self.found = False
        self.steps = 0
        self.last_step = None

    def __reduce__(self):
        # A copy of the module (`copy.deepcopy`, `torch.save` of the whole model) is not in
        # the pipeline: its hook does nothing, and does not drag the transport along.
        return _inert, ()

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if self.flush():
            self.found = True
        elif not self.found and ctx.driver and ctx.step != self.last_step:
            self.last_step = ctx.step
            self.steps += 1
            if self.steps > _PROBE_STEPS:
                self.handle.remove()


def _inert() -> Callable[[nn.Module, tuple], None]:
    return _do_nothing


def _do_nothing(module: nn.Module, args: tuple) -> None:
    return None


def install(modules: Dict[str, nn.Module], owner: Callable[[str], int], me: int,
            flush: Callable[[], bool]) -> List[RemovableHandle]:
    """Hook each module of `modules` (named as by `named_modules`) that lives on `me`, has no
    descendant elsewhere, and whose parent has one: pp_rank 0's modules beside another rank's.
    `flush()` sends what the calling thread holds, and says whether there was anything."""
    # The modules that live elsewhere or have a descendant that does, the root among them.
    below = set()
    for name in modules:
        if owner(name) != me:
            below.update((name, "", *ancestors(name)))
    handles, seen = [], set()
    for name, module in modules.items():
        if not name or name in below or id(module) in seen:
            continue
        parent = name.rpartition(".")[0]
        if parent in below:
            seen.add(id(module))
            hook = _FlushFirst(flush)
            hook.handle = module.register_forward_pre_hook(hook)
            handles.append(hook.handle)
    return handles
