"""The tier manager: the engine's KV connector, backed by the CPU pool, the disk tier and
the shared remote tier.

Two halves, as in vLLM's connector. The scheduler side (the connector methods, on the
engine thread) decides and holds no bytes: lookups are index checks, and a load or a
save only starts a transfer. The worker side moves the bytes::

    save_blocks ─ reserve slots ─▶ BlockMover.offload (one DMA per run of blocks, side
         │                          stream, after the compute stream's event)
         └─ copied ─▶ CPU pool commit (pending: disk, remote) ─▶ PoolWriter threads ─▶ stores
    start_load ─▶ BlockLoader (worker threads): pool slot, or store get ─▶ verify ─▶ decode
                  into a slot (promoted) ─▶ BlockMover.restore ─▶ copied ─▶ poll: loaded

The CPU pool is one pinned slab and the only write-behind buffer: a block stays in it,
pinned against eviction, until every lower tier it goes to has it. Saves leave a few slots
to loads (``block_loader.JOB_SLOTS`` per load worker, at most one slot in
``cpu_eviction.LOAD_SHARE``), so that disk and remote hits are still served while the
writers lag. When every other slot holds an unwritten block, a save waits (its GPU block
stays held) for up to ``block_saver.SAVE_WAIT_S``, or until the engine runs short of
blocks (``release_held``), and is then dropped, counted and logged (rate-limited, naming
the setting to raise). The save side is :class:`tiered_kv.block_saver.BlockSaver`.

Lookups go CPU → disk → remote: the run of blocks the CPU pool and the disk hold is
extended by the remote tier with one pipelined round-trip for the rest of the chain, on a
lookup thread (:class:`tiered_kv.tier_lookup.TierLookup`).

The stores and the pool, and the namespace of the tiers' keys, are
:mod:`tiered_kv.tier_stores`'s. This module builds the worker side on them, delegates the
connector methods to the lookup and save sides, runs the loads, and reports finished
transfers to ``poll``; it also flushes, closes and counts.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import functools
import logging
import sys
import threading
import time
from collections.abc import Sequence

import torch
from prometheus_client import CollectorRegistry

from engine.connector import FinishedTransfers, KVConnector, SavedBlock
from storage.base import BlockStore
from storage.codecs import get_codec
from tiered_kv.block_loader import JOB_SLOTS, BlockLoader, LoadResult
from tiered_kv.block_mover import BlockMover
from tiered_kv.block_saver import BlockSaver
from tiered_kv.config import TierConfig
from tiered_kv.load_clock import LoadClock
from tiered_kv.metrics import QueueStats, TierMetrics
from tiered_kv.pool_writer import PoolWriter
from tiered_kv.tier_lookup import TierLookup
from tiered_kv.tier_stores import TierStores, storage_namespace

logger = logging.getLogger(__name__)

LOAD_WORKERS = 2  # requests loaded at once
# The engine thread gives up the GIL at every device sync and lock wait; while the tier
# threads run Python it can then wait a whole switch interval (CPython's default: 5 ms) to
# get it back, several times a step. A manager lowers the process's interval to this.
SWITCH_INTERVAL_S = 0.0005


class TierManager(KVConnector):
    """Implements :class:`engine.connector.KVConnector` with the tiers ``config`` describes.

    Pass it to the engine (``LLM(model, kv_connector=TierManager(config))``, or use
    :func:`tiered_kv.build_llm`). The disk store is opened here, so a directory problem (not
    a store, already open for writing by another process) raises
    :class:`storage.base.StoreError` at once, and a missing or unusable remote secret raises
    ``ValueError`` before anything is opened; the CPU pool is reserved when the engine
    registers its KV cache.
    One manager serves one engine.
    """

    def __init__(self, config: TierConfig | None = None) -> None:
        self.config = config = config or TierConfig()
        self._codec = get_codec(config.codec)
        tiers = tuple(
            tier for tier, present in (
                ("cpu", config.has_cpu), ("disk", config.has_disk), ("remote", config.has_remote)
            ) if present
        )
        self._stores = TierStores(config)
        self.metrics = TierMetrics(tiers, self._stores.stats, self._queue_stats)
        self._writers: list[PoolWriter] = []
        self._kv_cache: torch.Tensor | None = None  # [num_blocks, L, 2, T, H, D]
        self._mover: BlockMover | None = None
        self._loader: BlockLoader | None = None
        self._load_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._namespace = b""
        self._block_size = 0
        self._block_shape: tuple[int, ...] = ()  # [L, 2, T, H, D]
        self._block_nbytes = 0
        self._lookup: TierLookup | None = None  # set by register_kv_cache, as the saver
        self._load_clock: LoadClock | None = None
        self._saver: BlockSaver | None = None
        self._dropped_at_flush = 0  # blocks the tiers had dropped at the last flush
        self._loads_in_flight: set[concurrent.futures.Future[LoadResult]] = set()
        self._finished = threading.Condition()  # guards _loaded and _saved; poll waits on it
        self._loaded: dict[str, int] = {}
        self._saved: list[int] = []
        self._close_lock = threading.Lock()
        self._closed = False
        atexit.register(self.close)

    # ------------------------------------------------------------------ public

    @property
    def registry(self) -> CollectorRegistry:
        """The Prometheus registry holding this manager's metrics (serve it on /metrics)."""
        return self.metrics.registry

    @property
    def namespace(self) -> bytes:
        """The namespace the tiers' keys use (set by :meth:`register_kv_cache`)."""
        return self._namespace

    def degraded_tiers(self) -> list[str]:
        """Tiers whose store can no longer write what it is given (a full or failing disk)."""
        return [tier for tier, store in self.stores().items() if getattr(store, "degraded", False)]

    def stores(self) -> dict[str, BlockStore]:
        """The open stores by tier (``cpu`` once the engine registered its cache and when
        the pool is a tier, ``disk``, ``remote``), for admin views; they must not be used
        after :meth:`close`."""
        return self._stores.by_tier()

    def stats(self) -> dict[str, dict[str, int | float]]:
        """Per tier (``cpu``, ``disk``, ``remote``): counters, occupancy and load bandwidth."""
        return self.metrics.snapshot()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every block saved so far is committed to disk (fsynced) and handed to
        the remote server; ``False`` if ``timeout`` seconds passed first, or if a tier
        dropped blocks since the previous flush (counted in its ``dropped``), so True means
        every block saved since then reached every tier that takes it."""
        if self._closed:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout

        def remaining() -> float | None:
            return None if deadline is None else max(deadline - time.monotonic(), 0.0)

        with self._writing_back():  # a save may wait for a slot only writing back frees
            while self._saver is not None and self._saver.busy():
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                self._saver.retry_deferred()  # the engine may be idle: nobody else retries them
                time.sleep(0.001)  # saves still copying or waiting for a slot
        for writer in self._writers:
            if not writer.drain(remaining()):
                return False
        disk = self._stores.disk
        if disk is not None and not disk.flush(remaining()):
            return False
        dropped = self._num_dropped()
        lost, self._dropped_at_flush = dropped - self._dropped_at_flush, dropped
        return lost == 0

    def _writing_back(self) -> contextlib.ExitStack:
        """Make the write-back writers write all they hold, until the exit."""
        stack = contextlib.ExitStack()
        for writer in self._writers:
            stack.enter_context(writer.draining())
        return stack

    def _num_dropped(self) -> int:
        return sum(int(tier.get("dropped", 0)) for tier in self.metrics.snapshot().values())

    def close(self) -> None:
        """Finish the transfers in flight, write what is pending to disk and the remote tier
        within ``flush_timeout_s``, then close the stores. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._saver is not None:
            self._saver.stop_accepting()
        atexit.unregister(self.close)
        deadline = time.monotonic() + self.config.flush_timeout_s
        try:
            if self._lookup is not None:
                self._lookup.close()
            if self._load_pool is not None:
                self._load_pool.shutdown(wait=True)
                self._loader.close()
            if self._saver is not None:
                with self._writing_back():
                    self._saver.close(deadline)
            if self._mover is not None:
                self._mover.close()
            for writer in self._writers:
                writer.close(max(deadline - time.monotonic(), 0.0))
        finally:
            self._stores.close()
            self._kv_cache = self._mover = self._loader = self._saver = None

    # ------------------------------------------------------------------ connector

    def register_kv_cache(self, kv_cache: torch.Tensor, namespace: bytes, block_size: int) -> None:
        if self._kv_cache is not None:
            raise RuntimeError("a TierManager serves one engine; create one per engine")
        if self._closed:
            raise RuntimeError("the TierManager is closed")
        _, num_layers, two, tokens, heads, head_dim = kv_cache.shape
        if two != 2 or tokens != block_size:
            raise ValueError(
                f"unexpected KV cache shape {list(kv_cache.shape)} for block size {block_size}"
            )
        config = self.config
        self._block_size = block_size
        self._block_shape = (num_layers, 2, block_size, heads, head_dim)
        self._block_nbytes = kv_cache[0].numel() * kv_cache.element_size()
        self._load_clock = LoadClock(self._block_nbytes)
        self._namespace = storage_namespace(namespace, config.codec)
        # A slot holds a block in the codec's tensor stage (a KIVI payload is smaller).
        slot_nbytes = self._codec.stage.payload_size(kv_cache.dtype, self._block_shape)
        disk, remote = self._stores.disk, self._stores.remote
        written_below = disk is not None or (
            remote is not None and config.remote_write_policy == "write-through")
        # where blocks can be pending, saves leave the load workers their slots
        pool = self._stores.reserve_pool(
            slot_nbytes, pin_memory=kv_cache.is_cuda, pass_through=written_below,
            load_reserve=LOAD_WORKERS * JOB_SLOTS if written_below else 0)
        self._kv_cache = kv_cache
        self._mover = BlockMover(kv_cache, pool.slab, self._codec.stage)
        block = (kv_cache.dtype, self._block_shape)
        stores: dict[str, BlockStore] = {}
        if disk is not None:
            stores["disk"] = disk
            self._writers.append(PoolWriter(
                pool, disk, self._codec, self.metrics, "disk",
                write_back=config.write_policy == "write-back", by_priority=True,
                low_watermark=max(1, pool.num_slots // 8), block=block,
            ))
        if remote is not None:
            stores["remote"] = remote
            if config.remote_write_policy == "write-through":
                self._writers.append(
                    PoolWriter(pool, remote, self._codec, self.metrics, "remote", block=block)
                )
        self._lookup = TierLookup(
            self._namespace, pool, disk, remote, self.metrics,
            count_cpu=config.has_cpu, on_answer=self._report,
        )
        self._loader = BlockLoader(
            pool, self._mover, stores, self.metrics,
            block_shape=self._block_shape, dtype=kv_cache.dtype, promote=self._promote_to,
            pool_tier="cpu" if config.has_cpu else None,
        )
        self._load_pool = concurrent.futures.ThreadPoolExecutor(
            LOAD_WORKERS, thread_name_prefix="tiered-kv-load"
        )
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._saver = BlockSaver(
            config, self._namespace, pool, self._mover, disk, self.metrics,
            pending_tiers=tuple(writer.tier for writer in self._writers),
            drop_tier="cpu" if config.has_cpu else self._stores.first_lower_tier(),
            block_nbytes=self._block_nbytes,
            on_saved=lambda block_ids: self._report(saved=block_ids),
        )

    def get_num_matched_blocks(
        self, request_id: str, block_hashes: Sequence[bytes], num_computed_blocks: int
    ) -> int | None:
        if self._kv_cache is None or self._closed:
            return 0
        return self._lookup.num_matched(request_id, block_hashes, num_computed_blocks)

    def estimate_load_seconds(self, request_id: str, num_blocks: int) -> float | None:
        if self._lookup is None or self._closed:
            return None
        tiers = self._lookup.matched_tiers(request_id)[:num_blocks]
        return self._load_clock.estimate(tiers) if len(tiers) == num_blocks else None

    def start_load(
        self,
        request_id: str,
        block_hashes: Sequence[bytes],
        block_ids: Sequence[int],
        cache_salt: str | None = None,
    ) -> None:
        wanted = None
        if self._loader is not None and not self._closed and len(block_hashes) == len(block_ids):
            priority = self.config.tenant_priority(cache_salt)
            wanted = self._lookup.wanted(request_id, block_hashes, block_ids, priority)
        if not wanted:
            if wanted is None:  # cannot check the records' chain: recompute instead
                self.metrics.add(self._stores.first_lower_tier(), load_failures=1)
            self._report(loaded={request_id: 0})
            return
        # on the engine thread: the blocks may still be written by a forward queued before now
        after = self._mover.fence()
        future = self._load_pool.submit(
            self._loader.run, request_id, wanted, self._load_finished, after
        )
        self._loads_in_flight.add(future)
        future.add_done_callback(functools.partial(self._load_done, request_id))

    def save_blocks(self, blocks: Sequence[SavedBlock]) -> None:
        """Takes every block and never raises: a step that fails part way drops the blocks
        not yet taken, reported once like the others
        (:meth:`~tiered_kv.block_saver.BlockSaver.save`)."""
        saver = self._saver  # close() on another thread may clear it
        if saver is None or self._closed:  # no KV cache registered, or closing
            self._report(saved=[b.block_id for b in blocks])
            return
        saver.save(blocks)

    def poll(self, timeout: float = 0.0) -> FinishedTransfers:
        if self._saver is not None:
            self._saver.retry_deferred()
        with self._finished:
            if timeout > 0 and not self._loaded and not self._saved:
                self._finished.wait(timeout)
            loaded, self._loaded = self._loaded, {}
            saved, self._saved = self._saved, []
        return FinishedTransfers(loaded, saved)

    def release_held(self) -> None:
        if self._saver is not None:
            self._saver.release_deferred()

    def on_blocks_evicted(self, block_hashes: Sequence[bytes]) -> None:
        """Nothing to do: a block is copied down when it becomes full, not when evicted."""

    def request_finished(self, request_id: str) -> None:
        if self._lookup is not None:
            self._lookup.forget(request_id)

    # ------------------------------------------------------------------ loads

    def _promote_to(self, tier: str) -> tuple[str, ...]:
        """The lower tiers a block loaded from ``tier`` still has to reach: a remote hit is
        written to disk with write-through."""
        if (
            tier == "remote" and self._stores.disk is not None
            and self.config.write_policy == "write-through"
        ):
            return ("disk",)
        return ()

    def _load_finished(self, result: LoadResult) -> None:
        """On the worker thread, once a load's copies are complete: account the load and
        report it to the engine (the job lets go of its slots after this)."""
        try:
            for tier, blocks in result.by_tier.items():
                if tier == "cpu" and not self.config.has_cpu:  # the staging buffer's blocks
                    tier = self._stores.first_lower_tier()
                self.metrics.observe_load(
                    tier, result.seconds, blocks, self._block_size, blocks * self._block_nbytes
                )
            if result.by_tier:
                self._load_clock.observe(
                    max(result.by_tier, key=result.by_tier.get), result.seconds, result.loaded
                )
        finally:  # the request must not wait forever
            self._report(loaded={result.request_id: result.loaded})

    def _load_done(self, request_id: str, future: concurrent.futures.Future[LoadResult]) -> None:
        self._loads_in_flight.discard(future)
        if future.exception() is not None:
            logger.error("load job of %s failed", request_id, exc_info=future.exception())

    def _report(self, *, loaded: dict[str, int] | None = None, saved: list[int] | None = None) -> None:
        """Hand finished transfers to the next ``poll`` (and wake one that waits)."""
        with self._finished:
            if loaded:
                self._loaded.update(loaded)
            if saved:
                self._saved.extend(saved)
            self._finished.notify_all()

    # ------------------------------------------------------------------ stats

    def _queue_stats(self) -> QueueStats | None:
        """Blocks in the pool still to be written to disk."""
        pool = self._stores.pool
        if pool is None or self._stores.disk is None:
            return None
        blocks = pool.num_pending("disk")
        return QueueStats(blocks, blocks * self._block_nbytes)
