"""The host-memory pool as the write-behind buffer of the lower tiers.

A block is committed with the tiers it still has to reach (``pending``: ``disk``,
``remote``) and stays in its slot, never evicted, until each of them is done with it.
Writers take pending blocks (:meth:`WriteBehind.take_pending`, or as columns
:meth:`WriteBehind.take_pending_columns`), oldest first, and report
them done (:meth:`WriteBehind.done_pending`), written or given up.

:class:`WriteBehind` is a part of :class:`storage.cpu_pool.CpuBlockPool`. It owns the
per-tier count and queue of pending blocks (``_pending_count``, ``_queues``, set up by
``_init_write_behind``); the pool's ``commit_many`` queues a batch's new blocks in them
directly, under the pool's lock, and ``delete`` and ``close`` change them through
``_unqueue_pending_locked`` and ``_clear_pending_locked``. It uses the pool's lock and its
condition ``_changed``, ``_entries``, ``_evictable``, ``_closed``, ``slot_view``,
``_settle_locked`` and ``_settle_clean_locked``.
"""
from __future__ import annotations

import collections
import time
from collections.abc import Iterable

from storage.base import BlockKey
from storage.cpu_slots import SlotBlock, SlotEntry, TakenBlocks


class WriteBehind:
    """Pending blocks per lower tier (a part of :class:`~storage.cpu_pool.CpuBlockPool`;
    see the module docstring)."""

    def _init_write_behind(self) -> None:
        self._pending_count: collections.Counter[str] = collections.Counter()
        # tier -> keys pending for it that no writer has taken yet, oldest first
        self._queues: collections.defaultdict[str, collections.OrderedDict[BlockKey, None]] = (
            collections.defaultdict(collections.OrderedDict)
        )

    def _queue_pending_locked(self, key: BlockKey, tiers: Iterable[str]) -> None:
        """``key`` is newly pending for ``tiers``: counted, and last in their queues."""
        for tier in tiers:
            self._pending_count[tier] += 1
            self._queues[tier][key] = None

    def _unqueue_pending_locked(self, key: BlockKey, tiers: Iterable[str]) -> None:
        """``key`` (leaving the pool) is no longer pending for ``tiers``."""
        for tier in tiers:
            self._pending_count[tier] -= 1
            self._queues[tier].pop(key, None)

    def _clear_pending_locked(self) -> None:
        self._pending_count.clear()
        self._queues.clear()

    def num_pending(self, tier: str) -> int:
        with self._lock:
            return self._pending_count[tier]

    def take_pending(
        self, tier: str, max_blocks: int, timeout: float | None = None, *, views: bool = True
    ) -> list[SlotBlock]:
        """Up to ``max_blocks`` blocks still pending for ``tier``, oldest first, each held
        (pinned against eviction and read) until :meth:`done_pending`. Waits up to
        ``timeout`` seconds for one (``None``: until one comes or the pool closes).
        ``views=False``: no ``kv`` view; the caller reads the slot's row of :attr:`slab`."""
        with self._lock:
            taken = self._take_pending_locked(tier, max_blocks, timeout)
            blocks = []
            for key, slot, parent_hash, token_ids, priority in zip(*taken):
                view = None
                if views:
                    entry = self._entries[key]
                    view = self.slot_view(slot, entry.dtype, entry.shape)
                blocks.append(SlotBlock(key, slot, view, parent_hash, token_ids, priority))
            return blocks

    def take_pending_columns(
        self, tier: str, max_blocks: int, timeout: float | None = None
    ) -> TakenBlocks:
        """:meth:`take_pending` as columns, without views: no object and no torch call a
        block (the writers' path)."""
        with self._lock:
            return self._take_pending_locked(tier, max_blocks, timeout)

    def _take_pending_locked(
        self, tier: str, max_blocks: int, timeout: float | None
    ) -> TakenBlocks:
        deadline = None if timeout is None else time.monotonic() + timeout
        queue = self._queues[tier]
        while not self._closed:
            if queue:
                popitem, entries = queue.popitem, self._entries
                keys = [popitem(False)[0] for _ in range(min(len(queue), max_blocks))]
                held = [entries[key] for key in keys]
                for entry in held:
                    entry.taken.add(tier)
                    entry.readers += 1
                return TakenBlocks(
                    keys, [e.slot for e in held], [e.parent_hash for e in held],
                    [e.token_ids for e in held], [e.priority for e in held],
                )
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            self._changed.wait(remaining)
        return TakenBlocks([], [], [], [], [])

    def done_pending(self, tier: str, keys: Iterable[BlockKey]) -> None:
        """The writer for ``tier`` is finished with these blocks (written, or given up)."""
        with self._lock:
            entries = self._entries
            done = 0
            settled: list[tuple[BlockKey, SlotEntry]] = []  # neither pending nor read now
            for key in keys:
                entry = entries.get(key)
                if entry is None or tier not in entry.taken:
                    continue
                entry.taken.discard(tier)
                entry.pending.discard(tier)
                entry.readers -= 1
                done += 1
                if not entry.pending and not entry.readers:
                    settled.append((key, entry))
            if done:
                self._pending_count[tier] -= done
            self._settle_clean_locked(settled)
            self._changed.notify_all()

    def add_pending(self, tier: str, keys: Iterable[BlockKey]) -> int:
        """Mark visible blocks as still to be written to ``tier``; how many were marked."""
        marked = 0
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and tier not in entry.pending:
                    entry.pending.add(tier)
                    self._evictable.pop(key, None)
                    self._queue_pending_locked(key, (tier,))
                    marked += 1
            if marked:
                self._changed.notify_all()
        return marked

    def drop_pending(self, tier: str) -> int:
        """Forget every block pending for ``tier`` that no writer holds; how many."""
        dropped = 0
        with self._lock:
            queue = self._queues[tier]
            while queue:
                key, _ = queue.popitem(last=False)
                entry = self._entries[key]
                entry.pending.discard(tier)
                self._pending_count[tier] -= 1
                dropped += 1
                self._settle_locked(key, entry)
            self._changed.notify_all()
        return dropped

    def wait_pending(self, tier: str, timeout: float | None = None) -> bool:
        """Wait until no block is pending for ``tier``; ``False`` on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._pending_count[tier] and not self._closed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._changed.wait(remaining)
            return True
