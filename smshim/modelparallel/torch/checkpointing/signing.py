"""Signatures on the checkpoint files smshim writes, so its own files load in full without a switch.

Why. A checkpoint is a pickle, and unpickling can run code, so smshim loads files with
`torch.load(weights_only=True)` and refuses anything more (`UnsafeCheckpointError`) unless told
the file is trusted. But a script's own `user_content` routinely holds numpy scalars or a
transformers config, which only full unpickling loads: a script's own checkpoint must resume
unchanged, while a file smshim did not write, or that was changed after writing, is still refused.
So smshim signs what it writes, as Jupyter signs the notebooks a user ran: an HMAC-SHA256 of the
file's bytes with a secret key only this user can read. A file whose signature verifies was
written by smshim under this key and not changed since: it is unpickled in full.

Key. `SMSHIM_CHECKPOINT_KEY` (at least 16 characters) when set: one secret shared by every node
of a cluster, whose ranks may resume files another node wrote. Otherwise a per-user key file,
`$XDG_CONFIG_HOME/smshim/checkpoint.key` (default `~/.config/smshim/checkpoint.key`), 32 random
bytes created on first save with mode 0600 in a 0700 directory. A key file that others can read
or write is not trusted (a warning; files are then written unsigned and load as before). If no
key can be had (e.g. a read-only home), files are written unsigned, with a warning.

Where the signature lives: in the file itself, as the zip archive's comment. torch.save writes a
zip archive whose last bytes are the end-of-central-directory record, ending in a 2-byte comment
length (0). The writer hashes every byte torch writes, then sets that length and appends the
signature line as the comment. The result is a valid zip archive, so plain `torch.load` (also
with mmap=True), `zipfile` and every other reader see the same archive; and compared with a
sidecar file: every rank's file carries its own signature (no extra files a rank must write,
rotate or copy, no listing or glob of a checkpoint directory changes), the signature is renamed
and copied with the file (e.g. to S3 and back), and it is written in the same atomic rename, so
no crash can leave a file and its signature out of step. The HMAC covers exactly the bytes torch
wrote (comment length 0), so the signed content is torch's file, byte for byte.

A file that is not a zip archive (torch's legacy format) is left unsigned.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass
from typing import IO, Any, Callable, Mapping, Optional

from smshim.modelparallel.torch.errors import SMPValidationError

logger = logging.getLogger(__name__)

__all__ = ["ENV_KEY", "Key", "Verified", "key_file_path", "load_key", "signing_writer",
           "read_verified"]

ENV_KEY = "SMSHIM_CHECKPOINT_KEY"
KEY_FILE = "checkpoint.key"
MIN_ENV_KEY_CHARS = 16
_DOMAIN = b"smshim checkpoint signature v1\0"  # HMAC input prefix: this key signs nothing else
_EOCD = b"PK\x05\x06"  # zip end-of-central-directory signature; the record is 22 bytes + comment
_EOCD_LEN = 22
_TRAILER = re.compile(rb"\nsmshim-signature v1 key=([0-9a-f]{16}) hmac-sha256=([0-9a-f]{64})\n\Z")
_TRAILER_LEN = len(b"\nsmshim-signature v1 key=") + 16 + len(b" hmac-sha256=") + 64 + 1


@dataclass(frozen=True)
class Key:
    """A signing key and where it came from (for messages; never the secret itself)."""

    secret: bytes
    source: str

    @property
    def key_id(self) -> str:
        """A public fingerprint: tells "signed with another key" from "changed after writing"."""
        return hashlib.sha256(b"smshim key id\0" + self.secret).hexdigest()[:16]


def key_file_path(env: Mapping[str, str] = os.environ) -> str:
    base = env.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "smshim", KEY_FILE)


def _parse_key_file(text: str) -> Optional[bytes]:
    text = text.strip()
    if len(text) == 64 and re.fullmatch(r"[0-9a-f]{64}", text):
        return bytes.fromhex(text)
    return None


def _read_key_file(path: str) -> Optional[Key]:
    """The key in `path`; None (with a warning) if it is unsafe or unreadable."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if st.st_mode & 0o077 or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
        logger.warning(
            "%s is not private to this user (mode %o): checkpoint signatures are not written or "
            "trusted with it. Run `chmod 600 %s` (or delete it to make a new key)",
            path, stat.S_IMODE(st.st_mode), path)
        return None
    for _ in range(50):  # another rank may be writing it right now (see _create_key_file)
        with open(path, encoding="ascii", errors="replace") as fh:
            secret = _parse_key_file(fh.read())
        if secret is not None:
            return Key(secret, path)
        time.sleep(0.02)
    logger.warning("%s does not hold an smshim key (64 hex digits): checkpoint signatures are "
                   "off; delete it to make a new key", path)
    return None


