"""Checkpoint files: `smp.save`, `smp.load`, `smp.save_checkpoint`, `smp.resume_from_checkpoint`.

Layout of `save_checkpoint(path, tag, ...)`:
    partial=True (each rdp_rank 0 rank writes its own files):
        path/{tag}_partial/model_{pp_rank}_{tp_rank}.pt       model.local_state_dict()
        path/{tag}_partial/optimizer_{pp_rank}_{tp_rank}.pt   optimizer.local_state_dict()
        path/{tag}_partial/user_content.pt                    user_content (rank 0)
    partial=False (rank 0 writes, after gathering over its PP group):
        path/{tag}                     model.state_dict(): a plain state dict of the unwrapped
                                       module, so `module.load_state_dict(torch.load(f))` works
        path/{tag}_optimizer.pt        optimizer.state_dict() (full, torch's format)
        path/{tag}_user_content.pt     user_content
    both:
        path/user_content.pt           the newest checkpoint's user_content (SageMaker's layout;
                                       Hugging Face touches an empty one as a format marker)
        path/newest                    the newest tag, written last

Crash safety: every file is written to a hidden temporary name in its directory, fsync'd and then
`os.replace`d over the target (`_atomic_write`, which tests replace to simulate a crash). All ranks
check in with each other (`_checked_barrier`) after the checkpoint's files are written and only
then does rank 0 replace `newest`; so a crash at any point leaves `newest` naming a complete
checkpoint. A failure on any rank is reported on every rank instead of leaving the others waiting.

Partial checkpoints load only at the pp degree (and partition) they were saved with; full ones at
any degree, and into a plain module.

Loading never runs code from a file smshim did not write unless asked to: everything is read
with `torch.load(weights_only=True)` (tensors, containers, numbers, strings) first. User content
(what `smp.save` / `user_content` were given) may be any picklable object, and full unpickling can
execute arbitrary code from the file. So every file smshim writes is signed (HMAC-SHA256 with a
per-user or cluster-wide key, checkpointing/signing.py), and a file whose signature verifies is
unpickled in full: a script's own checkpoints (numpy scalars, a transformers config in
user_content) resume with no switch. Any other file needs explicit opt-in: `weights_only=False`
to `smp.load` / `smp.resume_from_checkpoint`, or SMSHIM_ALLOW_PICKLE=1 for the whole process.
Without it such a file raises `UnsafeCheckpointError` naming the file and both switches (and why
its signature, if it has one, did not verify). `weights_only=True` never unpickles in full.
"""

from __future__ import annotations

import contextlib
import glob
import io
import logging
import os
import pickle
import re
import secrets
from typing import IO, Any, Callable, List, Optional, Tuple, Union

import torch

from smshim.modelparallel.torch.comm import CommGroup, allgather
from smshim.modelparallel.torch.errors import SMPRuntimeError, SMPValidationError, UnsafeCheckpointError
from smshim.modelparallel.torch.checkpointing.optimizer_sharding import SHARD_DP_SIZE_KEY, merge_shards
from smshim.modelparallel.torch.state import require_init, state
from smshim.modelparallel.torch.checkpointing import signing

logger = logging.getLogger(__name__)

__all__ = ["save", "load", "save_checkpoint", "resume_from_checkpoint"]

PathLike = Union[str, "os.PathLike[str]"]
NEWEST = "newest"
USER_CONTENT = "user_content.pt"


# Atomic files ---------------------------------------------------------------------------------
def _fsync_dir(directory: str) -> None:
    with contextlib.suppress(OSError):  # not every platform/filesystem can open a directory
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _atomic_write(path: str, write: Callable[[IO[bytes]], None]) -> None:
    """Write `path` via `write(fileobj)` so that readers see the old file or the whole new one.

    The temporary file starts with '.' so globs such as HF's `f + "_*"` never see it; it is
    created with os.open(0o666) so the umask applies as for any other file.
    """
    path = os.fspath(path)
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)  # make the rename itself durable


