"""Administration of a disk store: verify, quarantine, listings, compaction, repair.

:class:`Admin` is a part of :class:`storage.lmdb_store.LmdbStore` (it uses the store's
environment, lock and read helpers). Everything here reads committed data in short read
transactions, so it works on a read-only store while a server writes, unless it says
otherwise; :meth:`Admin.repair` works on a directory whose data file LMDB must not map.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import lmdb

from storage.base import KEY_SIZE, BlockKey, StoreError
from storage.lmdb_committer import QUARANTINE_HEAD
from storage.lmdb_directory import (
    copy_key_file, fsync_dir, lock_writer, make_file_private, replace_aside, store_key,
)
from storage.lmdb_layout import (
    DATA_NAME, DB_META, DB_QUARANTINE, DB_RECORDS, DESCRIPTOR_NAME, KEYS_CHUNK, StoreDescriptor,
)
from storage.lmdb_meta import unpack_meta
from storage.lmdb_salvage import Found, salvage
from storage.priority_lru import DEFAULT_PRIORITY
from storage.record import MAGIC, Record, RecordError, decode_record
from storage.seal import KEY_FILE_NAME, SealKey

_REPAIR_BATCH = 256  # records per put_many: one writer transaction each
RECORDS_CHUNK_BYTES = 64 << 20  # records read per read transaction (short: pages stay reusable)


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


class RecordMeta(NamedTuple):
    """A committed record's metadata, as the ``meta`` db holds it (no record bytes read)."""

    key: BlockKey
    last_access_ns: int  # 0 when unknown (metadata rebuilt after a crash)
    nbytes: int
    created_ns: int
    priority: int  # the eviction priority it was put with (0 in a version-1 store)


class VerifiedRecord(NamedTuple):
    """A committed record that passed verification."""

    key: BlockKey
    record: Record  # its payload a view of ``data``
    data: bytes  # the record as stored, sealed under the store's key


class VerifiedRecords:
    """One pass over a store's committed records (all, or one namespace's) in key order,
    yielding those that pass verification; the keys of those that fail are collected in
    ``unreadable``. ``progress(1)`` is called for every record read, good or bad.

    Each record is verified on its own, so its MAC runs on BLAKE3's worker threads.
    """

    def __init__(
        self, store: Admin, namespace: bytes | None, progress: Callable[[int], None] | None
    ) -> None:
        self._store = store
        self._namespace = namespace
        self._progress = progress
        self.unreadable: list[BlockKey] = []

    def __iter__(self) -> Iterator[VerifiedRecord]:
        seal_key = self._store.seal_key
        for key, data in self._store.raw_records(self._namespace):
            if self._progress is not None:
                self._progress(1)
            try:
                record = decode_record(data, seal_key, key, parallel_mac=True)
            except RecordError:
                self.unreadable.append(key)
                continue
            yield VerifiedRecord(key, record, data)


class RepairResult(NamedTuple):
    """What :func:`repair` salvaged."""

    output: Path  # the repaired store
    moved_aside: Path | None  # where the damaged store went (a repair in place)
    salvaged: int
    skipped: int  # found, but unreadable, failing verification, or larger than the budget
    evicted: int  # salvaged, then evicted (or refused) to fit the budget
    problems: tuple[str, ...]  # what could not be read (the first hundred)


