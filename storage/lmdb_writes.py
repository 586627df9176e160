"""The disk tier's write path: puts and deletes, and eviction to the capacity.

``put``/``delete`` only update in-memory state (the index and the committer's map of
pending operations) and return; the writer thread commits them. Every key that leaves the
store other than through ``delete`` goes to ``on_evict`` (see :mod:`storage.lmdb_store`).

Capacity
    ``capacity_bytes`` bounds the sum of encoded record sizes of the store as seen by
    readers (committed plus pending). A ``put`` that would exceed it evicts at once, in
    the order of :class:`~storage.lmdb_eviction.ChainLru`: the records put with the
    highest ``priority`` value first (a lower value matters more, as a request's
    priority does); within one priority, the records that end their chain in the store
    before those with a child here, the least recently accessed first within each. A put
    that could only make room by evicting records that matter more is refused
    (``dropped``). The writer deletes the victims in the same transaction that stores the
    new record. A record's priority and parent hash are stored with its metadata (the
    latest put's), so records found at start-up keep their place; those of a version-1
    store have the default priority, 0, and those of a version-1 or 2 store no parent.

:class:`Writes` is a part of :class:`storage.lmdb_store.LmdbStore`: it uses the store's
lock, index (``_index``, ``_used``, ``_touched``), counters (``_stats``), limits
(``capacity_bytes``, ``max_record_bytes``, ``_max_batch_bytes``, ``_max_batch_items``),
``seal_key``, ``_on_evict`` and ``_check_writable``, and the committer's
``_enqueue_locked``, ``_enqueue_puts_locked``, ``_wait_for_room_locked``, ``_pending_bytes``, ``_max_pending_bytes``
and the writer's condition ``_work``.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from storage.base import BlockKey
from storage.lmdb_committer import Op
from storage.lmdb_meta import check_priorities
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
        :class:`~storage.record_batch.RecordBatch` at once, from its columns); each group is
        queued at once, so the writer commits it in one transaction.
        """
        self._check_writable()
        if isinstance(items, RecordBatch):
            kbs = list(map(b"".join, items.keys))
            datas: list[bytes | memoryview | None] = items.sealed(self.seal_key)
            created = items.created_ns
            parents = items.parent_hashes
        else:
            kbs, datas, created, parents = [], [], [], []
            for key, record in items:
                key.validate()
                if record.key != key:
                    raise ValueError(f"record is for {record.key.short()}, put under {key.short()}")
                kbs.append(key.to_bytes())
                datas.append(encode_record_buffer(record, self.seal_key))
                created.append(record.created_ns)
                parents.append(record.parent_hash)
        if priorities is None:
            ranks = [DEFAULT_PRIORITY] * len(kbs)
        else:
            ranks = list(priorities)
            if len(ranks) != len(kbs):
                raise ValueError(f"{len(ranks)} priorities for {len(kbs)} records")
            check_priorities(ranks)
        sizes = list(map(len, datas))
        if sizes and max(sizes) > self.max_record_bytes:  # refused at once (counted dropped)
            datas = [d if n <= self.max_record_bytes else None for d, n in zip(datas, sizes)]
            sizes = [n if n <= self.max_record_bytes else 0 for n in sizes]
        results: list[bool] = []
        evicted: list[bytes] = []
        start = 0
        for end in self._group_ends(sizes):
            group = slice(start, end)
            self._queue_puts(kbs[group], datas[group], sizes[group], created[group], ranks[group],
                             parents[group], results, evicted)
            start = end
        self._notify_gone(evicted)
        return results

    def _group_ends(self, sizes: list[int]) -> list[int]:
        """Where the groups of records of ``sizes`` end: each up to one write batch (its
        last record may take it past ``max_batch_bytes``)."""
        if len(sizes) < self._max_batch_items and sum(sizes) < self._max_batch_bytes:
            return [len(sizes)] if sizes else []
        ends: list[int] = []
        count = nbytes = 0
        for i, size in enumerate(sizes, 1):
            count += 1
            nbytes += size
            if nbytes >= self._max_batch_bytes or count >= self._max_batch_items:
                ends.append(i)
                count = nbytes = 0
        if count:
            ends.append(len(sizes))
        return ends

    def _queue_puts(
        self,
        kbs: list[bytes],
        datas: list[bytes | memoryview | None],
        sizes: list[int],
        created: list[int],
        priorities: list[int],
        parents: list[bytes | None],
        results: list[bool],
        evicted: list[bytes],
    ) -> None:
        """Queue a group of puts under one hold of the lock (``None`` data: refused)."""
        total = sum(sizes)
        with self._lock:
            self._check_writable()
            # Every record fits what is free and the pending budget: all of them are taken,
            # none evicts, and the index and the pending map take the group at once.
            if (None not in datas and total <= self.capacity_bytes - self._used
                    and self._pending_bytes + total <= self._max_pending_bytes):
                self._used += total - self._index.set_many(kbs, sizes, priorities, parents)
                self._enqueue_puts_locked(kbs, datas, created, priorities, parents)
                self._stats.puts += len(kbs)
                results.extend([True] * len(kbs))
                self._work.notify()
                return
            for kb, data, size, created_ns, priority, parent in zip(
                kbs, datas, sizes, created, priorities, parents
            ):
                results.append(
                    self._queue_put_locked(kb, data, size, created_ns, priority, parent, evicted)
                )
            self._work.notify()

    def _queue_put_locked(
        self, kb: bytes, data: bytes | memoryview | None, size: int, created_ns: int,
        priority: int, parent: bytes | None, evicted: list[bytes],
    ) -> bool:
        """One put of a group that does not fit at once: it may wait for the pending budget,
        evict, or be refused (counted dropped)."""
        if data is None:
            self._stats.dropped += 1
            return False
        if self._pending_bytes + size > self._max_pending_bytes:
            self._wait_for_room_locked(size)
            self._check_writable()
        # what is free always suffices; else see what it could evict or replace
        free = self.capacity_bytes - self._used
        if size > free and size > self._room_locked(kb, priority):
            self._stats.dropped += 1  # only records that matter more could make room
            return False
        replaced = self._index.get(kb)
        if replaced is not None:  # set updates it, no removal
            self._used -= replaced
        self._index.set(kb, size, priority, parent)
        self._used += size
        self._enqueue_locked(kb, Op.PUT, data, created_ns=created_ns, priority=priority,
                             parent=parent)
        self._stats.puts += 1
        if self._used > self.capacity_bytes:
            evicted.extend(self._evict_to_budget_locked(keep=kb))
        return True

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
        """Evict in order until the budget holds: never ``keep`` (the record a put is
        making room for) nor a record that matters more than it."""
        evicted = []
        while self._used > self.capacity_bytes:
            victim = self._index.first(keep)
            if victim is None:
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
