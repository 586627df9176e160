"""A portable archive of KV records: what ``tiered-kv storage export`` writes and ``import`` reads.

Layout (little-endian)::

    0   8   magic b"TKVARCHV"
    8   2   archive version (2)
    10  2   flags (bit 0: everything after the header is one zstd stream)
    12  8   id of the key that sealed the records (storage.seal; the exporting store's)
    20  ...  body, zstd-compressed when flag 0 is set:
            per record:  u32 length N (> 0) ‖ 64-byte key ‖ N bytes: the record as stored
            end:         u32 0 ‖ u64 record count ‖ u64 xxh3-64 of every byte before it

The hash covers the header and the uncompressed body up to and including the count, so a
truncated or damaged archive is detected as a whole. Records are kept byte for byte as the
store holds them, each with its own seal (a keyed MAC): the hash only finds damage, the
seals are what an importer trusts, and only with the exporting store's key. The key id in
the header names that key, so an importer can refuse at once an archive it has no key for.
Version 1 archives held records of the unsealed format and are refused. Reading and
writing are streamed: memory use is one record, whatever the archive's size. A reader
checks that a record's own header declares the length N before reading the rest of it, so
a forged length (a few KiB of zstd that expand to a gigabyte of zeros) is refused at once,
not read; and it grows the record's buffer as its bytes arrive, so a length forged in the
record's header too costs no more memory than the bytes that are there.
:func:`write_archive` creates the file 0600 (records hold users' prompts as KV) and only
under its name once it is complete.
"""
from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple

import xxhash
import zstandard

from storage.base import KEY_SIZE, BlockKey
from storage.record import FORMAT_VERSION as RECORD_FORMAT_VERSION
from storage.record import MAGIC as RECORD_MAGIC
from storage.record import SEAL_SIZE
from storage.seal import KEY_ID_SIZE

MAGIC = b"TKVARCHV"
VERSION = 2
FLAG_ZSTD = 1
# Larger lengths are damage, not records: a block of the largest models (126 layers, 8 KV
# heads of 128) is 528 MiB at the largest block size (1,024 tokens) in 16-bit floats. A
# record's own header must agree with its length before its buffer is allocated.
MAX_RECORD_BYTES = 1 << 30
_HEADER = struct.Struct(f"<8sHH{KEY_ID_SIZE}s")
_LENGTH = struct.Struct("<I")
_TRAILER = struct.Struct("<QQ")
_RECORD_HEAD = struct.Struct("<4sHHIQ")  # a record's magic, version, flags, H and P lengths
_READ_CHUNK = 16 << 20  # a record's bytes are read this many at a time, at most


class ArchiveError(ValueError):
    """The file is not an archive, or it is truncated or damaged."""


class ArchiveSummary(NamedTuple):
    records: int
    record_bytes: int
    key_id: bytes  # of the key that sealed the records


def read_key_id(path: str | Path) -> bytes:
    """The id of the key that sealed the archive's records, from its header alone."""
    header = _read(path, None, header_only=True)
    try:
        return next(header)
    finally:
        header.close()


class ArchiveWriter:
    """Writes records sealed under the key ``key_id`` names to ``file`` (opened for binary
    writing); :meth:`finish` writes the end."""

    def __init__(
        self, file: BinaryIO, key_id: bytes, *, compress: bool = False, level: int = 3
    ) -> None:
        if len(key_id) != KEY_ID_SIZE:
            raise ValueError(f"a key id is {KEY_ID_SIZE} bytes, got {len(key_id)}")
        self.key_id = key_id
        header = _HEADER.pack(MAGIC, VERSION, FLAG_ZSTD if compress else 0, key_id)
        file.write(header)
        self._hash = xxhash.xxh3_64(header)
        self._compressor = None
        self._out: BinaryIO = file
        if compress:
            self._compressor = zstandard.ZstdCompressor(level=level).stream_writer(
                file, closefd=False
            )
            self._out = self._compressor
        self.records = 0
        self.record_bytes = 0

    def _write(self, data: bytes) -> None:
        self._hash.update(data)
        self._out.write(data)

    def add(self, key: BlockKey, record: bytes) -> None:
        if not 0 < len(record) <= MAX_RECORD_BYTES:
            raise ValueError(f"a record of {len(record)} bytes cannot be archived")
        self._write(_LENGTH.pack(len(record)) + key.to_bytes())
        self._write(record)
        self.records += 1
        self.record_bytes += len(record)

    def finish(self) -> ArchiveSummary:
        self._write(_LENGTH.pack(0) + struct.pack("<Q", self.records))
        self._out.write(struct.pack("<Q", self._hash.intdigest()))
        if self._compressor is not None:
            self._compressor.close()
        return ArchiveSummary(self.records, self.record_bytes, self.key_id)