def _torch_writer(obj: Any, pickle_module: Any = pickle,
                  pickle_protocol: int = 2) -> Callable[[IO[bytes]], None]:
    """torch.save of `obj`, signed with this user's (or the cluster's) key (signing.py). The key
    is looked up now, before any file is opened: a misconfigured key fails the save cleanly."""
    def write(fh: Any) -> None:
        torch.save(obj, fh, pickle_module=pickle_module, pickle_protocol=pickle_protocol)

    return signing.signing_writer(write, signing.load_key(create=True))


def _load_weights(path: str, map_location: Any = None,
                  weights_only: Optional[bool] = None) -> Any:
    """Model and optimizer files smshim wrote from state dicts: tensors and plain values, read
    weights-only; anything more (e.g. a numpy scalar a scheduler left in param_groups) loads as
    user objects do."""
    return _load_user_object(path, map_location, weights_only)


ALLOW_PICKLE_ENV = "SMSHIM_ALLOW_PICKLE"


def _pickle_allowed(weights_only: Optional[bool]) -> bool:
    """The caller's weights_only decides; None defers to SMSHIM_ALLOW_PICKLE (default: no)."""
    if weights_only is not None:
        return not weights_only
    raw = os.environ.get(ALLOW_PICKLE_ENV, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise SMPValidationError(f"{ALLOW_PICKLE_ENV}={raw!r}: use 1 (allow) or 0 (default)")


def _refused_global(e: Exception) -> str:
    """The line of torch's weights_only message that names what the file wanted to import."""
    for line in str(e).splitlines():
        if "Unsupported global" in line:
            return f" ({line.strip().rstrip('.')})"
    return ""


def _load_user_object(path: str, map_location: Any = None,
                      weights_only: Optional[bool] = None) -> Any:
    """An object the user handed to smp.save / save_checkpoint. weights_only first; a file that
    needs full unpickling (which can execute code) is loaded in full only when smshim's signature
    on it verifies (and weights_only is not True), or on explicit opt-in."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if _pickle_allowed(weights_only):
            logger.warning("%s: loading with full unpickling (weights_only=False), as opted in",
                           path)
            return torch.load(path, map_location=map_location, weights_only=False)
        why = ""
        if weights_only is None:
            verified = signing.read_verified(path, signing.load_key(create=False))
            if verified.data is not None:
                # Unpickled from the very bytes whose signature was checked.
                logger.debug("%s: smshim signature verified; loading in full", path)
                return torch.load(io.BytesIO(verified.data), map_location=map_location,
                                  weights_only=False)
            if verified.signed:
                why = f" It was not loaded in full although signed: {verified.problem}."
        raise UnsafeCheckpointError(
            f"{path} holds objects that only full unpickling can load, and unpickling can "
            f"execute code from the file, so it was not done. If you trust this file, pass "
            f"weights_only=False (smp.load / smp.resume_from_checkpoint) or set "
            f"{ALLOW_PICKLE_ENV}=1.{_refused_global(e)}{why}") from None


# Collective helpers ---------------------------------------------------------------------------
def _checked_barrier(error: Optional[BaseException], what: str) -> None:
    """A WORLD barrier that also tells every rank whether any rank failed; raises if one did."""
    me = state.topology.rank
    status = None if error is None else f"{type(error).__name__}: {error}"
    statuses = allgather(status, CommGroup.WORLD)
    if error is not None:
        raise error
    failed = [(r, s) for r, s in enumerate(statuses) if s is not None]
    if failed:
        desc = "; ".join(f"rank {r}: {s}" for r, s in failed[:4])
        raise SMPRuntimeError(f"{what} failed on {len(failed)} rank(s) (this is rank {me}): {desc}")


def _run_checked(what: str, fn: Callable[[], Any]) -> Any:
    result, error = None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001  (reported to every rank, then re-raised here)
        error = e
    _checked_barrier(error, what)
    return result


# smp.save / smp.load --------------------------------------------------------------------------
def _partial_name(f: PathLike, v3: bool = False) -> str:
    topo = state.topology
    name = f"{os.fspath(f)}_{topo.pp_rank}_{topo.tp_rank}"
    if v3:
        return f"{name}_{topo.rdp_rank}"
    layout = _sdp_layout()  # sharded data parallelism: one file per shard
    return f"{name}_sdp{layout.shard_rank}" if layout is not None else name


def save(obj: Any, f: PathLike, partial: bool = True, pickle_module: Any = pickle,
         pickle_protocol: int = 2, v3: bool = False) -> None:
    """Save `obj`. partial=True: every calling rank writes `f"{f}_{pp_rank}_{tp_rank}"` (with
    v3, `_{rdp_rank}` appended: one file per rank of a sharded state; with sharded data
    parallelism `_sdp{shard_rank}`); normally called on the rdp_rank 0 ranks. partial=False: rank 0 writes `f`. Not a collective."""
    require_init("smp.save")
    if partial:
        target = _partial_name(f, v3)
    elif state.topology.rank == 0:
        target = os.fspath(f)
    else:
        return
    parent = os.path.dirname(os.path.abspath(target))
    os.makedirs(parent, exist_ok=True)
    _atomic_write(target, _torch_writer(obj, pickle_module, pickle_protocol))


def _missing_partial(name: str, pattern_base: str, what: str) -> FileNotFoundError:
    found = sorted(glob.glob(glob.escape(pattern_base) + "_*"))
    pp_ranks = sorted({int(m.group(1)) for p in found
                       if (m := re.search(r"_(\d+)_\d+(?:_\d+)?(?:\.pt)?$", p))})
    topo = state.topology
    hint = ""
    if pp_ranks and max(pp_ranks) + 1 != topo.pp_size:
        hint = (f" The files present are for pp ranks {pp_ranks}, i.e. it was saved at "
                f"pipeline_parallel_degree={max(pp_ranks) + 1}; a partial checkpoint loads only "
                "at that degree (use a full checkpoint to change it).")
    elif pp_ranks:
        hint = f" Only files for pp ranks {pp_ranks} are present: the checkpoint is incomplete."
    return FileNotFoundError(
        f"{what}: {name} does not exist (this rank is pp rank {topo.pp_rank} of "
        f"pipeline_parallel_degree={topo.pp_size}).{hint}")


def load(f: PathLike, map_location: Any = None, partial: bool = True,
         back_compat: bool = False, weights_only: Optional[bool] = None) -> Any:
    """Load what `smp.save` wrote: this rank's `f"{f}_{pp_rank}_{tp_rank}"` (partial) or `f`.
    `back_compat` (passed by Hugging Face for pre-1.10 smp files) changes nothing: smshim has
    one file format. `weights_only=False` allows full unpickling (see the module docstring)."""
    require_init("smp.load")
    if not partial:
        return _load_user_object(os.fspath(f), map_location, weights_only)
    name = _partial_name(f)
    if not os.path.exists(name):
        v3 = _partial_name(f, v3=True)
        if os.path.exists(v3):
            name = v3
        else:
            siblings = _v3_siblings(f)
            if not siblings:
                raise _missing_partial(name, os.fspath(f), "smp.load")
            name = siblings[0]  # saved at a larger dp degree: the shards are merged below
    obj = _load_user_object(name, map_location, weights_only)
    if isinstance(obj, dict) and SHARD_DP_SIZE_KEY in obj:
        # A sharded optimizer state (local_state_dict(gather_if_shard=False)) holds only one
        # replica's share: merge every replica's file, so it loads at any dp degree.
        saved = int(obj[SHARD_DP_SIZE_KEY])
        files = _v3_siblings(f)
        if len(files) != saved:
            raise FileNotFoundError(
                f"smp.load: {name} is one of {saved} optimizer-state shards, but {len(files)} "
                f"shard file(s) {files} exist for this pp/tp rank")
        obj = merge_shards([obj if fn == name else _load_user_object(fn, map_location,
                                                                     weights_only)
                            for fn in files])
    return obj


def _v3_siblings(f: PathLike) -> List[str]:
    """Every replica's v3 file of this pp/tp rank, by rdp rank."""
    topo = state.topology
    base = f"{os.fspath(f)}_{topo.pp_rank}_{topo.tp_rank}_"
    found = []
    for fn in glob.glob(glob.escape(base) + "*"):
        tail = fn[len(base):]
        if tail.isdigit():
            found.append((int(tail), fn))
    return [fn for _, fn in sorted(found)]


# Checkpoints ----------------------------------------------------------------------------------
def _sdp_layout() -> Any:
    """The model's shard layout under sharded data parallelism (None without it)."""
    return getattr(state.model, "sdp_layout", None)


def _rank_suffix() -> str:
    """pp_rank_tp_rank, and the shard rank under sharded data parallelism (each shard's own
    file, written by replica 0)."""
    topo = state.topology
    layout = _sdp_layout()
    shard = f"_sdp{layout.shard_rank}" if layout is not None else ""
    return f"{topo.pp_rank}_{topo.tp_rank}{shard}.pt"


def _rank_files(directory: str) -> Tuple[str, str]:
    suffix = _rank_suffix()
    return (os.path.join(directory, f"model_{suffix}"),
            os.path.join(directory, f"optimizer_{suffix}"))


def _translate_to_hf(sd: Any) -> Any:
    # Hugging Face registers (smp_to_hf, hf_to_smp) pairs here; smshim itself registers none.
    for pair in state.module_manager.translate_functions:
        sd = pair[0](sd)
    return sd


def _translate_from_hf(sd: Any) -> Any:
    for pair in state.module_manager.translate_functions:
        sd = pair[1](sd)
    return sd


def _write_newest(path: str, tag: str, user_content: Any) -> None:
    """Rank 0, once every rank's files are in place: user_content.pt, then `newest` (last)."""
    _atomic_write(os.path.join(path, USER_CONTENT), _torch_writer(user_content))
    _atomic_write(os.path.join(path, NEWEST), lambda fh: fh.write(tag.encode("utf-8")))


def _rotate(path: str, keep_tag: str, num_kept: int) -> None:
    """Delete this rank's files of the oldest partial checkpoints beyond `num_kept` (this one
    included). Age = the modification time of this rank's own model/optimizer file there; each
    rank deletes only what it wrote, and the last one out removes the directory."""
    topo = state.topology
    suffix = _rank_suffix()
    mine = [f"model_{suffix}", f"optimizer_{suffix}"] + ([USER_CONTENT] if topo.rank == 0 else [])
    aged = []
    for entry in os.listdir(path):
        d = os.path.join(path, entry)
        if not entry.endswith("_partial") or entry == f"{keep_tag}_partial" or not os.path.isdir(d):
            continue
        times = [os.path.getmtime(os.path.join(d, n)) for n in mine[:2]
                 if os.path.exists(os.path.join(d, n))]
        if times:
            aged.append((max(times), entry))
    aged.sort()
    for _, entry in aged[:max(0, len(aged) - (num_kept - 1))]:
        d = os.path.join(path, entry)
        for n in mine:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(d, n))
        with contextlib.suppress(OSError):  # not empty yet (other ranks' files) or gone already
            os.rmdir(d)
        logger.info("smp.save_checkpoint: removed old partial checkpoint %s (rank %d's files)",
                    d, topo.rank)


