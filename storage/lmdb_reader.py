"""The disk tier's read path: lookups, reads and their verification, key listings.

A read sees pending operations first (a put is visible before it commits), then reads
committed records in one short read transaction. Every record read is verified with the
store's seal key: a corrupt one is a miss, counted and, in a writer, queued for
quarantine. A read that meets a damaged page returns misses; in a writer, the keys it
could not read are forgotten and the store is marked to be checked page by page at its
next start. A hit makes its key the most recently used of its kind in the index (the
eviction order, :mod:`storage.lmdb_eviction`) and notes its access time, which the
writer commits in batches. A read-only store has no index: it looks every key up in
LMDB, only counts corruption, and does not track access order.

:class:`Reader` is a part of :class:`storage.lmdb_store.LmdbStore`: it uses the store's
lock, index (``_index``, ``_used``, ``_touched``), counters (``_stats``), ``_env``,
``_dbs``, ``seal_key`` and ``_notify_gone``, and the committer's pending map,
``_enqueue_locked`` and the writer's condition ``_work``.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence

import lmdb

from storage.base import KEY_SIZE, BlockKey
from storage.lmdb_committer import Op, short_key
from storage.lmdb_layout import DAMAGE_ERRORS, DB_RECORDS, KEYS_CHUNK, mark_damage_seen
from storage.record import Record, RecordError, decode_record

logger = logging.getLogger("storage.lmdb_store")


class Reader:
    """Lookups and reads of committed and pending records (a part of
    :class:`~storage.lmdb_store.LmdbStore`; see the module docstring)."""

    def contains(self, key: BlockKey) -> bool:
        kb = key.to_bytes()
        if self.readonly:
            return self.contains_many([key])[0]
        with self._lock:
            self._check_open()
            return kb in self._index

    def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        kbs = list(map(b"".join, keys))  # BlockKey.to_bytes, without a Python call a key
        if self.readonly:
            self._check_open()
            with self._env.begin(db=self._dbs[DB_RECORDS], buffers=True) as txn:
                return [txn.get(kb) is not None for kb in kbs]
        with self._lock:
            self._check_open()
            return self._index.contains_many(kbs)

    def longest_prefix(self, keys: Sequence[BlockKey]) -> int:
        if self.readonly:
            present = self.contains_many(keys)
            return present.index(False) if False in present else len(present)
        with self._lock:
            self._check_open()
            for i, key in enumerate(keys):
                if key.to_bytes() not in self._index:
                    return i
        return len(keys)

    def get(self, key: BlockKey) -> Record | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[BlockKey]) -> list[Record | None]:
        """Values for ``keys``, read in one short read transaction."""
        with self._read(keys, copy=True) as records:
            return records

    @contextlib.contextmanager
    def reading(self, keys: Sequence[BlockKey]) -> Iterator[list[Record | None]]:
        """Values for ``keys`` whose payloads are views of the memory map, not copies: valid
        inside the ``with`` block, whose read transaction keeps the pages in place."""
        with self._read(keys, copy=False) as records:
            yield records

    @contextlib.contextmanager
    def _read(self, keys: Sequence[BlockKey], *, copy: bool) -> Iterator[list[Record | None]]:
        kbs = [k.to_bytes() for k in keys]
        found: list[bytes | memoryview | None] = [None] * len(kbs)
        to_read: list[int] = []
        with self._lock:
            self._check_open()
            for i, kb in enumerate(kbs):
                entry = self._pending.get(kb)
                if entry is not None:
                    found[i] = entry.data  # None for a pending delete or quarantine
                elif self.readonly or kb in self._index:
                    to_read.append(i)
        txn = None
        try:
            if to_read:
                try:
                    txn = self._env.begin(db=self._dbs[DB_RECORDS], buffers=True)
                    for i in to_read:
                        buf = txn.get(kbs[i])
                        if buf is not None:
                            found[i] = bytes(buf) if copy else buf
                except lmdb.Error as e:  # a damaged file or a map outgrown: misses, not a crash
                    logger.error("%s: read failed: %s", self.path, e)
                    if isinstance(e, DAMAGE_ERRORS) and not self.readonly:
                        self._unreadable([kbs[i] for i in to_read if found[i] is None], e)
            yield self._verify(keys, kbs, found)
        finally:
            if txn is not None:
                txn.abort()  # a read transaction: ends it, and the views with it

    def _verify(
        self, keys: Sequence[BlockKey], kbs: list[bytes], found: list[bytes | memoryview | None]
    ) -> list[Record | None]:
        """Decode and check what was read, count hits and misses, quarantine the corrupt."""
        results: list[Record | None] = [None] * len(kbs)
        bad: list[tuple[bytes, RecordError, bytes | memoryview]] = []
        for i, data in enumerate(found):
            if data is None:
                continue
            try:
                results[i] = decode_record(data, self.seal_key, keys[i])
            except RecordError as e:
                bad.append((kbs[i], e, data))
        now = time.time_ns()
        with self._lock:
            for i, record in enumerate(results):
                if record is None:
                    self._stats.misses += 1
                    continue
                self._stats.hits += 1
                self._stats.bytes_read += len(found[i])
                if kbs[i] in self._index:
                    self._index.move_to_end(kbs[i])
                    self._touched[kbs[i]] = now
                    entry = self._pending.get(kbs[i])
                    if entry is not None and entry.queued and entry.op is Op.PUT:
                        # its commit may be this touch's, which skips a key with no meta
                        # yet; one the writer took already commits before the touch
                        entry.put_ns = now
            gone = [kb for kb, error, data in bad if self._corrupt_locked(kb, error, data)]
        self._notify_gone(gone)
        return results

    def _unreadable(self, kbs: list[bytes], error: lmdb.Error) -> None:
        """Keys a damaged page hid from a read: counted corrupt and forgotten (misses from
        now on, which the next save stores again), and the store is marked to be checked
        page by page at its next start, where a damaged file is moved aside."""
        with self._lock:
            gone = [kb for kb in kbs if kb in self._index and kb not in self._pending]
            for kb in gone:
                self._used -= self._index.pop(kb)
                self._touched.pop(kb, None)
            self._stats.corrupt += len(gone)
            first, self._damage_seen = not self._damage_seen, True
        if first:
            mark_damage_seen(self.path)
            logger.warning(
                "%s: a read met a damaged page (%s); its records are misses, and the store is "
                "checked page by page when it next opens (moved aside if damaged; or run "
                "`tiered-kv storage verify`)", self.path, error,
            )
        self._notify_gone(gone)

    def _corrupt_locked(self, kb: bytes, error: RecordError, data: bytes | memoryview) -> bool:
        """Count a record that failed verification (``data``, as it was read); True if the
        writer will quarantine it."""
        self._stats.corrupt += 1
        logger.warning("%s: corrupt record %s: %s", self.path, short_key(kb), error)
        if self.readonly or kb in self._pending or kb not in self._index:
            return False  # read-only, or already replaced or removed since it was read
        if not self._still_stored_locked(kb, data):
            return False  # a put replaced it and committed since it was read
        self._used -= self._index.pop(kb)
        self._touched.pop(kb, None)
        self._enqueue_locked(kb, Op.QUARANTINE, None, reason=f"{error.reason}: {error}")
        self._work.notify()
        return True

    def _still_stored_locked(self, kb: bytes, data: bytes | memoryview) -> bool:
        """Whether ``kb`` holds ``data`` now. With the lock held and no change of ``kb``
        pending, no commit can change it meanwhile."""
        try:
            with self._env.begin(db=self._dbs[DB_RECORDS], buffers=True) as txn:
                return txn.get(kb) == data
        except lmdb.Error as e:
            logger.error("%s: read failed: %s", self.path, e)
            return False

    def keys(self, namespace: bytes | None = None) -> Iterator[BlockKey]:
        """Present keys, read in chunks of short transactions; pending puts come first."""
        pending_puts: list[bytes] = []
        pending_keys: set[bytes] = set()
        with self._lock:
            self._check_open()
            for kb, entry in self._pending.items():
                pending_keys.add(kb)
                if entry.op is Op.PUT and (namespace is None or kb.startswith(namespace)):
                    pending_puts.append(kb)
        for kb in pending_puts:
            yield BlockKey.from_bytes(kb)
        for chunk in self._committed_key_chunks(namespace):
            if not self.readonly:
                with self._lock:
                    chunk = [kb for kb in chunk if kb in self._index]
            for kb in chunk:
                if kb not in pending_keys:
                    yield BlockKey.from_bytes(kb)

    def _committed_key_chunks(self, namespace: bytes | None) -> Iterator[list[bytes]]:
        """Committed record keys in key order, each chunk from its own read transaction."""
        for chunk in self._chunks_in_key_order(DB_RECORDS, namespace, values=False):
            keys = [kb for kb in chunk if len(kb) == KEY_SIZE]
            if keys:
                yield keys

    def _chunks_in_key_order(
        self, db: bytes, namespace: bytes | None, *, values: bool
    ) -> Iterator[list]:
        """The entries of ``db`` under ``namespace`` in key order, :data:`KEYS_CHUNK` at a
        time, each chunk from its own read transaction (short ones keep old pages
        reusable): keys, or ``(key, value)`` pairs with ``values``."""
        prefix = namespace or b""
        last: bytes | None = None
        while True:
            chunk: list = []
            with self._lmdb_errors(), self._env.begin(db=self._dbs[db]) as txn:
                cursor = txn.cursor()
                more = cursor.set_range(last if last is not None else prefix)
                if more and last is not None and cursor.key() == last:
                    more = cursor.next()
                while more and len(chunk) < KEYS_CHUNK:
                    kb = cursor.key()
                    if not kb.startswith(prefix):
                        more = False
                        break
                    chunk.append(cursor.item() if values else kb)
                    last = kb
                    more = cursor.next()
            if chunk:
                yield chunk
            if not more:
                return