def write_archive(
    path: str | Path, records: Iterable[tuple[BlockKey, bytes]], key_id: bytes, *,
    compress: bool = False,
) -> ArchiveSummary:
    """Write ``records`` (sealed under the key ``key_id`` names) to a new archive at
    ``path``, readable by its owner only.

    The archive is written under a temporary name, fsynced and renamed, so a failure
    (an exception from ``records`` included) leaves no plausible-looking file.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)  # a leftover keeps its old mode: start afresh
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as file:
            writer = ArchiveWriter(file, key_id, compress=compress)
            for key, data in records:
                writer.add(key, data)
            summary = writer.finish()
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return summary


class _Counting:
    """A read-only file wrapper that reports how many bytes were read from it."""

    def __init__(self, file: BinaryIO, progress: Callable[[int], None] | None) -> None:
        self._file = file
        self._progress = progress

    def read(self, size: int = -1) -> bytes:
        data = self._file.read(size)
        if self._progress is not None and data:
            self._progress(len(data))
        return data

    def readinto(self, buffer) -> int:
        n = self._file.readinto(buffer)
        if self._progress is not None and n:
            self._progress(n)
        return n


def read_archive(
    path: str | Path, progress: Callable[[int], None] | None = None
) -> Iterator[tuple[BlockKey, bytes]]:
    """Yield ``(key, record bytes)`` pairs (each record a ``bytearray`` of its own); :class:`ArchiveError` when the archive is bad.

    The end (count and hash) is checked after the last record, so a consumer that must not
    act on a damaged archive reads it once to the end (:func:`check_archive`) first.
    ``progress(n)`` is called with the number of file bytes read.
    """
    items = _read(path, progress)
    next(items)  # the key id
    yield from items


def _read(path: str | Path, progress: Callable[[int], None] | None, *, header_only: bool = False):
    """The key id, then (unless ``header_only``) every ``(key, record bytes)`` pair."""
    try:
        with open(path, "rb") as raw:
            counted = _Counting(raw, progress)
            head = _read_exact(counted, 12, "header")
            magic, version, flags = struct.unpack("<8sHH", head)
            if magic != MAGIC:
                raise ArchiveError("not a tiered-kv archive (bad magic)")
            if version == 1:
                raise ArchiveError(
                    "archive version 1 holds records that no key sealed (written before "
                    f"records were sealed); this build reads version {VERSION} only"
                )
            if version != VERSION:
                raise ArchiveError(f"archive version {version}, this build reads {VERSION}")
            if flags & ~FLAG_ZSTD:
                raise ArchiveError(f"unknown archive flags {flags:#x}")
            header = head + _read_exact(counted, _HEADER.size - len(head), "header")
            yield _HEADER.unpack(header)[3]
            if header_only:
                return
            digest = xxhash.xxh3_64(header)
            body = counted
            if flags & FLAG_ZSTD:
                body = zstandard.ZstdDecompressor().stream_reader(counted, read_across_frames=True)
            count = 0
            while True:
                (length,) = _LENGTH.unpack(_read_exact(body, _LENGTH.size, "record length"))
                digest.update(_LENGTH.pack(length))
                if length == 0:
                    break
                if length > MAX_RECORD_BYTES:
                    raise ArchiveError(f"damaged (record {count} claims {length} bytes)")
                kb = _read_exact(body, KEY_SIZE, "record key")
                data = _read_record(body, length, count)
                digest.update(kb)
                digest.update(data)
                count += 1
                yield BlockKey.from_bytes(kb), data
            declared, stored = _TRAILER.unpack(_read_exact(body, _TRAILER.size, "trailer"))
            digest.update(struct.pack("<Q", declared))
            if declared != count:
                raise ArchiveError(f"damaged (ends after {count} records, says {declared})")
            if stored != digest.intdigest():
                raise ArchiveError("damaged (checksum mismatch)")
            if body.read(1):
                raise ArchiveError("damaged (bytes after the end)")
    except zstandard.ZstdError as e:
        raise ArchiveError(f"damaged (zstd: {e})") from None
    except OSError as e:
        raise ArchiveError(f"cannot read it: {e}") from None


def check_archive(
    path: str | Path, progress: Callable[[int], None] | None = None
) -> ArchiveSummary:
    """Read the whole archive and check its framing, count and hash."""
    records = nbytes = 0
    items = _read(path, progress)
    key_id = next(items)
    for _, data in items:
        records += 1
        nbytes += len(data)
    return ArchiveSummary(records, nbytes, key_id)


def _read_record(stream, length: int, index: int) -> bytearray:
    """A record of ``length`` bytes whose own header says it is that long, in a buffer that
    grows as the bytes arrive (not allocated at ``length`` first: a head that agrees with a
    forged length, then the end of the file, would cost a gigabyte)."""
    head = _read_exact(stream, min(length, _RECORD_HEAD.size), "record")
    magic, version, _, header_len, payload_len = _RECORD_HEAD.unpack(head.ljust(_RECORD_HEAD.size, b"\0"))
    if magic != RECORD_MAGIC or version != RECORD_FORMAT_VERSION or (
        header_len + payload_len + SEAL_SIZE != length
    ):
        raise ArchiveError(f"damaged (record {index} is not a record of {length} bytes)")
    record = bytearray(head)
    while len(record) < length:
        chunk = stream.read(min(length - len(record), _READ_CHUNK))
        if not chunk:
            raise ArchiveError("truncated (in a record)")
        record += chunk
    return record


def _read_exact(stream, size: int, what: str) -> bytes:
    """``size`` bytes (a short field)."""
    buffer = bytearray(size)
    _read_into(stream, memoryview(buffer), what)
    return bytes(buffer)


def _read_into(stream, view: memoryview, what: str) -> None:
    done = 0
    while done < len(view):
        n = stream.readinto(view[done:])
        if not n:
            raise ArchiveError(f"truncated (in a {what})")
        done += n
