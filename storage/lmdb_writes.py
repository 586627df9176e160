"""The disk tier's write path: puts and deletes, and eviction to the capacity.

``put``/``delete`` only update in-memory state (the LRU index and the committer's map of
pending operations) and return; the writer thread commits them. Every key that leaves the
store other than through ``delete`` goes to ``on_evict`` (see :mod:`storage.lmdb_store`).

Capacity
    ``capacity_bytes`` bounds the sum of encoded record sizes of the store as seen by
    readers (committed plus pending). A ``put`` that would exceed it evicts at once, in
    the order of :class:`~storage.priority_lru.PriorityLru`: the records put with the
    highest ``priority`` value first (a lower value matters more, as a request's
    priority does), the least recently accessed first within one priority. A put that
    could only make room by evicting records that matter more is refused (``dropped``).
    The writer deletes the victims in the same transaction that stores the new record.
    A record's priority is stored with its metadata (the latest put's), so records found
    at start-up keep theirs; those of a version-1 store have the default, 0.

:class:`Writes` is a part of :class:`storage.lmdb_store.LmdbStore`: it uses the store's
lock, LRU index (``_index``, ``_used``, ``_touched``), counters (``_stats``), limits
(``capacity_bytes``, ``max_record_bytes``, ``_max_batch_bytes``, ``_max_batch_items``),
``seal_key``, ``_on_evict`` and ``_check_writable``, and the committer's
``_enqueue_locked``, ``_wait_for_room_locked``, ``_pending_bytes``, ``_max_pending_bytes``
and the writer's condition ``_work``.
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator, Sequence

from storage.base import BlockKey
from storage.lmdb_committer import Op
from storage.lmdb_meta import check_priority
from storage.priority_lru import DEFAULT_PRIORITY
from storage.record import Record, encode_record_buffer
from storage.record_batch import RecordBatch

logger = logging.getLogger("storage.lmdb_store")


class Writes:
    """Puts, deletes and eviction to the capacity (a part of
    :class:`~storage.lmdb_store.LmdbStore`; see the module docstring)."""

    def put(self, key: BlockKey, value: Record, *, priority: int = DEFAULT_PRIORITY) -> bool:
        return self.put_many([(key, value)], priorities=[priority])[0]

    def put_many(
        self,
        items: Iterable[tuple[BlockKey, Record]] | RecordBatch,
        *,
        priorities: Iterable[int] | None = None,
    ) -> list[bool]:
        """Queue records for the writer, in groups of up to one write batch.

        ``priorities``: one per item (default: all ``0``; integers of 64 bits, signed), the
        order of eviction (see Capacity above), stored with each record; a record put again
        takes the new one. Records are encoded on the calling thread (a
        :class:`~storage.record_batch.RecordBatch` straight from its columns); each group is
        queued at once, so the writer commits it in one transaction.
        """
        self._check_writable()
        results: list[bool] = []
        evicted: list[bytes] = []
        group: list[tuple[bytes, bytes | memoryview | None, int, int]] = []
        group_bytes = 0
        ranks = iter(priorities) if priorities is not None else itertools.repeat(DEFAULT_PRIORITY)
        if isinstance(items, RecordBatch):
            sealed = items.sealed(self.seal_key)
        else:
            sealed = self._sealed(items)
        for (key, data, created_ns), priority in zip(sealed, ranks, strict=priorities is not None):
            check_priority(priority)
            if len(data) > self.max_record_bytes:
                data = None
            group.append((key.to_bytes(), data, created_ns, priority))
            group_bytes += len(data) if data is not None else 0
            if group_bytes >= self._max_batch_bytes or len(group) >= self._max_batch_items:
                self._queue_puts(group, results, evicted)
                group, group_bytes = [], 0
        if group:
            self._queue_puts(group, results, evicted)
        self._notify_gone(evicted)
        return results

    def _sealed(
        self, items: Iterable[tuple[BlockKey, Record]]
    ) -> Iterator[tuple[BlockKey, bytes | memoryview, int]]:
        for key, record in items:
            key.validate()
            if record.key != key:
                raise ValueError(f"record is for {record.key.short()}, put under {key.short()}")
            yield key, encode_record_buffer(record, self.seal_key), record.created_ns

    def _queue_puts(
        self,
        group: list[tuple[bytes, bytes | memoryview | None, int, int]],
        results: list[bool],
        evicted: list[bytes],
    ) -> None:
        with self._lock:
            self._check_writable()
            index = self._index
            for kb, data, created_ns, priority in group:
                if data is None:
                    self._stats.dropped += 1
                    results.append(False)
                    continue
                size = len(data)
                if self._pending_bytes + size > self._max_pending_bytes:
                    self._wait_for_room_locked(size)
                    self._check_writable()
                # what is free always suffices; else see what it could evict or replace
                free = self.capacity_bytes - self._used
                if size > free and size > self._room_locked(kb, priority):
                    self._stats.dropped += 1  # only records that matter more could make room
                    results.append(False)
                    continue
                replaced = index.get(kb)
                if replaced is not None:  # set updates it, no removal
                    self._used -= replaced
                index.set(kb, size, priority)
                self._used += size
                self._enqueue_locked(kb, Op.PUT, data, created_ns=created_ns, priority=priority)
                self._stats.puts += 1
                if self._used > self.capacity_bytes:
                    evicted.extend(self._evict_to_budget_locked(keep=kb))
                results.append(True)
            self._work.notify()

    def delete(self, key: BlockKey) -> bool:
        return self.delete_many([key]) == 1

    def delete_many(self, keys: Sequence[BlockKey]) -> int:
        self._check_writable()
        removed = 0
        with self._lock:
            self._check_writable()
            for key in keys:
                kb = key.to_bytes()
                size = self._index.pop(kb, None)
                if size is None:
                    continue
                self._used -= size
                self._touched.pop(kb, None)
                self._enqueue_locked(kb, Op.DELETE, None)
                removed += 1
            self._work.notify()
        return removed

    def _room_locked(self, kb: bytes, priority: int) -> int:
        """Bytes a put of ``kb`` at ``priority`` may take: what is free, what it may evict,
        and the record it replaces."""
        room = self.capacity_bytes - self._used + self._index.weight_evicted_before(priority)
        if kb in self._index and self._index.priority(kb) < priority:
            room += self._index[kb]  # not among those it may evict, but replaced
        return room

    def _evict_to_budget_locked(self, keep: bytes | None = None) -> list[bytes]:
        evicted = []
        while self._used > self.capacity_bytes and self._index:
            victim = next(iter(self._index))
            if victim == keep:
                break
            self._used -= self._index.pop(victim)
            self._touched.pop(victim, None)
            self._enqueue_locked(victim, Op.DELETE, None)
            self._stats.evictions += 1
            evicted.append(victim)
        return evicted

    def _notify_gone(self, gone: list[bytes]) -> None:
        if self._on_evict is None:
            return
        for kb in gone:
            try:
                self._on_evict(BlockKey.from_bytes(kb))
            except Exception:
                logger.exception("%s: on_evict callback failed", self.path)
