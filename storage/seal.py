"""The key that seals records: a keyed BLAKE3 MAC under a secret, and the secret's files.

Every record carries a *seal* (see :mod:`storage.record`): the sealing key's id and a
BLAKE3 MAC in keyed mode over everything before it. Without the secret nobody can build a
record that verifies, so whoever can write to a store, a remote server or an archive can
destroy records but never make one serve wrong KV.

Secrets
    A secret is text of at least :data:`MIN_SECRET_BYTES` bytes (surrounding whitespace is
    ignored), e.g. the output of ``openssl rand -hex 32``. Two keys are derived from it with
    BLAKE3's key derivation: the MAC key, and a public 8-byte key id that names the key in
    records and messages without revealing anything about it.

    - The disk tier's own secret is the file :data:`KEY_FILE_NAME` in the store directory,
      created 0600 with the store (:func:`create_key_file`).
    - The remote tier's secret is the deployment's, shared by every instance: a file or an
      environment variable (``tiered_kv.config.remote_seal_key`` reads the configuration).

A :class:`SealKey` never shows its secret: its ``repr`` is the key id.
"""
from __future__ import annotations

import hmac
import logging
import os
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path

from blake3 import blake3

logger = logging.getLogger(__name__)

MIN_SECRET_BYTES = 32
MAX_SECRET_FILE_BYTES = 4096
KEY_FILE_NAME = "seal.key"
KEY_ID_SIZE = 8
MAC_SIZE = 32
SEAL_SIZE = KEY_ID_SIZE + MAC_SIZE  # what a record ends with: the key id, then the MAC
# A MAC with ``parallel=True`` runs on BLAKE3's own worker threads from this size on (the
# same MAC, computed over the cores): for a caller that checks one record at a time, as the
# admin CLI's scans do. The engine's readers and writers run MACs side by side already, one
# per thread; there worker threads only contend (a 4-reader disk hit of 512 KiB blocks on
# 2 cores: 1.4 GB/s with them, 1.7-2.1 without). Below it, threads cost more than they save.
PARALLEL_MAC_BYTES = 256 << 10
# BLAKE3 key-derivation contexts: fixed, unique to this use, never changed.
_MAC_CONTEXT = "tiered-kv record seal v2: MAC key"
_ID_CONTEXT = "tiered-kv record seal v2: key id"


class SealKey:
    """A MAC key derived from a secret, and its public id. Immutable; safe to share."""

    __slots__ = ("_keyed", "_mac_key", "key_id")

    def __init__(self, secret: bytes, *, source: str = "the secret") -> None:
        secret = bytes(secret).strip()
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"{source} is {len(secret)} bytes; a secret needs at least {MIN_SECRET_BYTES} "
                "(e.g. the output of `openssl rand -hex 32`)"
            )
        self._mac_key = blake3(secret, derive_key_context=_MAC_CONTEXT).digest()
        self.key_id = blake3(secret, derive_key_context=_ID_CONTEXT).digest(length=KEY_ID_SIZE)
        self._keyed = blake3(key=self._mac_key)  # copied for each record a batch seals

    @classmethod
    def generate(cls) -> SealKey:
        """A key from a fresh random secret (not kept anywhere: for tests and throwaways)."""
        return cls(secrets.token_hex(32).encode("ascii"))

    def mac(self, *parts: bytes | memoryview, parallel: bool = False) -> bytes:
        """The MAC of the concatenation of ``parts``; ``parallel``: on BLAKE3's worker
        threads if it is large (see :data:`PARALLEL_MAC_BYTES`)."""
        threads = 1
        if parallel and sum(memoryview(part).nbytes for part in parts) >= PARALLEL_MAC_BYTES:
            threads = blake3.AUTO
        hasher = blake3(key=self._mac_key, max_threads=threads)
        for part in parts:
            hasher.update(part)
        return hasher.digest()

    def seal_into(self, buf: memoryview, end: int) -> None:
        """Write the seal of ``buf[:end]`` into ``buf[end : end + SEAL_SIZE]``: the key id,
        then the MAC of everything before the MAC (one call; it lets go of the GIL for the
        hashing as :meth:`mac` does)."""
        buf[end : end + KEY_ID_SIZE] = self.key_id
        signed = buf[: end + KEY_ID_SIZE]
        buf[end + KEY_ID_SIZE : end + SEAL_SIZE] = blake3(signed, key=self._mac_key).digest()

    def seal_many(self, buf: memoryview, spans: Iterable[tuple[int, int]]) -> None:
        """:meth:`seal_into` of each record ``(start, end)`` of ``buf``: the seal of
        ``buf[start:end]`` goes to ``buf[end : end + SEAL_SIZE]``. A copy of one keyed
        hasher a record costs less Python than a keyed hasher built from its arguments."""
        key_id, keyed = self.key_id, self._keyed
        for start, end in spans:
            signed = end + KEY_ID_SIZE
            buf[end:signed] = key_id
            hasher = keyed.copy()
            hasher.update(buf[start:signed])
            buf[signed : signed + MAC_SIZE] = hasher.digest()

    def check(self, mac: bytes | memoryview, *parts: bytes | memoryview, parallel: bool = False) -> bool:
        """Whether ``mac`` is this key's MAC of ``parts`` (compared in constant time)."""
        return hmac.compare_digest(self.mac(*parts, parallel=parallel), bytes(mac))

    @property
    def name(self) -> str:
        """The key id as hex: what messages and listings show."""
        return self.key_id.hex()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SealKey) and hmac.compare_digest(self._mac_key, other._mac_key)

    def __hash__(self) -> int:
        return hash(self.key_id)

    def __repr__(self) -> str:
        return f"SealKey(id={self.name})"

    def __reduce__(self):
        raise TypeError("a SealKey is not picklable")


def load_key_file(path: str | os.PathLike[str]) -> SealKey:
    """The key of a secret file. ``ValueError`` (naming the file, never its content) if the
    file is missing, unreadable, too large or too short; a warning if others may read it."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ValueError(f"secret file {path}: no such file") from None
    except OSError as e:
        raise ValueError(f"secret file {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"secret file {path}: not a regular file")
    if st.st_size > MAX_SECRET_FILE_BYTES:
        raise ValueError(f"secret file {path}: {st.st_size} bytes, not a secret (at most {MAX_SECRET_FILE_BYTES})")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        logger.warning("secret file %s is readable by other users (mode %o); make it 0600", path, mode)
    try:
        secret = path.read_bytes()
    except OSError as e:
        raise ValueError(f"secret file {path}: cannot read it: {e.strerror or e}") from None
    return SealKey(secret, source=f"secret file {path}")


def create_key_file(path: str | os.PathLike[str]) -> SealKey:
    """Write a new random secret to ``path`` (created 0600, never replaced); its key.

    ``FileExistsError`` if ``path`` exists.
    """
    path = Path(path)
    text = (secrets.token_hex(32) + "\n").encode("ascii")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, text)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return SealKey(text)
