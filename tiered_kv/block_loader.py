"""The worker side of a load: fetch, verify and decode a request's blocks into the CPU pool's
slots, then restore them into the engine's blocks, all off the engine thread.

One job per request, run by a small thread pool. A block the pool holds is restored
from its slot; a block from the disk or remote tier is read in chunks, checked against the
request's hash chain, decoded straight into a reserved slot (promoting it into the pool)
and restored from there. A chunk's restore is issued before the next chunk is read, so
reads and DMA overlap. The job stops at the first block it cannot serve; the blocks
before it count. It reports the load as soon as the copies are complete, and lets go of
the last slots they read only then, while the engine already runs the request.

::

    start_load ─▶ [job] ─ worker ─▶ pool slot? ──────────────────────────▶ restore (DMA) ─┐
                                 └▶ disk / remote get ─▶ verify ─▶ decode into a slot ─┘  │
    poll ◀── loaded[request] = n ◀── copies complete (the worker waits on their event) ◀──┘
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable

import numpy as np
import torch

from engine.hashing import block_hash as chain_hash
from storage.base import BlockKey, BlockStore
from storage.codecs import CodecError, get_codec
from storage.cpu_pool import CpuBlockPool
from storage.priority_lru import DEFAULT_PRIORITY
from storage.record import Record
from tiered_kv.block_mover import BlockMover, Copy
from tiered_kv.metrics import TierMetrics

logger = logging.getLogger(__name__)

# Blocks per store read while loading: enough to batch a remote round-trip or an LMDB
# read transaction, small enough that a chunk's restore overlaps the next chunk's read.
READ_CHUNK = 16
# Reader threads, shared by every load job, and chunks of one request read at once: the
# checksums (BLAKE3) and zstd release the GIL, so a disk hit scales with the cores, up to 8.
READ_THREADS = min(8, max(4, (os.cpu_count() or 1) // 2))
READ_AHEAD = READ_THREADS
# The slots a job holds at most at once when it reads one chunk ahead: that chunk's, and
# those of the two before it, whose restore may still read them (see _load). The CPU pool
# keeps this many per load worker from saves (its load_reserve), so that a hit from a lower
# tier is served while the pool is full of blocks the writers have not written yet.
JOB_SLOTS = 3 * READ_CHUNK


@dataclasses.dataclass
class _Chunk:
    """What one read of a chunk got: pairs to restore and the pool keys held for them."""

    pairs: list[tuple[int, int]]  # (block id, slot), the chunk's leading blocks
    held: list[BlockKey]
    by_tier: dict[str, int]
    short: bool  # a block could not be served: the blocks after it were not read


@dataclasses.dataclass(frozen=True)
class WantedBlock:
    key: BlockKey
    block_id: int
    parent: bytes | None  # the request's previous block's hash; None for its first block
    tier: str  # where the lookup found it: cpu, disk or remote
    priority: int = DEFAULT_PRIORITY  # its tenant's place in the pool's eviction order


@dataclasses.dataclass
class LoadResult:
    request_id: str
    loaded: int  # leading blocks now in the engine's cache
    by_tier: dict[str, int]
    seconds: float


class BadRecord(Exception):
    """A record that must not be served (decode error, wrong shape, broken hash chain)."""


class BlockLoader:
    """Runs load jobs: ``run(request_id, blocks)`` on a worker thread returns a
    :class:`LoadResult` once every copy it issued is complete on the device.

    ``stores``: the disk and remote stores by tier. ``promote(key, tier)``: the tiers a
    block read from ``tier`` should still be written to (e.g. a remote hit goes to disk).
    """

    def __init__(
        self,
        pool: CpuBlockPool,
        mover: BlockMover,
        stores: dict[str, BlockStore[Record]],
        metrics: TierMetrics,
        *,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        promote: Callable[[str], tuple[str, ...]],
        pool_tier: str | None = "cpu",
    ) -> None:
        self._pool = pool
        self._pool_tier = pool_tier  # the tier the pool counts as (None: staging only)
        self._block_nbytes = math.prod(block_shape) * dtype.itemsize
        self._mover = mover
        self._stores = stores
        self._metrics = metrics
        self._block_shape = block_shape
        self._dtype = dtype
        self._promote = promote
        self._slots = pool.slab.numpy()  # [num_slots, slot bytes]: a slot's row costs no torch call
        self._readers = concurrent.futures.ThreadPoolExecutor(
            READ_THREADS, thread_name_prefix="tiered-kv-read"
        )

    def run(
        self,
        request_id: str,
        blocks: list[WantedBlock],
        report: Callable[[LoadResult], None] | None = None,
        after: torch.cuda.Event | None = None,
    ) -> LoadResult:
        """Load ``blocks``; once every copy is complete, ``report`` the result (the engine
        may run the request from then on) and only then let go of the last slots read, so
        that bookkeeping is not on the request's path. ``after``: the mover's fence, taken
        when the blocks were handed to the load; no copy into them starts before it."""
        start = time.perf_counter()
        held: list[BlockKey] = []
        try:
            loaded, by_tier = self._load(blocks, held, after)
        except Exception:
            logger.exception("load of %s failed; the engine recomputes", request_id)
            loaded, by_tier = 0, {}
        result = LoadResult(request_id, loaded, by_tier, time.perf_counter() - start)
        try:
            if report is not None:
                report(result)
        finally:
            self._pool.release_many(held)
        return result

    def _load(
        self, blocks: list[WantedBlock], held: list[BlockKey], after: torch.cuda.Event | None
    ) -> tuple[int, dict[str, int]]:
        """Fetch and restore the leading ``blocks`` that can be served; returns (their
        number, by tier) once every copy it issued is complete, the keys of the slots the
        last copies read added to ``held`` for the caller to let go."""
        if all(w.tier == "cpu" for w in blocks):
            # The pool held them all at lookup: no reads to overlap, one chunk, restored
            # here (their slots are taken already, so holding them all costs the pool nothing).
            got = self._fetch(blocks)
            held += got.held
            self._mover.restore(got.pairs, after).wait()
            return len(got.pairs), got.by_tier
        chunks = [blocks[i : i + READ_CHUNK] for i in range(0, len(blocks), READ_CHUNK)]
        # A few chunks are read at once on the reader threads: copies out of the map or the
        # socket, checksums and codecs release the GIL, so reads of one request overlap.
        # Their slots count against the pool, and a chunk that finds no slot ends the load
        # there: a job holds at most a quarter of the slots it could take when it starts, or
        # JOB_SLOTS (one chunk ahead) where that is more, as under write pressure, when the
        # pool leaves loads only its reserve.
        ahead = max(1, min(READ_AHEAD, self._pool.num_evictable() // (4 * READ_CHUNK) - 2))
        reads: collections.deque[concurrent.futures.Future[_Chunk]] = collections.deque()
        # Chunks whose restore may still read their slots: (copy, keys held for it).
        in_flight: list[tuple[Copy, list[BlockKey]]] = []
        by_tier: dict[str, int] = {}
        loaded = 0
        queued = 0
        try:
            while queued < len(chunks) or reads:
                while queued < len(chunks) and len(reads) < ahead:
                    reads.append(self._readers.submit(self._fetch, chunks[queued]))
                    queued += 1
                got = reads.popleft().result()
                try:
                    in_flight.append((self._mover.restore(got.pairs, after), got.held))
                except BaseException:
                    held += got.held
                    raise
                loaded += len(got.pairs)
                for tier, n in got.by_tier.items():
                    by_tier[tier] = by_tier.get(tier, 0) + n
                if got.short:
                    break  # a block could not be served: the rest is recomputed
                if len(in_flight) > 2:  # slots of two restoring chunks at most
                    copy, keys = in_flight[0]
                    copy.wait()  # if it raises, the keys are let go with the others below
                    in_flight.pop(0)
                    self._pool.release_many(keys)
        finally:
            for future in reads:  # read past a failure, or past a short chunk
                with contextlib.suppress(Exception):
                    held += future.result().held
            for _, keys in in_flight:
                held += keys
            for copy, _ in in_flight:  # the slots stay put until the device is done with them
                copy.wait()
        return loaded, by_tier

    def close(self) -> None:
        self._readers.shutdown(wait=True)

    def _fetch(self, chunk: list[WantedBlock]) -> _Chunk:
        """The leading blocks of ``chunk`` now held in the pool, as ``(block id, slot)``
        pairs; stops at the first one that cannot be served."""
        got = _Chunk([], [], {}, short=False)
        try:
            self._fetch_into(chunk, got)
        except BaseException:
            self._pool.release_many(got.held)
            raise
        got.short = len(got.pairs) < len(chunk)
        return got

    def _fetch_into(self, chunk: list[WantedBlock], got: _Chunk) -> None:
        keys = [w.key for w in chunk]
        slots = self._pool.acquire_slots(keys)
        if None not in slots:  # all in the pool: nothing to read
            got.held += keys
            got.pairs += [(w.block_id, s) for w, s in zip(chunk, slots)]
            got.by_tier["cpu"] = got.by_tier.get("cpu", 0) + len(chunk)
            return
        got.held += [w.key for w, s in zip(chunk, slots) if s is not None]
        absent = [w for w, s in zip(chunk, slots) if s is None]
        missing = {tier: [w for w in absent if self._source(w) == tier] for tier in self._stores}
        # The chunk's new slots, taken at once: consecutive slots for consecutive blocks
        # (one copy each way, where readers taking slots one at a time interleave), and the
        # pool's lock once. Those a short chunk does not use go back.
        fresh = collections.deque(self._pool.reserve_many([w.priority for w in absent]))
        try:
            self._read_chunk(chunk, slots, missing, fresh, got)
        finally:
            for slot in fresh:
                self._pool.unreserve(slot)

    def _read_chunk(
        self,
        chunk: list[WantedBlock],
        slots: list[int | None],
        missing: dict[str, list[WantedBlock]],
        fresh: collections.deque[int],
        got: _Chunk,
    ) -> None:
        """Read ``chunk``'s blocks the pool lacks (``missing``, by store) and promote them
        into the ``fresh`` slots, in order; stops at the first that cannot be served."""
        with contextlib.ExitStack() as reads:  # payloads may view a store's memory until exit
            records: dict[BlockKey, Record | None] = {}
            for tier, wanted in missing.items():
                if wanted:
                    found = reads.enter_context(self._stores[tier].reading([w.key for w in wanted]))
                    records.update(zip((w.key for w in wanted), found))
            for i, (want, slot) in enumerate(zip(chunk, slots)):
                tier = "cpu"
                if slot is None:
                    tier = self._source(want) or want.tier
                    record = records.get(want.key)
                    if record is not None and not fresh:
                        logger.warning("CPU pool has no free slot for a %s hit; recomputing", tier)
                    elif record is not None:
                        slot = self._promote_record(want, tier, record, fresh.popleft())
                    if slot is None:
                        self._metrics.add(tier, load_failures=1)
                        # the pool's blocks after it are not needed: let them go
                        rest = {w.key for w, s in zip(chunk[i + 1 :], slots[i + 1 :]) if s is not None}
                        self._pool.release_many(list(rest))
                        got.held[:] = [k for k in got.held if k not in rest]
                        return
                    got.held.append(want.key)
                got.pairs.append((want.block_id, slot))
                got.by_tier[tier] = got.by_tier.get(tier, 0) + 1

    def _source(self, want: WantedBlock) -> str | None:
        """The store to read a block from that is not in the pool (any more)."""
        if want.tier in self._stores:
            return want.tier
        # evicted from the pool since the lookup: the disk may still have it
        return "disk" if "disk" in self._stores else next(iter(self._stores), None)

    def _promote_record(self, want: WantedBlock, tier: str, record: Record, slot: int) -> int | None:
        """Decode ``record`` into ``slot`` (reserved) and commit it there, held; the slot it
        is held in, or ``None`` if the record is bad (``slot`` is given back either way)."""
        out = self._slots[slot]
        try:
            self._decode_into(record, want.parent, out)
        except BadRecord as e:
            self._pool.unreserve(slot)
            logger.warning("%s tier: not serving %s: %s", tier, want.key.short(), e)
            self._metrics.add(tier, corrupt=1)
            return None
        except BaseException:  # not committed: the slot would be neither free nor in use
            self._pool.unreserve(slot)
            raise
        committed = self._pool.commit(
            want.key, slot, self._mover.slot_dtype, self._mover.slot_shape, record.parent_hash,
            record.token_ids, self._promote(tier), hold=True, priority=want.priority,
        )
        if not committed:  # another load promoted the same block meanwhile
            got = self._pool.acquire(want.key)
            return None if got is None else got.slot
        if self._pool_tier is not None:
            self._metrics.add(self._pool_tier, stored_blocks=1, stored_bytes=self._block_nbytes)
        return slot

    def _decode_into(self, record: Record, parent: bytes | None, out: np.ndarray) -> None:
        """Write the block in ``record`` into ``out`` (a host slot's bytes, in the form of the
        mover's stage) after checking that it belongs there.

        The key was checked by the store. Here: the record's parent is the request's previous
        block, and its token ids hash with that parent to its key (so they are the request's
        tokens); a request's first block has the salted root as its parent, which the
        connector does not know, so for it only ``parent is None`` is checked.
        """
        if record.dtype != self._dtype or tuple(record.shape) != self._block_shape:
            raise BadRecord(
                f"record holds {record.dtype}{list(record.shape)}, the engine's blocks are "
                f"{self._dtype}{list(self._block_shape)}"
            )
        if len(record.token_ids) != self._block_shape[2]:
            raise BadRecord(
                f"record has {len(record.token_ids)} token ids, blocks hold {self._block_shape[2]}"
            )
        if record.parent_hash != parent:
            raise BadRecord("record's parent is not the request's previous block")
        if parent is not None and chain_hash(parent, record.token_ids) != record.key.block_hash:
            raise BadRecord("record's token ids do not hash to its key")
        try:
            codec = get_codec(record.codec)
        except ValueError as e:
            raise BadRecord(str(e)) from None
        stage = self._mover.stage
        try:
            if codec.stage.name == stage.name:
                # The slot holds the stage's payload: only the byte stage (zstd) runs here,
                # straight into the slot.
                codec.unpack_into(record.payload, record.dtype, self._block_shape, out)
            else:  # another stage (a store shared with another codec): decode, re-encode
                kv = codec.decode(record.payload, record.dtype, self._block_shape)
                out[:] = stage.encode_array(kv)
        except (CodecError, ValueError) as e:
            raise BadRecord(str(e)) from None
