"""The disk writer: a bounded queue of host copies of KV blocks and one thread that encodes
them into records and hands them to the disk store.

The engine thread only ever calls :meth:`DiskWriter.offer`, which never blocks: a block
that does not fit the queue's bounds is refused and the caller counts a dropped store.
A queued block stays findable (:meth:`DiskWriter.get`) until the store has accepted it;
from then on the store's read-your-writes makes it findable there. So between the two, a
block offered to the disk tier is never invisible.

::

    offer ─▶ [ queue: key → item ] ─ writer thread ─▶ encode_block ─▶ LmdbStore.put_many
               findable via get()                      (codec)         (commits later,
               until put_many returns                                  on its own thread)

The remote tier uses a second writer of the same kind (``tier="remote"``) in front of the
:class:`storage.remote_store.RemoteStore`, so its network round-trips happen on that
writer's thread, never on the engine's.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import NamedTuple

import torch

from storage.base import BlockKey, BlockStore, StoreError
from storage.codecs import Codec, encode_block
from storage.record import Record
from tiered_kv.metrics import QueueStats, TierMetrics

logger = logging.getLogger(__name__)

BATCH_BLOCKS = 32
BATCH_BYTES = 64 << 20


class WriteItem(NamedTuple):
    """A block waiting for the disk. ``kv`` (``[L, 2, T, H, D]``, host) belongs to the queue."""

    key: BlockKey
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    kv: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class DiskWriter:
    """Encodes queued blocks with ``codec`` and puts them into ``store`` on its own thread;
    ``tier`` names the store in metrics and logs (``disk`` or ``remote``).

    Thread-safe. The queue holds at most ``max_blocks`` blocks and ``max_bytes`` bytes
    (counting blocks being encoded). The writer's only lock guards the queue and is never
    held while encoding or storing.
    """

    def __init__(
        self,
        store: BlockStore[Record],
        codec: Codec,
        metrics: TierMetrics,
        *,
        max_bytes: int,
        max_blocks: int,
        tier: str = "disk",
    ) -> None:
        self._store = store
        self._tier = tier
        self._codec = codec
        self._metrics = metrics
        self._max_bytes = max_bytes
        self._max_blocks = max_blocks
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._items: dict[BlockKey, WriteItem] = {}  # queued or being written
        self._queue: collections.deque[WriteItem] = collections.deque()
        self._bytes = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"tiered-kv-{tier}-writer", daemon=True)
        self._thread.start()

    def has_room(self, nbytes: int) -> bool:
        with self._lock:
            return self._fits_locked(nbytes)

    def offer(self, item: WriteItem, *, wait_until: float | None = None) -> bool:
        """Queue ``item``; ``False`` if the queue is full (or stopping).

        ``wait_until`` (a ``time.monotonic()`` deadline) waits for room instead of refusing
        at once; only for shutdown, never on the engine's path.
        """
        nbytes = item.nbytes
        with self._lock:
            if item.key in self._items:
                return True
            while not self._fits_locked(nbytes):
                remaining = None if wait_until is None else wait_until - time.monotonic()
                if self._stopping or remaining is None or remaining <= 0:
                    return False
                self._changed.wait(remaining)
            if self._stopping:
                return False
            self._items[item.key] = item
            self._queue.append(item)
            self._bytes += nbytes
            self._changed.notify_all()
            return True

    def get(self, key: BlockKey) -> WriteItem | None:
        with self._lock:
            return self._items.get(key)

    def contains(self, key: BlockKey) -> bool:
        with self._lock:
            return key in self._items

    def stats(self) -> QueueStats:
        with self._lock:
            return QueueStats(len(self._items), self._bytes)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued block has been handed to the store; ``False`` on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._items:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._changed.wait(remaining)
        return True

    def close(self, timeout: float) -> int:
        """Write what is queued for up to ``timeout`` seconds, then stop; returns how many
        queued blocks were dropped. Blocks the thread is storing are always finished."""
        self.drain(timeout)
        with self._lock:
            self._stopping = True
            dropped = list(self._queue)
            self._queue.clear()
            for item in dropped:
                del self._items[item.key]
                self._bytes -= item.nbytes
            self._changed.notify_all()
        self._thread.join()
        if dropped:
            self._metrics.add(self._tier, dropped=len(dropped))
            logger.warning(
                "shutdown: %d blocks queued for %s were not written", len(dropped), self._tier
            )
        return len(dropped)

    def _fits_locked(self, nbytes: int) -> bool:
        return len(self._items) < self._max_blocks and self._bytes + nbytes <= self._max_bytes

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._stopping:
                    self._changed.wait()
                if not self._queue:
                    return
                batch: list[WriteItem] = []
                nbytes = 0
                while self._queue and len(batch) < BATCH_BLOCKS and nbytes < BATCH_BYTES:
                    item = self._queue.popleft()
                    batch.append(item)
                    nbytes += item.nbytes
            try:
                self._write(batch)
            except Exception:  # never let one bad batch stop the writer
                logger.exception("%s writer: dropping a batch of %d blocks", self._tier, len(batch))
                self._metrics.add(self._tier, dropped=len(batch))
            with self._lock:
                for item in batch:
                    del self._items[item.key]
                    self._bytes -= item.nbytes
                self._changed.notify_all()

    def _write(self, batch: list[WriteItem]) -> None:
        start = time.perf_counter()
        records: list[Record] = []
        for item in batch:
            try:
                records.append(
                    encode_block(item.key, item.parent_hash, item.token_ids, item.kv, self._codec)
                )
            except ValueError as e:
                logger.error("%s writer: cannot encode %s: %s", self._tier, item.key.short(), e)
                self._metrics.add(self._tier, dropped=1)
        if not records:
            return
        try:
            accepted = self._store.put_many([(r.key, r) for r in records])
        except StoreError as e:  # the store was closed under us
            logger.error("%s writer: %s", self._tier, e)
            self._metrics.add(self._tier, dropped=len(records))
            return
        stored = [r for r, ok in zip(records, accepted) if ok]  # refusals: counted by the store
        self._metrics.observe_store(
            self._tier, time.perf_counter() - start, len(stored), sum(r.nbytes for r in stored)
        )
