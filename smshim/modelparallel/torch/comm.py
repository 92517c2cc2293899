"""smp object communication: pickled Python objects (tensors included) between ranks.

`broadcast(obj, group)` (sender) and `send(obj, dest, rank_type)` pair with `recv_from(src,
rank_type)`; `allgather(obj, group)` and the barriers are collectives over one group kind.

Transport.
  * send/broadcast -> recv_from: buffered, through the job's c10d store (keys
    `"{src}>{dst}/{seq}"` under a prefix of its own, payloads in chunks of 4 MB). `send` returns at once, as an eager MPI send
    does, so patterns such as "every rank sends, then every rank receives" cannot deadlock;
    per-pair sequence numbers keep messages between two ranks in the order they were sent, and the
    receiver deletes each key once read. (gloo point-to-point is not usable here: a gloo send waits
    until the receiver posts its receive, and an unfinished gloo send can only be retired by a
    blocking wait, which would need a thread that is still blocked in C++ at interpreter exit.)
  * allgather/barrier: collectives over a dedicated gloo process group on all ranks (created by
    smp.init on every rank in the same order, so its tags never meet the engine's or the user's
    traffic). Each member posts non-blocking sends of an int64 length header and then the payload
    to every other member, and the matching receives; a lock keeps one rank's collectives in
    program order when several threads call them.

Objects are serialised with torch.save (tensors keep dtype, shape and device type; a CUDA tensor
arrives on the receiver's current CUDA device, or on the CPU where there is none) and read with
torch.load(weights_only=False): the peers are the ranks of this very job.

Every wait is bounded by the runtime timeout (SMSHIM_TIMEOUT); the error names the peer.
"""

from __future__ import annotations

import datetime
import io
import logging
import operator
import threading
import time
from typing import Any, Dict, List, Sequence

import torch
import torch.distributed as dist

from smshim.runtime import launch as _runtime
from smshim.modelparallel.torch.errors import SMPRuntimeError, SMPValidationError
from smshim.modelparallel.torch.state import require_init, state
from smshim.modelparallel.torch.topology import CommGroup, RankType

logger = logging.getLogger(__name__)

__all__ = [
    "CommGroup", "RankType", "broadcast", "send", "recv_from", "allgather", "barrier",
    "dp_barrier", "pp_barrier", "mp_barrier", "tp_barrier", "rdp_barrier",
]




# (header tag, payload tag) of the collective messages on the object group.
_COLL = (201, 202)
_PENDING = "pending"  # store counter: messages sent and not yet received, job-wide
# Largest value written to the store at once (TCPStore's server refuses values over 8 MB).
_CHUNK = 4 << 20

_send_lock = threading.Lock()
_send_seq: Dict[int, int] = {}
_recv_seq: Dict[int, int] = {}
_recv_locks: Dict[int, threading.Lock] = {}
_recv_locks_guard = threading.Lock()
_collective_lock = threading.Lock()


def _kind(group: Any, what: str) -> CommGroup:
    try:
        return CommGroup(int(group))
    except (TypeError, ValueError):
        raise SMPValidationError(
            f"{what}: {group!r} is not a group; pass an smp.CommGroup "
            "(e.g. smp.CommGroup.DP_GROUP) or an smp.RankType"
        ) from None


def _member(rank_in_group: Any, rank_type: Any, what: str) -> int:
    """The global rank of `rank_in_group` within this rank's group of `rank_type`."""
    kind = _kind(rank_type, what)
    members = state.topology.group(kind)
    try:
        index = None if isinstance(rank_in_group, bool) else operator.index(rank_in_group)
    except TypeError:
        index = None
    if index is None or not 0 <= index < len(members):
        raise SMPValidationError(
            f"{what}: rank {rank_in_group!r} is not in this rank's {kind.name} "
            f"(size {len(members)}, global ranks {members})"
        )
    peer = members[index]
    if peer == state.topology.rank:
        raise SMPValidationError(
            f"{what}: rank {rank_in_group} of {kind.name} is this rank itself "
            f"(global rank {peer}); a rank cannot message itself"
        )
    return peer