def _create_key_file(path: str) -> None:
    """Create the key file once, even when many ranks of one node try at the same moment: the
    key is written to a private temporary file and hard-linked into place, which fails if the
    file exists (the first rank's key wins, whole)."""
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    tmp = os.path.join(directory, f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as fh:
            fh.write(secrets.token_hex(32) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
            logger.info("created the checkpoint signing key %s (mode 0600)", path)
        except FileExistsError:
            pass
        except OSError:  # no hard links here: create-if-absent directly (readers retry briefly)
            with open(tmp, encoding="ascii") as src:
                text = src.read()
            try:
                fd2 = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                return
            with os.fdopen(fd2, "w", encoding="ascii") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def load_key(create: bool, env: Mapping[str, str] = os.environ) -> Optional[Key]:
    """The signing key: SMSHIM_CHECKPOINT_KEY, else the per-user key file (created when `create`).
    None when there is none (nothing verifies; files are written unsigned)."""
    raw = env.get(ENV_KEY)
    if raw is not None:
        if len(raw) < MIN_ENV_KEY_CHARS:
            raise SMPValidationError(
                f"{ENV_KEY} holds {len(raw)} characters: a signing key must be at least "
                f"{MIN_ENV_KEY_CHARS} (use e.g. `python -c \"import secrets; "
                f"print(secrets.token_hex(32))\"`), or unset it to use the per-user key file")
        return Key(raw.encode("utf-8"), f"${ENV_KEY}")
    path = key_file_path(env)
    # One look decides between reading the file and creating it: if another rank of this node
    # creates it after that look, `_create_key_file` leaves theirs and the read below finds it.
    if not create or os.path.exists(path):
        return _read_key_file(path)
    try:
        _create_key_file(path)
    except OSError as e:
        logger.warning("cannot create the checkpoint signing key %s (%s): checkpoints are written "
                       "unsigned; set %s to sign them", path, e, ENV_KEY)
        return None
    return _read_key_file(path)


def _mac(key: Key) -> "hmac.HMAC":
    return hmac.new(key.secret, _DOMAIN, hashlib.sha256)


def _trailer(key: Key, digest: str) -> bytes:
    line = f"\nsmshim-signature v1 key={key.key_id} hmac-sha256={digest}\n".encode("ascii")
    assert len(line) == _TRAILER_LEN
    return line


class _HashingWriter:
    """A write-only file object that hashes what passes through and keeps the last bytes."""

    def __init__(self, fh: IO[bytes], mac: "hmac.HMAC") -> None:
        self._fh, self._mac, self.tail = fh, mac, b""

    def write(self, data: Any) -> int:
        data = bytes(data)
        self._mac.update(data)
        self.tail = (self.tail + data[-_EOCD_LEN:])[-_EOCD_LEN:]
        return self._fh.write(data)

    def flush(self) -> None:
        self._fh.flush()


def signing_writer(write: Callable[[Any], None], key: Optional[Key]) -> Callable[[IO[bytes]], None]:
    """Wrap `write(fileobj)` (e.g. a torch.save) so that the file it produces carries `key`'s
    signature as its zip comment. With no key, or output that is not a zip archive, unchanged."""
    if key is None:
        return write

    def signed(fh: IO[bytes]) -> None:
        proxy = _HashingWriter(fh, _mac(key))
        write(proxy)
        tail = proxy.tail
        if len(tail) != _EOCD_LEN or not tail.startswith(_EOCD) or tail[-2:] != b"\0\0":
            logger.debug("%s: not a zip archive without comment; left unsigned",
                         getattr(fh, "name", "file"))
            return
        trailer = _trailer(key, proxy._mac.hexdigest())
        fh.seek(-2, os.SEEK_END)
        fh.write(len(trailer).to_bytes(2, "little") + trailer)

    return signed


@dataclass(frozen=True)
class Verified:
    """The file's bytes if its signature verified (load from these, not the path: no window for
    a swap between checking and loading); otherwise `data` is None and `problem` says why."""

    data: Optional[bytes]
    problem: str
    signed: bool


def _split(data: bytes) -> Optional[tuple]:
    """(torch's bytes, key id, digest) of a signed file, or None if it carries no signature."""
    if len(data) < _TRAILER_LEN + _EOCD_LEN:
        return None
    m = _TRAILER.search(data[-_TRAILER_LEN:])
    if m is None:
        return None
    body_end = len(data) - _TRAILER_LEN
    eocd = data[body_end - _EOCD_LEN:body_end]
    if not eocd.startswith(_EOCD) or eocd[-2:] != _TRAILER_LEN.to_bytes(2, "little"):
        return None
    original = data[:body_end - 2] + b"\0\0"
    return original, m.group(1).decode(), m.group(2).decode()


def read_verified(path: str, key: Optional[Key]) -> Verified:
    """Read `path` and check its signature with `key`."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size >= _TRAILER_LEN:  # most unsigned files are told apart by their last bytes alone
            fh.seek(size - _TRAILER_LEN)
            if _TRAILER.search(fh.read(_TRAILER_LEN)) is None:
                return Verified(None, "it carries no smshim signature", False)
        fh.seek(0)
        data = fh.read()
    parts = _split(data)
    if parts is None:
        return Verified(None, "it carries no smshim signature", False)
    original, key_id, digest = parts
    if key is None:
        return Verified(None, "it carries an smshim signature, but this machine has no signing "
                              f"key to check it ({key_file_path()} does not exist and {ENV_KEY} "
                              f"is unset): if another node wrote it, set {ENV_KEY} to the same "
                              "secret on every node", True)
    if key_id != key.key_id:
        return Verified(None, f"its smshim signature was made with another key (id {key_id}; "
                              f"this machine's key {key.source} has id {key.key_id}): on a "
                              f"cluster, set {ENV_KEY} to the same secret on every node", True)
    mac = _mac(key)
    mac.update(original)
    if not hmac.compare_digest(mac.hexdigest(), digest):
        return Verified(None, "its smshim signature does not match its contents: the file was "
                              "changed after smshim wrote it", True)
    return Verified(data, "", True)