def save_checkpoint(path: PathLike, tag: str, partial: bool = True, model: Any = None,
                    optimizer: Any = None, user_content: Any = None,
                    translate_if_full: bool = True,
                    num_kept_partial_checkpoints: Optional[int] = None) -> None:
    """Save model/optimizer state and `user_content` under `path` (layout in the module
    docstring). Call it on every rank: it synchronises the ranks (and, for partial=False,
    gathers over the PP group). `model`/`optimizer` None: that part is not saved."""
    require_init("smp.save_checkpoint")
    path = os.fspath(path)
    tag = str(tag)
    if not tag or os.sep in tag or tag in (".", ".."):
        raise SMPValidationError(f"smp.save_checkpoint: tag={tag!r} must be a plain file name")
    if num_kept_partial_checkpoints is not None and int(num_kept_partial_checkpoints) < 1:
        raise SMPValidationError(
            f"smp.save_checkpoint: num_kept_partial_checkpoints={num_kept_partial_checkpoints} "
            "must be >= 1 (or None to keep every checkpoint)")
    topo = state.topology
    layout = _sdp_layout()
    # Sharded data parallelism: replica 0's ranks each write their shard; the full state dicts
    # are gathered by every rank.
    writer = topo.rdp_rank == 0 if layout is None else layout.replica == 0

    def write_partial() -> None:
        directory = os.path.join(path, f"{tag}_partial")
        model_file, opt_file = _rank_files(directory)
        # A sharded optimizer state is gathered over the DP group: every replica takes part.
        sharded = getattr(optimizer, "shards_state", False)
        osd = optimizer.local_state_dict() if sharded else None
        if writer:
            # Taken before any file is written: a misuse error (e.g. before partitioning) leaves
            # nothing behind.
            msd = model.local_state_dict() if model is not None else None
            if optimizer is not None and not sharded:
                osd = optimizer.local_state_dict()
            os.makedirs(directory, exist_ok=True)
            if msd is not None:
                _atomic_write(model_file, _torch_writer(msd))
            if osd is not None:
                _atomic_write(opt_file, _torch_writer(osd))
        if topo.rank == 0:
            os.makedirs(directory, exist_ok=True)
            _atomic_write(os.path.join(directory, USER_CONTENT), _torch_writer(user_content))

    def write_full() -> None:
        msd = osd = None
        if getattr(optimizer, "shards_state", False) or (layout is not None and optimizer is not None):
            osd = optimizer.state_dict()  # gathered over the replicas / shards: everyone
        if layout is not None and model is not None:
            msd = model.state_dict()  # gathered over the shards: everyone (onto rank 0)
        if topo.rdp_rank == 0 and layout is None:  # the MP group of rank 0 gathers; other replicas hold copies
            msd = model.state_dict() if model is not None else None
            if optimizer is not None and osd is None:
                osd = optimizer.state_dict()
        if topo.rank == 0:
            os.makedirs(path, exist_ok=True)
            if msd is not None:
                _atomic_write(os.path.join(path, tag),
                              _torch_writer(_translate_to_hf(msd) if translate_if_full else msd))
            if osd is not None:
                _atomic_write(os.path.join(path, f"{tag}_optimizer.pt"), _torch_writer(osd))
            _atomic_write(os.path.join(path, f"{tag}_{USER_CONTENT}"), _torch_writer(user_content))

    what = f"smp.save_checkpoint({path!r}, tag={tag!r})"
    _run_checked(what, write_partial if partial else write_full)

    # Every rank's files are complete: only now may `newest` point at this checkpoint.
    def finish() -> None:
        if topo.rank == 0:
            _write_newest(path, tag, user_content)
        if partial and writer and num_kept_partial_checkpoints is not None:
            _rotate(path, tag, int(num_kept_partial_checkpoints))

    _run_checked(what, finish)
    logger.info("%s: %s checkpoint written", what, "partial" if partial else "full")


