"""Administration of a disk store: verify, quarantine, compaction, info.

:class:`Admin` is a part of :class:`storage.lmdb_store.LmdbStore` (it uses the store's
environment, lock and read helpers, and the scan of committed records of
:class:`~storage.lmdb_listing.Listing`). Everything here reads committed data in short
read transactions, so it works on a read-only store while a server writes, unless it
says otherwise.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import lmdb

from storage.base import BlockKey, StoreError
from storage.lmdb_committer import QUARANTINE_HEAD
from storage.lmdb_directory import copy_key_file, fsync_dir, make_file_private
from storage.lmdb_descriptor import StoreDescriptor
from storage.lmdb_layout import DATA_NAME, DB_QUARANTINE
from storage.record import RecordError, decode_record


class QuarantineEntry(NamedTuple):
    """A record moved aside because it failed verification."""

    key: BlockKey
    reason: str
    quarantined_ns: int
    nbytes: int  # size of the bad record; only its first QUARANTINE_KEEP_BYTES are kept
    head: bytes


class VerifyResult(NamedTuple):
    """What :meth:`Admin.verify` found."""

    checked: int
    ok: int
    corrupt: int
    quarantined: int  # 0 for a read-only store, which can only report
    bytes_checked: int


@dataclasses.dataclass(frozen=True)
class StoreInfo:
    """The descriptor plus what the environment reports, for the admin CLI."""

    path: str
    readonly: bool
    descriptor: StoreDescriptor
    entries: int
    bytes_used: int
    quarantined: int
    data_file_bytes: int  # allocated on disk (the map is sparse)
    map_size: int
    last_page: int
    page_size: int
    reader_pids: tuple[int, ...]  # other processes holding a slot in the reader table


class Admin:
    """Admin operations of :class:`~storage.lmdb_store.LmdbStore` (see the module docstring)."""

    def quarantined(self) -> Iterator[QuarantineEntry]:
        """Records moved aside because they failed verification, with the reason."""
        self._check_open()
        for chunk in self._chunks_in_key_order(DB_QUARANTINE, None, values=True):
            for kb, value in chunk:
                yield _unpack_quarantine(kb, value)

    def clear_quarantine(self) -> int:
        """Forget every quarantined record; returns how many there were."""
        self._check_writable()
        self._check_open()
        with self._lmdb_errors(), self._env.begin(write=True) as txn:
            count = txn.stat(self._dbs[DB_QUARANTINE])["entries"]
            txn.drop(self._dbs[DB_QUARANTINE], delete=False)
        return count

    def verify(self, progress: Callable[[int], None] | None = None) -> VerifyResult:
        """Read and check every committed record against the store's key (its seal, its
        fields, its key); quarantine the bad ones (when writable).

        ``progress(n)`` is called after every ``n`` records read.
        """
        checked = ok = nbytes = 0
        bad: list[tuple[bytes, RecordError, bytes]] = []
        for kb, data in self._committed_records(None):
            checked += 1
            nbytes += len(data)
            try:
                decode_record(data, self.seal_key, BlockKey.from_bytes(kb), parallel_mac=True)
                ok += 1
            except RecordError as e:
                bad.append((kb, e, data))
            if progress is not None:
                progress(1)
        with self._lock:
            gone = [kb for kb, error, data in bad if self._corrupt_locked(kb, error, data)]
        self._notify_gone(gone)
        if gone and not self.flush():
            raise StoreError(
                f"{self.path}: quarantining {len(gone)} bad records could not be committed "
                "(a full or failing disk?)"
            )
        return VerifyResult(checked, ok, len(bad), len(gone), nbytes)

    def copy_compacted(self, dest: str | os.PathLike[str]) -> None:
        """Write a compacted copy of the store (descriptor and data) into the new directory
        ``dest``, from one read snapshot; this store stays usable, and a writer may go on."""
        self._check_open()
        self.flush()
        dest = Path(dest)
        try:
            dest.mkdir(mode=0o700)
        except OSError as e:
            raise StoreError(f"cannot create {dest}: {e}") from None
        try:
            try:
                self.descriptor.save(dest)
                copy_key_file(self.path, dest)
                self._env.copy(str(dest), compact=True)
                make_file_private(dest / DATA_NAME)
                fsync_dir(dest)
            except BaseException:  # a full disk, or Ctrl-C: no half-made store is left
                _remove_copy(dest)
                raise
        except (OSError, lmdb.Error) as e:
            raise StoreError(f"cannot copy {self.path} to {dest}: {e}") from None

    def compact_and_close(self) -> None:
        """Replace the data file by a compacted copy, then close the store.

        Needs the writer lock (a store opened for writing) and no other process with the
        environment open: a reader would keep using the old file.
        """
        self._check_writable()
        others = self.info().reader_pids
        if others:
            raise StoreError(
                f"{self.path} is open in other processes (pids {', '.join(map(str, others))}); "
                "compacting in place needs it idle"
            )
        tmp = self.path / ".compact.tmp"
        _remove_copy(tmp)  # left by a run killed midway
        self.flush()
        self._stop_writer()
        self._mark_closed()
        try:
            try:
                tmp.mkdir(mode=0o700)
                self._env.copy(str(tmp), compact=True)
                make_file_private(tmp / DATA_NAME)
                fd = os.open(tmp / DATA_NAME, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                self._env.close()
                self._env = None
                os.replace(tmp / DATA_NAME, self.path / DATA_NAME)
                fsync_dir(self.path)
            finally:  # a partial copy (a full disk, Ctrl-C) would only take the disk's room
                _remove_copy(tmp)
        except (OSError, lmdb.Error) as e:
            raise StoreError(f"cannot compact {self.path}: {e}") from None
        finally:
            self._release()

    def info(self) -> StoreInfo:
        """The descriptor and the environment's own figures."""
        self._check_open()
        stats = self.stats()
        with self._lmdb_errors():
            env_info, env_stat = self._env.info(), self._env.stat()
            with self._env.begin() as txn:
                quarantined = txn.stat(self._dbs[DB_QUARANTINE])["entries"]
            readers = self._env.readers().splitlines()[1:]  # a header, then "pid thread txnid"
        return StoreInfo(
            path=str(self.path),
            readonly=self.readonly,
            descriptor=self.descriptor,
            entries=stats.entries,
            bytes_used=stats.bytes_used,
            quarantined=quarantined,
            data_file_bytes=(self.path / DATA_NAME).stat().st_blocks * 512,
            map_size=env_info["map_size"],
            last_page=env_info["last_pgno"],
            page_size=env_stat["psize"],
            reader_pids=tuple(sorted({int(line.split()[0]) for line in readers} - {os.getpid()})),
        )


def _remove_copy(directory: Path) -> None:
    """Remove a directory a copy was being written into, and its files (no subdirectories)."""
    if not directory.is_dir():
        return
    for leftover in directory.iterdir():
        leftover.unlink()
    directory.rmdir()


def _unpack_quarantine(kb: bytes, value: bytes) -> QuarantineEntry:
    when, size, why_len = QUARANTINE_HEAD.unpack_from(value)
    start = QUARANTINE_HEAD.size
    reason = value[start : start + why_len].decode("utf-8", "replace")
    return QuarantineEntry(
        BlockKey.from_bytes(kb), reason, when, size, bytes(value[start + why_len :])
    )
