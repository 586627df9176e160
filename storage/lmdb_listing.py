"""Listings of a disk store's committed records: namespaces, metadata, the records as
stored, and the records that pass verification.

:class:`Listing` is a part of :class:`storage.lmdb_store.LmdbStore` (it uses the store's
environment, ``_dbs``, ``seal_key`` and ``_lmdb_errors``). Each listing reads committed
data in short read transactions, so it works on a read-only store while a server writes;
pending operations of this process are not seen.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

from storage.base import KEY_SIZE, BlockKey
from storage.lmdb_layout import DB_META, DB_RECORDS
from storage.lmdb_meta import unpack_meta
from storage.record import Record, RecordError, decode_record

RECORDS_CHUNK_BYTES = 64 << 20  # records read per read transaction (short: pages stay reusable)


class RecordMeta(NamedTuple):
    """A committed record's metadata, as the ``meta`` db holds it (no record bytes read)."""

    key: BlockKey
    last_access_ns: int  # 0 when unknown (metadata rebuilt after a crash)
    nbytes: int
    created_ns: int
    priority: int  # the eviction priority it was put with (0 in a version-1 store)
    parent_hash: bytes | None  # its parent's block hash; None for a root, or not known (a
    # store of version 1 or 2 read before its first open for writing upgraded it)


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
        self, store: Listing, namespace: bytes | None, progress: Callable[[int], None] | None
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


class Listing:
    """Listings of committed records (a part of :class:`~storage.lmdb_store.LmdbStore`;
    see the module docstring)."""

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
        for chunk in self._chunks_in_key_order(DB_META, namespace, values=True):
            for kb, value in chunk:
                meta = unpack_meta(value) if len(kb) == KEY_SIZE else None
                if meta is not None:
                    yield RecordMeta(BlockKey.from_bytes(kb), *meta)

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