def _read_user_content(path: str, tag: str, partial: bool, weights_only: Optional[bool]) -> Any:
    own = (os.path.join(path, f"{tag}_partial", USER_CONTENT) if partial
           else os.path.join(path, f"{tag}_{USER_CONTENT}"))
    for candidate in (own, os.path.join(path, USER_CONTENT)):
        if os.path.exists(candidate):
            if os.path.getsize(candidate) == 0:
                return None  # Hugging Face's marker file: no content
            return _load_user_object(candidate, "cpu", weights_only)
    return None


def _read_newest(path: str) -> str:
    newest = os.path.join(path, NEWEST)
    if not os.path.exists(newest):
        raise FileNotFoundError(
            f"smp.resume_from_checkpoint: {newest} does not exist; pass tag= or point path at a "
            "directory written by smp.save_checkpoint")
    with open(newest, encoding="utf-8") as fh:
        tag = fh.read().strip()
    if not tag:
        raise SMPRuntimeError(f"smp.resume_from_checkpoint: {newest} is empty")
    return tag


def resume_from_checkpoint(path: PathLike, tag: Optional[str] = None, partial: bool = True,
                           strict: bool = True, load_optimizer: bool = True,
                           load_sharded_optimizer_state: bool = True,
                           translate_function: Optional[Callable[[Any], Any]] = None,
                           weights_only: Optional[bool] = None) -> Any:
    """Load a checkpoint written by `save_checkpoint` into `smp.state.model`/`.optimizer` (applied
    after partitioning if the model is not partitioned yet) and return its user_content. Call it
    on every rank (the ranks check in with each other so that a failure raises everywhere).
    `load_sharded_optimizer_state` has no effect: with shard_optimizer_state the checkpoint's
    optimizer file holds the state gathered over the replicas, and each replica keeps its share.
    `weights_only=False` allows full unpickling of user_content (see the module docstring)."""
    require_init("smp.resume_from_checkpoint")
    path = os.fspath(path)
    model, optimizer = state.model, state.optimizer
    what = f"smp.resume_from_checkpoint({path!r})"

    def run() -> Any:
        if model is None:
            raise SMPRuntimeError(f"{what}: create the smp.DistributedModel first")
        if load_optimizer and optimizer is None:
            raise SMPRuntimeError(
                f"{what}: load_optimizer=True needs the smp.DistributedOptimizer to exist; create "
                "it first or pass load_optimizer=False")
        name = tag if tag is not None else _read_newest(path)
        if partial:
            directory = os.path.join(path, f"{name}_partial")
            model_file, opt_file = _rank_files(directory)
            if not os.path.isdir(directory) and os.path.isfile(os.path.join(path, name)):
                raise FileNotFoundError(
                    f"{what}: {name!r}{' (named by newest)' if tag is None else ''} is a full "
                    f"checkpoint ({os.path.join(path, name)}); load it with partial=False")
            layout = _sdp_layout()
            if not os.path.exists(model_file) and layout is not None:
                shards = glob.glob(os.path.join(glob.escape(directory), "model_*_sdp*.pt"))
                raise FileNotFoundError(
                    f"{what}: {model_file} does not exist: this rank holds shard "
                    f"{layout.shard_rank} of sharded_data_parallel_degree {layout.degree}, and the "
                    f"checkpoint has {len(shards)} shard file(s); a partial checkpoint loads only "
                    "at the sharded_data_parallel_degree it was saved with (save a full one, "
                    "partial=False, to change it)")
            if not os.path.exists(model_file):
                raise _missing_partial(model_file, os.path.join(directory, "model"), what)
            msd = _load_weights(model_file, "cpu", weights_only)
            osd = None
            if load_optimizer:
                if not os.path.exists(opt_file):
                    raise FileNotFoundError(
                        f"{what}: {opt_file} does not exist (the checkpoint was saved without an "
                        "optimizer); pass load_optimizer=False")
                osd = _load_weights(opt_file, "cpu", weights_only)
        else:
            model_file = os.path.join(path, name)
            if not os.path.isfile(model_file):
                hint = (f"; {name}_partial/ is a partial checkpoint: load it with partial=True"
                        if os.path.isdir(os.path.join(path, f"{name}_partial")) else "")
                raise FileNotFoundError(
                    f"{what}: full checkpoint {model_file} does not exist{hint}")
            msd = _load_weights(model_file, "cpu", weights_only)
            msd = translate_function(msd) if translate_function is not None \
                else _translate_from_hf(msd)
            osd = None
            opt_file = os.path.join(path, f"{name}_optimizer.pt")
            if load_optimizer:
                if os.path.exists(opt_file):
                    osd = _load_weights(opt_file, "cpu", weights_only)
                else:
                    logger.warning("%s: no optimizer state at %s; only the model is loaded",
                                   what, opt_file)
        # Both validate now (degree, keys before partitioning where possible) and apply now or
        # right after partitioning.
        model.load_state_dict(msd, strict=strict)
        if osd is not None:
            optimizer.load_state_dict(osd)
        # Last: a degree or key mismatch is the error to report first.
        return _read_user_content(path, name, partial, weights_only)

    return _run_checked(what, run)