class Admin:
    """Admin operations of :class:`~storage.lmdb_store.LmdbStore` (see the module docstring)."""

    def quarantined(self) -> Iterator[QuarantineEntry]:
        """Records moved aside because they failed verification, with the reason."""
        self._check_open()
        last: bytes | None = None
        while True:
            batch: list[tuple[bytes, bytes]] = []
            with self._lmdb_errors(), self._env.begin(db=self._dbs[DB_QUARANTINE]) as txn:
                cursor = txn.cursor()
                more = cursor.set_range(last) if last is not None else cursor.first()
                if more and last is not None and cursor.key() == last:
                    more = cursor.next()
                while more and len(batch) < KEYS_CHUNK:
                    batch.append(cursor.item())
                    more = cursor.next()
            for kb, value in batch:
                yield _unpack_quarantine(kb, value)
            if not more or not batch:
                return
            last = batch[-1][0]

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

    def namespaces(self) -> list[bytes]:
        """The namespaces of committed records, in one read transaction (one seek each)."""
        self._check_open()
        found: list[bytes] = []
        with self._lmdb_errors(), self._env.begin(db=self._dbs[DB_RECORDS]) as txn:
            cursor = txn.cursor()
            more = cursor.first()
            while more:
                kb = cursor.key()
                if len(kb) != KEY_SIZE:
                    more = cursor.next()
                    continue
                namespace = kb[: KEY_SIZE // 2]
                found.append(namespace)
                after = int.from_bytes(namespace, "big") + 1
                if after >> (8 * len(namespace)):
                    break
                more = cursor.set_range(after.to_bytes(len(namespace), "big"))
        return found

    def metadata(self, namespace: bytes | None = None) -> Iterator[RecordMeta]:
        """Committed records' metadata in key order, each chunk from its own read transaction."""
        self._check_open()
        prefix = namespace or b""
        last: bytes | None = None
        while True:
            chunk: list[RecordMeta] = []
            with self._lmdb_errors(), self._env.begin(db=self._dbs[DB_META]) as txn:
                cursor = txn.cursor()
                more = cursor.set_range(last if last is not None else prefix)
                if more and last is not None and cursor.key() == last:
                    more = cursor.next()
                while more and len(chunk) < KEYS_CHUNK:
                    kb, value = cursor.item()
                    if not kb.startswith(prefix):
                        more = False
                        break
                    last = kb
                    meta = unpack_meta(value) if len(kb) == KEY_SIZE else None
                    if meta is not None:
                        chunk.append(RecordMeta(BlockKey.from_bytes(kb), *meta))
                    more = cursor.next()
            yield from chunk
            if not more:
                return

    def raw_records(self, namespace: bytes | None = None) -> Iterator[tuple[BlockKey, bytes]]:
        """Committed records exactly as stored (not verified), one short read transaction each.

        For export and inspection: pending operations of this process are not seen.
        """
        self._check_open()
        for kb, data in self._committed_records(namespace):
            yield BlockKey.from_bytes(kb), data

    def verified_records(
        self, namespace: bytes | None = None, progress: Callable[[int], None] | None = None
    ) -> VerifiedRecords:
        """Committed records that pass verification, read as :meth:`raw_records` reads
        them; the ones that fail are skipped and counted (:class:`VerifiedRecords`)."""
        return VerifiedRecords(self, namespace, progress)

    def _committed_records(self, namespace: bytes | None) -> Iterator[tuple[bytes, bytes]]:
        """Committed records in key order, each value read from the cursor at its key (a
        key whose bytes were damaged is still read, and fails its record's key check), in
        short read transactions of at most ``RECORDS_CHUNK_BYTES``."""
        prefix = namespace or b""
        resume: bytes | None = None  # the greatest key read so far
        while True:
            chunk: list[tuple[bytes, bytes]] = []
            size = 0
            with self._lmdb_errors(), self._env.begin(db=self._dbs[DB_RECORDS], buffers=True) as txn:
                cursor = txn.cursor()
                more = cursor.set_range(resume if resume is not None else prefix)
                while more and resume is not None and bytes(cursor.key()) <= resume:
                    more = cursor.next()  # read in the chunk before
                while more and size < RECORDS_CHUNK_BYTES:
                    kb = bytes(cursor.key())
                    if not kb.startswith(prefix):
                        more = False
                        break
                    if len(kb) == KEY_SIZE:
                        data = bytes(cursor.value())
                        chunk.append((kb, data))
                        size += len(data)
                    resume = kb if resume is None or kb > resume else resume
                    more = cursor.next()
            yield from chunk
            if not more:
                return

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
            self.descriptor.save(dest)
            copy_key_file(self.path, dest)
            self._env.copy(str(dest), compact=True)
            make_file_private(dest / DATA_NAME)
            fsync_dir(dest)
        except (OSError, lmdb.Error) as e:
            for name in (DESCRIPTOR_NAME, KEY_FILE_NAME, DATA_NAME):  # what this call created
                (dest / name).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                dest.rmdir()
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
        if tmp.exists():
            for leftover in tmp.iterdir():
                leftover.unlink()
            tmp.rmdir()
        self.flush()
        self._stop_writer()
        self._mark_closed()
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
            tmp.rmdir()
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

    @classmethod
    def repair(
        cls,
        source: str | os.PathLike[str],
        dest: str | os.PathLike[str] | None = None,
        *,
        capacity_bytes: int | None = None,
        progress: Callable[[int], None] | None = None,
        expected: Callable[[int | None], None] | None = None,
    ) -> RepairResult:
        """Salvage the readable records of a (damaged) store into a fresh one.

        ``source``'s data file is read page by page with ``pread``, never mapped (see
        :class:`storage.lmdb_salvage.Salvage`); every record found is checked against its key
        and the seal of ``source``'s key, and what cannot be read or fails is skipped; the
        rest is re-sealed under the fresh store's own new key, each record at the priority
        ``source``'s ``meta`` db still gives it (the default, 0, where that cannot be read:
        a smaller budget keeps the records that matter most). ``dest`` must be missing
        or empty; without it the repair is in place: the fresh store is built beside
        ``source``, which is then moved to ``<source>.damaged-<time>`` and replaced. The
        fresh store's budget is ``capacity_bytes``, or the one ``source`` records.
        ``expected(n)`` is told how many records the source claims (``None`` if unknown),
        ``progress(1)`` each one read. Needs ``source``'s writer lock: no server may hold it.
        """
        source = Path(source)
        if not (source / DESCRIPTOR_NAME).exists() or not (source / DATA_NAME).exists():
            raise StoreError(f"{source} is not a tiered-kv disk store with data to repair")
        lock_fd = lock_writer(source)
        try:
            source_key = store_key(source, create=False)
            if capacity_bytes is None:
                try:
                    capacity_bytes = StoreDescriptor.load(source).capacity_bytes
                except StoreError as e:
                    raise StoreError(f"{e}; give the new store's size") from None
            target = source.with_name(f"{source.name}.repairing") if dest is None else Path(dest)
            if target.exists() and (not target.is_dir() or any(target.iterdir())):
                raise StoreError(f"{target} exists and is not empty; repair writes a new store")
            try:
                priorities = _salvage_priorities(source)
                with salvage(source, DB_RECORDS) as found:
                    with cls(target, capacity_bytes, sync=False) as fresh:
                        if expected is not None:
                            expected(found.expected)
                        copied = _copy_verified(
                            found.entries(), source_key, priorities, fresh, progress
                        )
                        flushed = fresh.flush()  # False: commits failed, records were lost
                        stats = fresh.stats()
                        if not flushed:  # a full or failing disk
                            lost = stats.dropped - copied.refused - copied.oversized
                            raise StoreError(
                                f"{target}: {lost} salvaged records could not be written (a full "
                                "or failing disk?); nothing was changed: the source is as it was"
                            )
                        evicted = stats.evictions + copied.refused
            except BaseException:
                shutil.rmtree(target, ignore_errors=True)  # what this call created
                raise
            moved = None
            if dest is None:
                moved = replace_aside(source, target)
                target = source
        finally:
            os.close(lock_fd)
        return RepairResult(
            target, moved, copied.salvaged, copied.skipped, evicted, tuple(found.problems)
        )


def _salvage_priorities(source: Path) -> dict[bytes, int]:
    """Each key's priority as ``source``'s ``meta`` db still gives it, read like the
    records (:func:`salvage`); the first value found for a key wins. A key missing here
    gets the default priority: damaged metadata costs order, never records."""
    priorities: dict[bytes, int] = {}
    with salvage(source, DB_META) as found:
        for kb, value, _ in found.entries():
            meta = unpack_meta(value) if value is not None and len(kb) == KEY_SIZE else None
            if meta is not None and kb not in priorities:
                priorities[kb] = meta.priority
    return priorities


class _Copied(NamedTuple):
    salvaged: int
    skipped: int  # keys for which no good record fitted the fresh store
    refused: int  # salvaged, but refused: only records that matter more could make room
    oversized: int  # salvaged, but larger than the fresh store takes (among the skipped)


def _copy_verified(
    entries: Iterator[Found], source_key: SealKey, priorities: dict[bytes, int], fresh: Admin,
    progress: Callable[[int], None] | None,
) -> _Copied:
    """Put the first good record found for each key into ``fresh`` at its priority."""
    salvaged: set[bytes] = set()
    failed: set[bytes] = set()
    refused = oversized = 0
    batch: list[_Salvaged] = []
    for kb, value, scanned in entries:
        if progress is not None:
            progress(1)
        if kb in salvaged or scanned and (value is None or not value.startswith(MAGIC)):
            continue  # had already, or (found by scanning) an entry of another db
        try:
            key = BlockKey.from_bytes(kb)  # a damaged page can hold a key of any length
            record = decode_record(value or b"", source_key, key, parallel_mac=True)
        except (ValueError, RecordError):
            failed.add(kb)
            continue
        batch.append(_Salvaged(key, record, priorities.get(kb, DEFAULT_PRIORITY), len(value)))
        salvaged.add(kb)
        if len(batch) >= _REPAIR_BATCH:
            counts = _put(fresh, batch, salvaged, failed)
            refused, oversized, batch = refused + counts[0], oversized + counts[1], []
    counts = _put(fresh, batch, salvaged, failed)
    return _Copied(len(salvaged), len(failed - salvaged), refused + counts[0], oversized + counts[1])


class _Salvaged(NamedTuple):
    key: BlockKey
    record: Record
    priority: int
    nbytes: int  # as sealed under the source's key: the same size under the fresh one


def _put(
    fresh: Admin, batch: list[_Salvaged], salvaged: set[bytes], failed: set[bytes]
) -> tuple[int, int]:
    """Put ``batch``; how many were refused for want of room that mattered less, and how
    many were larger than ``fresh`` takes."""
    accepted = fresh.put_many(
        [(s.key, s.record) for s in batch], priorities=[s.priority for s in batch]
    )
    refused = oversized = 0
    for s, ok in zip(batch, accepted):
        if ok:
            continue
        if s.nbytes <= fresh.max_record_bytes:
            refused += 1
            continue
        salvaged.discard(s.key.to_bytes())  # larger than the fresh store takes
        failed.add(s.key.to_bytes())
        oversized += 1
    return refused, oversized


def _unpack_quarantine(kb: bytes, value: bytes) -> QuarantineEntry:
    when, size, why_len = QUARANTINE_HEAD.unpack_from(value)
    start = QUARANTINE_HEAD.size
    reason = value[start : start + why_len].decode("utf-8", "replace")
    return QuarantineEntry(
        BlockKey.from_bytes(kb), reason, when, size, bytes(value[start + why_len :])
    )

