"""The disk tier's descriptor, ``<dir>/tiered_kv.json``: which format and store version a
directory holds, its capacity and the LMDB map size it was created with. It is read before
LMDB maps anything (:mod:`storage.lmdb_layout`), so that a directory of another format, or
of a newer build, is refused with a clear error and left as it is.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import lmdb

from storage.base import StoreError
from storage.lmdb_directory import DESCRIPTOR_NAME, fsync_dir
from storage.record import FORMAT_VERSION as RECORD_FORMAT_VERSION

FORMAT_NAME = "tiered-kv-lmdb"
# 2: meta values carry the priority, 3: and the parent hash (storage.lmdb_meta); 1 and 2
# are read as they are
STORE_VERSION = 3
DESCRIPTOR_TMP_NAME = ".tiered_kv.json.tmp"  # written, synced, then renamed into place
MiB = 1 << 20


def default_map_size(capacity_bytes: int) -> int:
    """Address space reserved for ``capacity_bytes`` of records.

    Twice the budget plus 64 MiB: overflow pages round every record up to whole pages,
    pages freed by a commit are reusable only two commits later (copy-on-write keeps the
    previous snapshot intact), and the B-trees and free list need room of their own.
    """
    return -(-(2 * capacity_bytes + 64 * MiB) // MiB) * MiB


@dataclasses.dataclass(frozen=True)
class StoreDescriptor:
    """The contents of ``tiered_kv.json``."""

    format: str
    version: int
    created_ns: int
    capacity_bytes: int
    map_size: int
    record_format_version: int = RECORD_FORMAT_VERSION
    lmdb_version: str = ".".join(map(str, lmdb.version()))

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        fields["created"] = time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created_ns / 1e9)
        )
        return json.dumps(fields, indent=2, sort_keys=True) + "\n"

    @classmethod
    def load(cls, path: Path) -> StoreDescriptor:
        """Read and check a store's descriptor; :class:`StoreError` if it is not ours."""
        where = path / DESCRIPTOR_NAME
        try:
            fields = json.loads(where.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise StoreError(f"{where}: unreadable store descriptor ({e})") from None
        if not isinstance(fields, dict) or fields.get("format") != FORMAT_NAME:
            raise StoreError(f"{path} is not a tiered-kv disk store ({where} names another format)")
        version = fields.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise StoreError(f"{where}: the store version is missing or not a version")
        if version > STORE_VERSION:
            raise StoreError(
                f"{path} was written by a newer tiered-kv (store version {version}; this build "
                f"reads up to {STORE_VERSION}); upgrade tiered-kv or use another directory"
            )
        try:
            descriptor = cls(
                format=FORMAT_NAME,
                version=version,
                created_ns=int(fields["created_ns"]),
                capacity_bytes=int(fields["capacity_bytes"]),
                map_size=int(fields["map_size"]),
                record_format_version=int(fields.get("record_format_version", 1)),
                lmdb_version=str(fields.get("lmdb_version", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise StoreError(f"{where}: malformed store descriptor ({e})") from None
        if descriptor.capacity_bytes <= 0 or descriptor.map_size <= 0:
            raise StoreError(
                f"{where}: malformed store descriptor (capacity_bytes {descriptor.capacity_bytes}, "
                f"map_size {descriptor.map_size}: both must be positive)"
            )
        return descriptor

    def save(self, path: Path) -> None:
        """Replace the descriptor atomically (write, fsync, rename, fsync the directory)."""
        tmp = path / DESCRIPTOR_TMP_NAME
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, self.to_json().encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path / DESCRIPTOR_NAME)
        fsync_dir(path)
