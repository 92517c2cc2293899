"""What pipeline ranks say to each other: the message kinds, a `Message` (a header and its
tensors), and the error every waiter raises when a peer fails (transport.py carries them)."""

from __future__ import annotations

import dataclasses
from typing import Any, List

import torch

# Message kinds. Requests (server.py): run a module's forward / backward; a forward's output
# metadata or values when the caller waits for them; a value (activation or gradient) travelling
# from the rank that holds it to the rank that needs it; asking a rank to send a value it holds to
# another rank or to the asker (PREFETCH: with its next frame going there anyway); pp_rank 0
# saying a microbatch's forward / whole step is done; a rank saying it will send no more requests
# for the step's nested calls (server.finish_nested).
FWD_REQ, FWD_REPLY, BWD_REQ = "fwd_req", "fwd_reply", "bwd_req"
VALUE, SEND_TO, FETCH, PREFETCH = "value", "send_to", "fetch", "prefetch"
FWD_DONE, MB_DONE, NESTED_DONE = "fwd_done", "mb_done", "nested_done"
STEP_END, CLOSE, ERROR = "step_end", "close", "error"


class PipelineError(RuntimeError):
    """A pipeline peer failed, stopped taking part, or a wait timed out."""


@dataclasses.dataclass
class Message:
    kind: str
    step: int = 0
    microbatch: int = -1
    call_id: int = -1
    module: str = ""
    meta: Any = None  # pickled with the header: structure specs, non-tensor leaves, flags
    tensors: List[torch.Tensor] = dataclasses.field(default_factory=list)
    src: int = -1  # filled in on receipt (pp rank of the sender)

    def describe(self) -> str:
        what = {FWD_REQ: "forward", FWD_REPLY: "forward", BWD_REQ: "backward",
                VALUE: "value", SEND_TO: "send request", FETCH: "fetch",
                PREFETCH: "prefetch"}.get(self.kind, self.kind)
        mod = f" of module '{self.module}'" if self.module else ""
        mb = f", microbatch {self.microbatch}" if self.microbatch >= 0 else ""
        return f"{what}{mod}{mb} (step {self.step})"


def _nbytes(msg: Message) -> int:
    """The bytes of `msg`'s tensors."""
    return sum(t.numel() * t.element_size() for t in msg.tensors)
