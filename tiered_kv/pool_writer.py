"""Write-behind: one thread per lower tier drains the CPU pool's pending blocks into it.

The CPU pool is the only buffer between the engine and the disk or remote tier. A block
is committed to the pool with the tiers it still has to reach; until a writer reports it
done, the pool neither evicts nor reuses its slot. So nothing waits in a second queue, a
block is findable (in the pool) from its offload until it is in the store, and a block is
dropped only when the pool is full of blocks not yet written, but for the slots it keeps
for loads (:mod:`storage.cpu_eviction`).

::

    CpuBlockPool ─ take_pending_columns ─▶ pack (codec) ─▶ store.put_many ─▶ done_pending
    (slots pinned while pending)        (zstd: the batch   (LMDB commits on its own thread;
                                         in PACK_THREADS    Valkey/Redis: one pipeline)
                                         runs)

A slot holds its block in the form of the codec's tensor stage (raw bytes, or a KIVI
payload quantized on the engine's device; see :mod:`tiered_kv.block_mover`), so a writer
only applies the byte stage (zstd, or nothing) and seals the record. Without a byte stage
the record's payload is its slot's row of the slab (the stores encode a record inside
``put_many``, while the writer still holds the slot); with one, a pack thread packs its run
of blocks at once (``Codec.pack_many``). The pool hands the writer a batch as columns, and
the batch goes to ``put_many`` as one :class:`~storage.record_batch.RecordBatch`, from
whose columns the disk tier seals the whole batch without a
:class:`~storage.record.Record` a block: these threads share the GIL with the engine's, so
what they run a block is Python the engine may wait for (``benchmarks/writer_cost.py``
counts it).

With ``write_back`` the writer leaves blocks pending until the pool runs short of slots a
save could take (``num_savable``, fewer than ``low_watermark``: the slots kept for loads
are no room for saves), or refuses a reservation (a newcomer of a tenant that matters less
may evict only blocks of its own kind, which may all be pending), then writes the oldest;
:meth:`PoolWriter.drain` writes everything.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator

import torch

from storage.base import BlockKey, BlockStore, StoreError
from storage.codecs import Codec
from storage.cpu_pool import CpuBlockPool
from storage.cpu_slots import TakenBlocks
from storage.record import Record
from storage.record_batch import PayloadRows, RecordBatch
from tiered_kv.drop_warning import DropWarning
from tiered_kv.metrics import TierMetrics

logger = logging.getLogger(__name__)

BATCH_BLOCKS = 32
# Threads that apply a byte stage (zstd, which releases the GIL) to a batch's blocks side
# by side: one writer thread alone compresses well below what a GPU offloads.
PACK_THREADS = min(8, max(2, (os.cpu_count() or 1) // 2))
IDLE_WAIT_S = 0.05  # how often a write-back writer looks at the pool's free slots


_REFUSAL_HINTS = {
    "disk": "raise --kv-disk-size",
    "remote": "check that the Valkey/Redis server is up and reachable (errors above say), "
              "and give it more memory (maxmemory) if it is full",
}


class PoolWriter:
    """Writes ``pool``'s blocks pending for ``tier`` (``disk`` or ``remote``) into ``store``,
    encoded with ``codec``, on its own thread."""

    def __init__(
        self,
        pool: CpuBlockPool,
        store: BlockStore[Record],
        codec: Codec,
        metrics: TierMetrics,
        tier: str,
        *,
        write_back: bool = False,
        low_watermark: int = 0,
        by_priority: bool = False,
        block: tuple[torch.dtype, tuple[int, ...]],
    ) -> None:
        self._pool = pool
        self._dtype, self._shape = block  # the engine's KV blocks (slots hold codec.stage's form)
        self._store = store
        self._codec = codec
        self._metrics = metrics
        self.tier = tier
        self._write_back = write_back
        self._low_watermark = low_watermark
        self._by_priority = by_priority  # the store evicts by the blocks' tenant priority
        # [num_slots, slot bytes]: a slot's stage payload is its row, no torch call a block
        self._slots = pool.slab.numpy()
        self._draining = threading.Event()  # write-back: write everything now
        self._refused_seen = 0  # write-back: the pool's refused reservations, as last seen
        self._closing = False
        self._stopping = threading.Event()
        self._refusals = DropWarning(
            logger, f"the {tier} tier did not take %d KV blocks (it is full of blocks that "
            "matter more, a block is larger than it takes, or the server refused them or did "
            "not answer); %s",
        )
        self._packers: concurrent.futures.ThreadPoolExecutor | None = None
        if codec.stage is not codec:
            self._packers = concurrent.futures.ThreadPoolExecutor(
                PACK_THREADS, thread_name_prefix=f"tiered-kv-{tier}-pack"
            )
        self._thread = threading.Thread(target=self._run, name=f"tiered-kv-{tier}-writer", daemon=True)
        self._thread.start()

    def num_pending(self) -> int:
        return self._pool.num_pending(self.tier)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every pending block has been handed to the store; ``False`` on timeout.
        A write-back writer writes all it holds meanwhile."""
        with self.draining():
            return self._pool.wait_pending(self.tier, timeout)

    @contextlib.contextmanager
    def draining(self) -> Iterator[None]:
        """A write-back writer writes all it holds, not only under pressure, until the exit."""
        self._draining.set()
        try:
            yield
        finally:
            if not self._closing:
                self._draining.clear()

    def close(self, timeout: float) -> int:
        """Write what is pending for up to ``timeout`` seconds, then stop; returns how many
        pending blocks were dropped. A batch being written is always finished."""
        self._closing = True
        self._draining.set()
        self._pool.wait_pending(self.tier, timeout)
        self._stopping.set()
        self._thread.join()
        if self._packers is not None:
            self._packers.shutdown(wait=True)
        self._refusals.close()
        dropped = self._pool.drop_pending(self.tier)
        if dropped:
            self._metrics.add(self.tier, dropped=dropped)
            logger.warning(
                "shutdown: %d blocks pending for the %s tier were not written", dropped, self.tier
            )
        return dropped

    def _run(self) -> None:
        while not self._stopping.is_set():
            if self._write_back and not self._draining.is_set():
                refused = self._pool.refused()
                roomy = self._pool.num_savable() >= self._low_watermark
                if roomy and refused == self._refused_seen:
                    self._stopping.wait(IDLE_WAIT_S)
                    continue
                self._refused_seen = refused
            taken = self._pool.take_pending_columns(self.tier, BATCH_BLOCKS, timeout=IDLE_WAIT_S)
            if not taken.keys:
                continue
            try:
                self._write(taken)
            except Exception:  # never let one bad batch stop the writer
                logger.exception("%s writer: dropping a batch of %d blocks", self.tier, len(taken.keys))
                self._metrics.add(self.tier, dropped=len(taken.keys))
            finally:
                self._pool.done_pending(self.tier, taken.keys)

    def _write(self, taken: TakenBlocks) -> None:
        start = time.perf_counter()
        if self._packers is None:  # no byte stage: a block's payload is its slot's row
            payloads: PayloadRows | list[bytes | memoryview] = PayloadRows(self._slots, taken.slots)
        else:  # a run of blocks a pack thread (a task costs Python)
            blocks = list(zip(taken.keys, taken.slots))
            run = -(-len(blocks) // PACK_THREADS)
            runs = [blocks[i : i + run] for i in range(0, len(blocks), run)]
            packed = [p for part in self._packers.map(self._pack_run, runs) for p in part]
            kept = [i for i, p in enumerate(packed) if p is not None]
            if not kept:
                return
            if len(kept) < len(packed):
                taken = TakenBlocks(*([column[i] for i in kept] for column in taken))
            payloads = [packed[i] for i in kept]
        records = RecordBatch(
            self._codec.name, self._dtype, self._shape, taken.keys, taken.parent_hashes,
            taken.token_ids, payloads,
        )
        try:
            if self._by_priority:
                accepted = self._store.put_many(records, priorities=taken.priorities)
            else:
                accepted = self._store.put_many(records)
        except StoreError as e:  # the store was closed under us
            logger.error("%s writer: %s", self.tier, e)
            self._metrics.add(self.tier, dropped=len(records))
            return
        stored = [i for i, ok in enumerate(accepted) if ok]  # refusals: counted by the store
        if len(stored) < len(records):
            self._refusals.add(len(records) - len(stored), _REFUSAL_HINTS.get(self.tier, ""))
        self._metrics.observe_store(
            self.tier, time.perf_counter() - start, len(stored), records.nbytes_of(stored)
        )

    def _pack_run(self, blocks: list[tuple[BlockKey, int]]) -> list[bytes | memoryview | None]:
        """The payloads of a run of blocks, packed at once (one by one if the codec refuses
        the run: to count the block it refuses)."""
        slots = [slot for _, slot in blocks]
        first = slots[0]
        if slots == list(range(first, first + len(slots))):
            staged = self._slots[first : first + len(slots)]
        else:
            staged = self._slots[slots]
        try:
            return self._codec.pack_many(staged, self._dtype, self._shape)
        except ValueError:
            return [self._pack(key, slot) for key, slot in blocks]

    def _pack(self, key: BlockKey, slot: int) -> bytes | memoryview | None:
        """The payload of block ``key``: its slot's stage payload, packed (``None``,
        counted as dropped, if the codec refuses it)."""
        try:
            return self._codec.pack(self._slots[slot], self._dtype, self._shape)
        except ValueError as e:
            logger.error("%s writer: cannot encode %s: %s", self.tier, key.short(), e)
            self._metrics.add(self.tier, dropped=1)
            return None
