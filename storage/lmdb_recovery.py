"""The disk tier's recovery from failed commits: a full map, a full or failing disk.

LMDB never overwrites pages a committed snapshot may still use, and pages freed by commit
*N* become reusable only at commit *N + 2*, so deleting inside the failing transaction
does not help. Recovery evicts the records eviction takes first in a commit of its own,
commits once more so the freed pages become reusable, and retries:

- **A full map** (``MapFullError``): evict what the batch needs or 10 % of
  ``min(capacity, map_size)`` and retry, again and again; with nothing left to evict the
  batch is split, and a single record that does not fit an otherwise empty store dropped.
- **A full or failing disk** (``ENOSPC``, ``EDQUOT``, ``EIO``): evict what the batch needs
  or 10 % of what is stored and retry once. If that fails too, the store is *degraded*:
  one WARNING, the batch's puts dropped (``dropped``; the next ``flush`` returns False),
  and later batches tried once each, without evicting, until one commits. Recovery is
  tried again every ``DEGRADED_RETRY_S``. Evictions whose own commit failed are undone.
  Any other LMDB error on commit degrades the store at once.

:class:`Recovery` is a part of :class:`storage.lmdb_store.LmdbStore`: it uses the store's
lock, index and counters, and the committer's pending map and ``_write_txn``.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import time

import lmdb

from storage.lmdb_committer import Op, Pending, short_key

logger = logging.getLogger("storage.lmdb_store")

DEGRADED_RETRY_S = 30.0
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO)


def is_disk_error(error: lmdb.Error) -> bool:
    """A full or failing disk. py-lmdb raises ``DiskError`` for ENOSPC and sets ``code``
    on the others from 3.0 on; older releases only name them in the message."""
    if isinstance(error, lmdb.DiskError):
        return True
    code = getattr(error, "code", None)
    if code:
        return code in _DISK_ERRNOS
    return str(error).endswith(tuple(os.strerror(n) for n in _DISK_ERRNOS))


class Recovery:
    """Recovery from failed commits (a part of :class:`~storage.lmdb_store.LmdbStore`;
    see the module docstring)."""

    def _init_recovery(self) -> None:
        self._degraded = False
        self._next_disk_recovery = 0.0  # monotonic time of the next evict-and-retry

    @property
    def degraded(self) -> bool:
        """Whether commits are failing (a full or failing disk): writes are being dropped
        until one succeeds. ``stats().write_errors`` counts the failed commits."""
        with self._lock:
            return self._degraded

    def _writes_resumed_locked(self) -> None:
        if self._degraded:
            self._degraded = False
            self._next_disk_recovery = 0.0
            logger.info("%s: commits succeed again; the store is no longer degraded", self.path)

    # ------------------------------------------------------------------ full disk, I/O errors

    def _recover_write_error(
        self, part: list[Pending], batch_keys: set[bytes], error: lmdb.Error, gone: list[bytes]
    ) -> bool:
        """A commit of ``part`` failed with ``error`` (not a full map); True if recovery
        committed it after all. On False the caller drops it."""
        with self._lock:
            self._stats.write_errors += 1
            retry = is_disk_error(error) and time.monotonic() >= self._next_disk_recovery
        if retry and self._evict_and_retry(part, batch_keys, error, gone):
            return True
        with self._lock:
            first = not self._degraded
            self._degraded = True
            if retry:
                self._next_disk_recovery = time.monotonic() + DEGRADED_RETRY_S
        if first:
            logger.warning(
                "%s: cannot commit (%s)%s; the store is degraded: writes are dropped "
                "(stats().dropped, flush() returns False) until a commit succeeds",
                self.path, error, " even after evicting" if retry else "",
            )
        return False

    def _evict_and_retry(
        self, part: list[Pending], batch_keys: set[bytes], error: lmdb.Error, gone: list[bytes]
    ) -> bool:
        with self._lock:
            need = max(sum(len(s.data) for s in part if s.op is Op.PUT), self._used // 10)
            victims, sizes = self._pick_victims_locked(need, batch_keys)
        if victims:
            try:
                self._write_txn(victims, {})
            except lmdb.Error:
                with self._lock:
                    gone.extend(self._restore_locked(victims, sizes))
                return False
            logger.info(
                "%s: %s; evicted %d records (%d bytes) and retrying",
                self.path, error, len(victims), sum(sizes.values()),
            )
            with self._lock:
                self._stats.evictions += len(victims)
            gone.extend(s.key for s in victims)
            self._wrote(victims)
            with contextlib.suppress(lmdb.Error):
                self._write_txn([], {})  # freed pages are reusable two commits later
        try:
            self._write_txn(part, {})
        except lmdb.Error:
            return False
        self._wrote(part)
        return True

    def _restore_locked(self, victims: list[Pending], sizes: dict[bytes, int]) -> list[bytes]:
        """Undo evictions whose commit failed: the records are still on disk, so they go
        back to the front of the eviction order. Returns keys evicted to stay within budget."""
        for s in reversed(victims):
            entry = self._pending.get(s.key)
            if entry is None or entry.seq != s.seq:
                continue  # changed since: the newer operation stands
            del self._pending[s.key]
            self._index.set(s.key, sizes[s.key], s.priority, s.parent)
            self._index.move_to_end(s.key, last=False)
            self._used += sizes[s.key]
        self._progress.notify_all()
        return self._evict_to_budget_locked()

    def _pick_victims_locked(
        self, need: int, batch_keys: set[bytes]
    ) -> tuple[list[Pending], dict[bytes, int]]:
        """Keys on disk outside the batch worth ``need`` bytes, the first to evict
        (:meth:`~storage.lmdb_eviction.ChainLru.scan`), taken out of the index and queued
        for deletion; their snapshots and sizes. A key with an operation still pending is
        not on disk yet: deleting it frees nothing, and a failed deletion would put it back
        in the index as if its put had been written."""
        victims: list[Pending] = []
        sizes: dict[bytes, int] = {}
        freed = 0
        for kb in self._index.scan():
            if freed >= need:
                break
            if kb in batch_keys or kb in self._pending:
                continue
            # kept in case the deletion is undone
            priority, parent = self._index.priority(kb), self._index.parent_hash(kb)
            sizes[kb] = self._index.pop(kb)
            freed += sizes[kb]
            self._touched.pop(kb, None)
            entry = self._enqueue_locked(kb, Op.DELETE, None, priority=priority, parent=parent)
            victims.append(self._take_locked(entry))
        self._used -= freed
        return victims, sizes

    # ------------------------------------------------------------------ full map

    def _recover_map_full(
        self, part: list[Pending], batch_keys: set[bytes], error: lmdb.Error, gone: list[bytes]
    ) -> list[list[Pending]]:
        """What to commit next after ``part`` did not fit the map (last in, first out)."""
        retry = self._make_room(part, batch_keys, error, gone)
        if retry is not None:
            return retry
        if not any(s.op is Op.PUT for s in part):
            logger.error("%s: cannot commit even deletions (%s)", self.path, error)
            self._abandon(part, gone)
            return []
        return self._shrink(part, gone)

    def _make_room(
        self, part: list[Pending], batch_keys: set[bytes], error: lmdb.Error, gone: list[bytes]
    ) -> list[list[Pending]] | None:
        """Evict committed records in their own commit so ``part`` can be retried; None
        when there is nothing left to evict."""
        self._reclaim_readers()
        need = sum(len(s.data) for s in part if s.op is Op.PUT)
        need = max(need, min(self.capacity_bytes, self.map_size) // 10)
        with self._lock:
            victims, sizes = self._pick_victims_locked(need, batch_keys)
            self._stats.evictions += len(victims)
        if not victims:
            return None
        logger.warning(
            "%s: %s; evicting %d records (%d bytes) and retrying",
            self.path, type(error).__name__, len(victims), sum(sizes.values()),
        )
        gone.extend(s.key for s in victims)
        try:
            self._write_txn(victims, {})
        except lmdb.Error:
            return [victims, part]  # retry the deletions first (they give up if hopeless)
        self._wrote(victims)
        with contextlib.suppress(lmdb.Error):
            self._write_txn([], {})  # the retry fails again and makes more room
        return [part]

    def _shrink(self, part: list[Pending], gone: list[bytes]) -> list[list[Pending]]:
        """Nothing left to evict: split a batch, or drop its one record that cannot fit."""
        if len(part) > 1:
            half = len(part) // 2
            return [part[:half], part[half:]]
        (s,) = part
        with self._lock:
            entry = self._pending.get(s.key)
            self._stats.dropped += 1
            if entry is None or entry.seq != s.seq:
                self._finish_locked([s])
                return []
            logger.warning(
                "%s: no room for %s even when empty; dropped", self.path, short_key(s.key)
            )
            self._lost += 1
            self._pending_bytes -= len(entry.data)
            entry.op, entry.data = Op.DELETE, None
            size = self._index.pop(s.key, None)
            if size is not None:
                self._used -= size
                gone.append(s.key)
            # The record replaced may still be committed: delete it instead (``s`` is the
            # entry, changed above).
            return [[s]]