# Serialisation ------------------------------------------------------------------------------------
def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _map_location(storage: Any, location: str) -> Any:
    if location.startswith("cuda") and torch.cuda.is_available():
        return storage.cuda(torch.cuda.current_device())
    return storage


def _loads(payload: bytes) -> Any:
    return torch.load(io.BytesIO(payload), map_location=_map_location, weights_only=False)


# Transport ----------------------------------------------------------------------------------------
def _deadline() -> float:
    return time.monotonic() + _runtime.timeout_seconds()


def _wait(work: Any, deadline: float, what: str, peer: int) -> None:
    remaining = max(deadline - time.monotonic(), 0.001)
    try:
        work.wait(timeout=datetime.timedelta(seconds=remaining))
    except RuntimeError as e:
        raise SMPRuntimeError(
            f"{what}: rank {state.topology.rank} gave up on global rank {peer} after "
            f"{_runtime.timeout_seconds():.0f} s (SMSHIM_TIMEOUT); the peer did not make the "
            f"matching call or has failed ({e})"
        ) from None


def _next_seq(table: Dict[int, int], peer: int) -> int:
    seq = table.get(peer, 0)
    table[peer] = seq + 1
    return seq


def _send_payload(payload: bytes, peer: int) -> None:
    """Deposit `payload` for `peer`; returns at once (buffered), like an eager MPI send.

    The payload goes in chunks (the store caps one value at 8 MB); the key naming the chunk count
    is written last, so a receiver that sees it finds every chunk already there.
    """
    me = state.topology.rank
    store = state.object_store
    n = max(1, -(-len(payload) // _CHUNK))
    with _send_lock:  # seq and writes together, so messages to one peer keep their order
        base = f"{me}>{peer}/{_next_seq(_send_seq, peer)}"
        store.add(_PENDING, 1)  # before the message is visible, so the count never runs short
        for i in range(n):
            store.set(f"{base}/{i}", payload[i * _CHUNK:(i + 1) * _CHUNK])
        store.set(base, str(n))


def _recv_payload(peer: int, what: str) -> bytes:
    me = state.topology.rank
    store = state.object_store
    with _recv_locks_guard:
        lock = _recv_locks.setdefault(peer, threading.Lock())
    with lock:  # seq and read together, so each message is taken exactly once, in order
        seq = _next_seq(_recv_seq, peer)
        base = f"{peer}>{me}/{seq}"
        try:
            store.wait([base], datetime.timedelta(seconds=_runtime.timeout_seconds()))
        except Exception as e:  # noqa: BLE001  (DistStoreError / RuntimeError, by torch version)
            raise SMPRuntimeError(
                f"{what}: rank {me} waited {_runtime.timeout_seconds():.0f} s (SMSHIM_TIMEOUT) for "
                f"message {seq} from global rank {peer}; the peer did not call smp.send / "
                f"smp.broadcast for this rank, or has failed ({e})"
            ) from None
        n = int(store.get(base))
        chunks = [store.get(f"{base}/{i}") for i in range(n)]
        for key in [base] + [f"{base}/{i}" for i in range(n)]:
            store.delete_key(key)
        store.add(_PENDING, -1)
    return b"".join(chunks)


def drain_at_exit() -> None:
    """On rank 0, before the process exits, wait for unreceived smp.send messages to be read.

    Under env:// and mpirun, rank 0's process hosts the store; if it left while messages it
    (or anyone) sent were still unread, the receivers would lose them. Bounded by SMSHIM_TIMEOUT.
    """
    if not state.initialized or state.topology.rank != 0:
        return
    try:
        store = state.object_store
        pending = store.add(_PENDING, 0)
        if pending <= 0:
            return
        limit = _runtime.timeout_seconds()
        logger.warning("smp: %d smp.send/broadcast message(s) not yet received; rank 0 hosts the "
                       "store holding them and waits up to %.0f s before exiting", pending, limit)
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            time.sleep(0.05)
            pending = store.add(_PENDING, 0)
            if pending <= 0:
                return
        logger.error("smp: %d smp.send/broadcast message(s) were never received (no matching "
                     "smp.recv_from)", pending)
    except Exception:  # noqa: BLE001  (peers or store already gone: nothing left to protect)
        return


def _header(n: int) -> torch.Tensor:
    return torch.tensor([n], dtype=torch.int64)


def _exchange(obj: Any, members: Sequence[int], what: str) -> List[Any]:
    """Every member sends `obj` to every other member; returns the objects in member order."""
    me = state.topology.rank
    others = [m for m in members if m != me]
    if not others:
        return [obj]
    pg = state.object_group
    payload = torch.frombuffer(bytearray(_dumps(obj)), dtype=torch.uint8)
    header = _header(payload.numel())
    headers = {p: torch.empty(1, dtype=torch.int64) for p in others}
    deadline = _deadline()
    with _collective_lock:
        works = [(p, dist.isend(header, dst=p, group=pg, tag=_COLL[0])) for p in others]
        works += [(p, dist.irecv(headers[p], src=p, group=pg, tag=_COLL[0])) for p in others]
        for p, w in works:
            _wait(w, deadline, what, p)
        bodies = {p: torch.empty(int(headers[p].item()), dtype=torch.uint8) for p in others}
        works = [(p, dist.isend(payload, dst=p, group=pg, tag=_COLL[1])) for p in others]
        works += [(p, dist.irecv(bodies[p], src=p, group=pg, tag=_COLL[1])) for p in others]
        for p, w in works:
            _wait(w, deadline, what, p)
    return [obj if m == me else _loads(bodies[m].numpy().tobytes()) for m in members]


# Public API ---------------------------------------------------------------------------------------
def broadcast(obj: Any, group: CommGroup) -> None:
    """Send `obj` to every other rank of this rank's `group`; they call `recv_from`."""
    require_init("smp.broadcast")
    kind = _kind(group, "smp.broadcast")
    payload = _dumps(obj)
    for peer in state.topology.group(kind):
        if peer != state.topology.rank:
            _send_payload(payload, peer)


def send(obj: Any, dest_rank: int, rank_type: RankType) -> None:
    """Send `obj` to rank `dest_rank` of this rank's `rank_type` group; it calls `recv_from`."""
    require_init("smp.send")
    peer = _member(dest_rank, rank_type, "smp.send")
    _send_payload(_dumps(obj), peer)


def recv_from(src_rank: int, rank_type: RankType) -> Any:
    """Receive the object rank `src_rank` of this rank's `rank_type` group sent (send/broadcast)."""
    require_init("smp.recv_from")
    peer = _member(src_rank, rank_type, "smp.recv_from")
    return _loads(_recv_payload(peer, f"smp.recv_from {RankType(int(rank_type)).name} {src_rank}"))


def allgather(obj: Any, group: CommGroup) -> List[Any]:
    """Every rank of `group` contributes `obj`; each gets the list in group-rank order."""
    require_init("smp.allgather")
    kind = _kind(group, "smp.allgather")
    return _exchange(obj, state.topology.group(kind), f"smp.allgather over {kind.name}")


def barrier(group: CommGroup = CommGroup.WORLD) -> None:
    """Return once every rank of this rank's `group` has entered the barrier."""
    require_init("smp.barrier")
    kind = _kind(group, "smp.barrier")
    _exchange(None, state.topology.group(kind), f"smp.barrier over {kind.name}")


def dp_barrier() -> None:
    barrier(CommGroup.DP_GROUP)


def pp_barrier() -> None:
    barrier(CommGroup.PP_GROUP)


def mp_barrier() -> None:
    barrier(CommGroup.MP_GROUP)


def tp_barrier() -> None:
    barrier(CommGroup.TP_GROUP)


def rdp_barrier() -> None:
    barrier(CommGroup.RDP_GROUP)
