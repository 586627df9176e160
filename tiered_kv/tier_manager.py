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
pinned against eviction, until every lower tier it goes to has it. When every slot holds
an unwritten block, a save waits (its GPU block stays held) for up to ``SAVE_WAIT_S`` and
is then dropped, counted and logged (rate-limited, naming the setting to raise).

Lookups go CPU → disk → remote: the run of blocks the CPU pool and the disk hold is
extended by the remote tier with one pipelined round-trip for the rest of the chain.

Keys. A block's key is ``BlockKey(namespace, block_hash)`` with the engine's chained hash
(which covers the request's ``cache_salt``). The namespace is the engine's, so another
model, KV dtype or block size never hits; with a lossy codec it is a digest of the
engine's namespace and the codec, so lossy records never serve a lossless configuration
(and the reverse). See ``docs/tiers.md``.
"""
from __future__ import annotations

import atexit
import collections
import concurrent.futures
import dataclasses
import hashlib
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from engine.connector import FinishedTransfers, KVConnector, SavedBlock
from engine.llm import LLM
from storage.base import BlockKey, BlockStore, StoreStats
from storage.codecs import get_codec
from storage.cpu_pool import CpuBlockPool
from storage.lmdb_store import LmdbStore
from storage.remote_store import RemoteStore
from storage.seal import SealKey, load_key_file
from tiered_kv.block_loader import BlockLoader, LoadResult, WantedBlock
from tiered_kv.block_mover import BlockMover, Copy
from tiered_kv.config import TierConfig
from tiered_kv.metrics import QueueStats, TierMetrics
from tiered_kv.pool_writer import PoolWriter

logger = logging.getLogger(__name__)

LOAD_WORKERS = 2  # requests loaded at once
LOOKUP_WORKERS = 2  # remote lookups in flight at once
SAVE_WAIT_S = 5.0  # how long a save may wait for a pool slot before it is dropped
DROP_WARNING_INTERVAL_S = 60.0
STORE_PENDING_BYTES = 128 << 20  # LMDB puts accepted but not yet committed (two batches)
_LOSSY_NAMESPACE = b"tiered-kv/lossy-codec"
# The engine thread gives up the GIL at every device sync and lock wait; while the tier
# threads run Python it can then wait a whole switch interval (CPython's default: 5 ms) to
# get it back, several times a step. A manager lowers the process's interval to this.
SWITCH_INTERVAL_S = 0.0005


@dataclasses.dataclass(frozen=True)
class _Lookup:
    """A request's hash chain as of its last lookup, and where each block was found."""

    hashes: tuple[bytes, ...]
    first: int  # index of the first block the lookup was asked about
    tiers: tuple[str, ...]  # tier of hashes[first + i], for the matched run

    def wanted(
        self, namespace: bytes, block_hashes: Sequence[bytes], block_ids: Sequence[int]
    ) -> list[WantedBlock] | None:
        """The blocks to load with their parents (``None`` for the chain's first block), or
        ``None`` if the run is not part of this lookup's matched chain."""
        start = self.first
        if self.hashes[start : start + 1] != (block_hashes[0],):
            try:
                start = self.hashes.index(block_hashes[0])
            except ValueError:
                return None
        if self.hashes[start : start + len(block_hashes)] != tuple(block_hashes):
            return None
        offset = start - self.first
        if offset < 0 or offset + len(block_hashes) > len(self.tiers):
            return None
        parents = [self.hashes[start - 1] if start else None, *block_hashes[:-1]]
        return [
            WantedBlock(BlockKey(namespace, h), b, p, self.tiers[offset + i])
            for i, (h, b, p) in enumerate(zip(block_hashes, block_ids, parents))
        ]


@dataclasses.dataclass
class _Save:
    """One save_blocks batch: its copy, and what to commit to the pool once it is done."""

    copy: Copy
    commits: list[tuple[BlockKey, int, SavedBlock]]  # (key, slot, block)
    block_ids: list[int]  # every block id of the batch (reported saved together)
    started: float


class _DropWarning:
    """One WARNING line per interval for blocks dropped because the pool was full."""

    def __init__(self) -> None:
        self._count = 0
        self._last = -DROP_WARNING_INTERVAL_S

    def add(self, blocks: int, setting: str) -> None:
        self._count += blocks
        now = time.monotonic()
        if now - self._last >= DROP_WARNING_INTERVAL_S:
            logger.warning(
                "dropped %d KV blocks: the CPU pool was full of blocks not yet written to the "
                "lower tiers; raise %s (or use a faster disk or codec)", self._count, setting,
            )
            self._count, self._last = 0, now


def remote_seal_key(config: TierConfig) -> SealKey:
    """The key of the deployment's shared secret, which seals the remote tier's records.

    ``ValueError`` (one line, naming the setting, never the secret) if it is missing, given
    twice, unreadable or too short.
    """
    if config.remote_secret_file is not None and config.remote_secret is not None:
        raise ValueError(
            "the remote tier's secret is given twice (--kv-secret-file and TIERED_KV_SECRET); "
            "give one"
        )
    if config.remote_secret_file is not None:
        return load_key_file(config.remote_secret_file)
    if config.remote_secret is not None:
        return SealKey(config.remote_secret.encode("utf-8"), source="TIERED_KV_SECRET")
    raise ValueError(
        "the remote tier (--kv-remote-url) needs the deployment's shared secret, which seals "
        "its records: give every instance the same one with --kv-secret-file FILE or "
        "TIERED_KV_SECRET (at least 32 bytes, e.g. `openssl rand -hex 32`)"
    )


class TierManager(KVConnector):
    """Implements :class:`engine.connector.KVConnector` with the tiers ``config`` describes.

    Pass it to the engine (``LLM(model, kv_connector=TierManager(config))``, or use
    :func:`build_llm`). The disk store is opened here, so a directory problem (not a store,
    already open for writing by another process) raises :class:`storage.base.StoreError`
    at once, and a missing or unusable remote secret raises ``ValueError`` before anything
    is opened; the CPU pool is reserved when the engine registers its KV cache.
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
        self.metrics = TierMetrics(tiers, self._store_stats, self._queue_stats)
        self._pool: CpuBlockPool | None = None
        self._disk: LmdbStore | None = None
        self._remote: RemoteStore | None = None
        self._writers: list[PoolWriter] = []
        self._final_stats: dict[str, StoreStats] | None = None
        remote_key = remote_seal_key(config) if config.has_remote else None
        if config.has_disk:
            self._disk = LmdbStore(
                config.cache_path, config.disk_bytes, sync=config.sync,
                max_pending_bytes=STORE_PENDING_BYTES,
                replace_damaged=True,  # a damaged file is moved aside: serve, never crash
            )
        if config.has_remote:
            self._remote = RemoteStore(
                config.remote_url,
                seal_key=remote_key,
                prefix=config.remote_prefix,
                timeout_s=config.remote_timeout_s,
                ttl_s=config.remote_ttl_s,
            )
        self._kv_cache: torch.Tensor | None = None  # [num_blocks, L, 2, T, H, D]
        self._mover: BlockMover | None = None
        self._loader: BlockLoader | None = None
        self._load_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._namespace = b""
        self._block_size = 0
        self._block_shape: tuple[int, ...] = ()  # [L, 2, T, H, D]
        self._block_nbytes = 0
        self._lookups: dict[str, _Lookup] = {}
        # request id -> (keys asked of the remote tier, its answer): a repeated lookup of a
        # request the engine could not schedule yet costs no further round-trip.
        # Remote lookups by request: the keys asked about and the lookup's future.
        self._remote_runs: dict[str, tuple[tuple[BlockKey, ...], concurrent.futures.Future]] = {}
        self._lookup_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._loads_in_flight: set[concurrent.futures.Future[LoadResult]] = set()
        self._deferred: collections.deque[tuple[SavedBlock, float]] = collections.deque()
        self._deferred_lock = threading.RLock()  # the engine's saves vs. a flush's retries
        self._saves: queue.SimpleQueue[_Save | None] = queue.SimpleQueue()
        self._saves_in_flight = 0  # copies not yet committed to the pool
        self._save_watcher: threading.Thread | None = None
        self._finished = threading.Condition()
        self._loaded: dict[str, int] = {}
        self._saved: list[int] = []
        self._drops = _DropWarning()
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
        stores: dict[str, BlockStore] = {}
        if self._pool is not None and self.config.has_cpu:
            stores["cpu"] = self._pool
        if self._disk is not None:
            stores["disk"] = self._disk
        if self._remote is not None:
            stores["remote"] = self._remote
        return stores

    def stats(self) -> dict[str, dict[str, int | float]]:
        """Per tier (``cpu``, ``disk``, ``remote``): counters, occupancy and load bandwidth."""
        return self.metrics.snapshot()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every block saved so far is committed to disk (fsynced) and handed to
        the remote server; ``False`` if ``timeout`` seconds passed first."""
        if self._closed:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout

        def remaining() -> float | None:
            return None if deadline is None else max(deadline - time.monotonic(), 0.0)

        while self._deferred or self._saves_in_flight:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            self._retry_deferred()  # the engine may be idle: nobody else retries them
            time.sleep(0.001)  # saves still copying or waiting for a slot
        for writer in self._writers:
            if not writer.drain(remaining()):
                return False
        return self._disk is None or self._disk.flush(remaining())

    def close(self) -> None:
        """Finish the transfers in flight, write what is pending to disk and the remote tier
        within ``flush_timeout_s``, then close the stores. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        deadline = time.monotonic() + self.config.flush_timeout_s
        try:
            if self._lookup_pool is not None:
                self._lookup_pool.shutdown(wait=True)
            if self._load_pool is not None:
                self._load_pool.shutdown(wait=True)
                self._loader.close()
            while self._deferred and time.monotonic() < deadline:
                self._retry_deferred()
                time.sleep(0.01)
            with self._deferred_lock:
                self._drop_deferred(time.monotonic(), force=True)
            if self._save_watcher is not None:
                self._saves.put(None)
                self._save_watcher.join()
            if self._mover is not None:
                self._mover.close()
            for writer in self._writers:
                writer.close(max(deadline - time.monotonic(), 0.0))
        finally:
            self._final_stats = self._store_stats()
            if self._disk is not None:
                self._disk.close()
            if self._remote is not None:
                self._remote.close()
            if self._pool is not None:
                self._pool.close()
            self._kv_cache = self._mover = self._loader = None

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
        self._namespace = self.storage_namespace(namespace, config.codec)
        # A slot holds a block in the codec's tensor stage (a KIVI payload is smaller).
        slot_nbytes = self._codec.stage.payload_size(kv_cache.dtype, self._block_shape)
        pool_bytes = config.cpu_bytes if config.has_cpu else config.staging_bytes
        if pool_bytes < slot_nbytes:
            setting = "cpu_bytes" if config.has_cpu else "staging_bytes"
            raise ValueError(
                f"{setting}={pool_bytes} holds no KV block ({slot_nbytes} bytes each); "
                f"raise it" + (" or set 0 for no CPU tier" if config.has_cpu else "")
            )
        self._pool = CpuBlockPool(
            pool_bytes, block_nbytes=slot_nbytes, keep_clean=config.has_cpu,
            pin_memory=kv_cache.is_cuda,
        )
        self._kv_cache = kv_cache
        self._mover = BlockMover(kv_cache, self._pool.slab, self._codec.stage)
        block = (kv_cache.dtype, self._block_shape)
        stores: dict[str, BlockStore] = {}
        if self._disk is not None:
            stores["disk"] = self._disk
            self._writers.append(PoolWriter(
                self._pool, self._disk, self._codec, self.metrics, "disk",
                write_back=config.write_policy == "write-back", by_priority=True,
                low_watermark=max(1, self._pool.num_slots // 8), block=block,
            ))
        if self._remote is not None:
            stores["remote"] = self._remote
            self._lookup_pool = concurrent.futures.ThreadPoolExecutor(
                LOOKUP_WORKERS, thread_name_prefix="tiered-kv-lookup"
            )
            if config.remote_write_policy == "write-through":
                self._writers.append(
                    PoolWriter(
                        self._pool, self._remote, self._codec, self.metrics, "remote", block=block
                    )
                )
        self._loader = BlockLoader(
            self._pool, self._mover, stores, self.metrics,
            block_shape=self._block_shape, dtype=kv_cache.dtype, promote=self._promote_to,
        )
        self._load_pool = concurrent.futures.ThreadPoolExecutor(
            LOAD_WORKERS, thread_name_prefix="tiered-kv-load"
        )
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        if self._mover.asynchronous:
            self._save_watcher = threading.Thread(
                target=self._watch_saves, name="tiered-kv-save-watcher", daemon=True
            )
            self._save_watcher.start()

    @staticmethod
    def storage_namespace(engine_namespace: bytes, codec: str) -> bytes:
        """The namespace of the tiers' keys: the engine's, or for a lossy codec a digest of
        the engine's and the codec's quantizer (so ``kivi4`` and ``kivi4+zstd`` share)."""
        spec = get_codec(codec)
        if spec.lossless:
            return engine_namespace
        quantizer = spec.name.split("+")[0].encode("ascii")
        return hashlib.sha256(_LOSSY_NAMESPACE + b"\0" + engine_namespace + quantizer).digest()

    def get_num_matched_blocks(
        self, request_id: str, block_hashes: Sequence[bytes], num_computed_blocks: int
    ) -> int | None:
        if self._kv_cache is None or self._closed:
            return 0
        keys = [BlockKey(self._namespace, h) for h in block_hashes[num_computed_blocks:]]
        previous = self._lookups.get(request_id)
        # The engine asks again, step after step, for a request it could not schedule yet.
        repeated = (
            previous is not None
            and previous.hashes == tuple(block_hashes)
            and previous.first == num_computed_blocks
        )
        if not keys:
            return 0
        in_pool = self._pool.contains_many(keys)
        tiers: list[str] = []
        cpu_lookups = disk_lookups = 0
        for key, pool_hit in zip(keys, in_pool):
            cpu_lookups += 1
            if pool_hit:
                tiers.append("cpu")
                continue
            if self._disk is None:
                break
            disk_lookups += 1
            if not self._disk.contains(key):
                break
            tiers.append("disk")
        remote_lookups = 0
        if self._remote is not None and len(tiers) < len(keys):
            rest = tuple(keys[len(tiers):])
            remote_lookups = len(rest)
            run = self._remote_run(request_id, rest)
            if run is None:
                return None  # the engine asks again at a later step
            tiers += ["remote"] * run
        self._lookups[request_id] = _Lookup(tuple(block_hashes), num_computed_blocks, tuple(tiers))
        if not repeated:
            if self.config.has_cpu:
                self.metrics.add("cpu", lookups=cpu_lookups)
            if self._disk is not None:
                self.metrics.add("disk", lookups=disk_lookups)
            if self._remote is not None:
                self.metrics.add("remote", lookups=remote_lookups)
        return len(tiers)

    def _remote_run(self, request_id: str, rest: tuple[BlockKey, ...]) -> int | None:
        """How many leading ``rest`` blocks the remote tier holds; ``None`` while the lookup
        (one pipelined round-trip, gated by the store's breaker) runs on a lookup thread."""
        entry = self._remote_runs.get(request_id)
        if entry is None or entry[0] != rest:
            future = self._lookup_pool.submit(self._remote.longest_prefix, list(rest))
            future.add_done_callback(self._lookup_done)
            self._remote_runs[request_id] = (rest, future)
            return None
        if not entry[1].done():
            return None
        try:
            return entry[1].result()
        except Exception:  # the store turns its errors into misses; anything else is a bug
            logger.exception("remote lookup for %s failed", request_id)
            return 0

    def _lookup_done(self, future: concurrent.futures.Future[int]) -> None:
        with self._finished:  # ends a poll(timeout) of an engine with nothing else to run
            self._finished.notify_all()

    def start_load(
        self, request_id: str, block_hashes: Sequence[bytes], block_ids: Sequence[int]
    ) -> None:
        lookup = self._lookups.get(request_id)
        wanted = None
        if self._loader is not None and not self._closed and len(block_hashes) == len(block_ids):
            if not block_hashes:
                wanted = []
            elif lookup is not None:
                wanted = lookup.wanted(self._namespace, block_hashes, block_ids)
        if not wanted:
            if wanted is None:  # cannot check the records' chain: recompute instead
                self.metrics.add(self._first_lower_tier(), load_failures=1)
            self._report(loaded={request_id: 0})
            return
        future = self._load_pool.submit(self._loader.run, request_id, wanted)
        self._loads_in_flight.add(future)
        future.add_done_callback(self._load_done)

    def save_blocks(self, blocks: Sequence[SavedBlock]) -> None:
        with self._deferred_lock:
            self._save_blocks(blocks)

    def _save_blocks(self, blocks: Sequence[SavedBlock]) -> None:
        if self._kv_cache is None or self._closed:
            self._report(saved=[b.block_id for b in blocks])
            return
        if self.config.offload == "prompt":
            skipped = [b.block_id for b in blocks if not b.is_prompt]
            if skipped:
                self._report(saved=skipped)
            blocks = [b for b in blocks if b.is_prompt]
        if blocks:
            self._offload(list(blocks), time.monotonic())

    def poll(self, timeout: float = 0.0) -> FinishedTransfers:
        if self._deferred:
            self._retry_deferred()
        with self._finished:
            if timeout > 0 and not self._loaded and not self._saved:
                self._finished.wait(timeout)
            loaded, self._loaded = self._loaded, {}
            saved, self._saved = self._saved, []
        return FinishedTransfers(loaded, saved)

    def on_blocks_evicted(self, block_hashes: Sequence[bytes]) -> None:
        """Nothing to do: a block is copied down when it becomes full, not when evicted."""

    def request_finished(self, request_id: str) -> None:
        self._lookups.pop(request_id, None)
        self._remote_runs.pop(request_id, None)

    # ------------------------------------------------------------------ saves

    def _offload(self, blocks: list[SavedBlock], started: float) -> None:
        """Reserve a slot for each block and start one batched copy; blocks that find no
        slot wait in ``_deferred`` (their GPU blocks stay held)."""
        commits: list[tuple[BlockKey, int, SavedBlock]] = []
        done: list[int] = []
        for i, block in enumerate(blocks):
            key = BlockKey(self._namespace, block.block_hash)
            if self._pool.contains(key):
                done.append(block.block_id)  # already below (e.g. it was loaded from there)
                continue
            slot = self._pool.reserve(self.config.tenant_priority(block.cache_salt))
            if slot is None:
                self._deferred.extend((b, started) for b in blocks[i:])
                self._drop_deferred(time.monotonic())
                break
            commits.append((key, slot, block))
        if done:
            self._report(saved=done)
        if not commits:
            return
        copy = self._mover.offload([(block.block_id, slot) for _, slot, block in commits])
        save = _Save(copy, commits, [block.block_id for _, _, block in commits], time.perf_counter())
        if self._save_watcher is None:
            self._commit_save(save)  # a host memcpy: complete already
        else:
            with self._finished:
                self._saves_in_flight += 1
            self._saves.put(save)

    def _retry_deferred(self) -> None:
        """Offload the saves that found no slot, as far as slots are free now (from the
        engine's poll, or from a flush while the engine is idle)."""
        with self._deferred_lock:
            self._drop_deferred(time.monotonic())
            if not self._deferred or self._pool.num_evictable() == 0:
                return
            blocks, started = [b for b, _ in self._deferred], self._deferred[0][1]
            self._deferred.clear()
            self._offload(blocks, started)

    def _drop_deferred(self, now: float, *, force: bool = False) -> None:
        dropped: list[int] = []
        while self._deferred and (force or now - self._deferred[0][1] >= SAVE_WAIT_S):
            dropped.append(self._deferred.popleft()[0].block_id)
        if dropped:
            tier = "cpu" if self.config.has_cpu else self._first_lower_tier()
            self.metrics.add(tier, dropped=len(dropped))
            self._pool.count_dropped(len(dropped))
            self._drops.add(
                len(dropped), "--kv-offloading-size" if self.config.has_cpu else "staging_bytes"
            )
            self._report(saved=dropped)

    def _watch_saves(self) -> None:
        """Asynchronous copies (CUDA, or a transcoding host copy): commit each save once its
        copy is complete (the copies run in order)."""
        while (save := self._saves.get()) is not None:
            try:
                save.copy.wait()
            except Exception:  # the copy failed: its slots hold nothing to keep
                logger.exception("offload of %d blocks failed; dropping them", len(save.commits))
                for _, slot, _ in save.commits:
                    self._pool.unreserve(slot)
                self.metrics.add("cpu" if self.config.has_cpu else self._first_lower_tier(),
                                 dropped=len(save.commits))
                self._report(saved=save.block_ids)
            else:
                self._commit_save(save)
            with self._finished:
                self._saves_in_flight -= 1

    def _commit_save(self, save: _Save) -> None:
        pending = self._pending_tiers()
        stored = 0
        for key, slot, block in save.commits:
            tiers = pending
            if "disk" in tiers and self._disk.contains(key):
                tiers = tuple(t for t in tiers if t != "disk")
            if self._pool.commit(
                key, slot, self._mover.slot_dtype, self._mover.slot_shape, block.parent_hash,
                block.token_ids, tiers, priority=self.config.tenant_priority(block.cache_salt),
            ):
                stored += 1
        if self.config.has_cpu:
            self.metrics.observe_store(
                "cpu", time.perf_counter() - save.started, stored, stored * self._block_nbytes
            )
        self._report(saved=save.block_ids)

    def _pending_tiers(self) -> tuple[str, ...]:
        """The lower tiers a newly saved block still has to reach."""
        return tuple(writer.tier for writer in self._writers)

    def _promote_to(self, tier: str) -> tuple[str, ...]:
        """The lower tiers a block loaded from ``tier`` still has to reach: a remote hit is
        written to disk with write-through."""
        if tier == "remote" and self._disk is not None and self.config.write_policy == "write-through":
            return ("disk",)
        return ()

    # ------------------------------------------------------------------ loads

    def _load_done(self, future: concurrent.futures.Future[LoadResult]) -> None:
        """On the worker thread: account the load and report it to the engine."""
        self._loads_in_flight.discard(future)
        result = future.result()
        for tier, blocks in result.by_tier.items():
            if tier == "cpu" and not self.config.has_cpu:  # the staging buffer's blocks
                tier = self._first_lower_tier()
            self.metrics.observe_load(
                tier, result.seconds, blocks, self._block_size, blocks * self._block_nbytes
            )
        self._report(loaded={result.request_id: result.loaded})

    def _report(self, *, loaded: dict[str, int] | None = None, saved: list[int] | None = None) -> None:
        with self._finished:
            if loaded:
                self._loaded.update(loaded)
            if saved:
                self._saved.extend(saved)
            self._finished.notify_all()

    def _first_lower_tier(self) -> str:
        return "disk" if self._disk is not None else ("remote" if self._remote else "cpu")

    # ------------------------------------------------------------------ stats

    def _store_stats(self) -> dict[str, StoreStats]:
        if self._final_stats is not None:
            return self._final_stats
        stats: dict[str, StoreStats] = {}
        if self.config.has_cpu:
            stats["cpu"] = (
                self._pool.stats()
                if self._pool is not None
                else StoreStats(tier="cpu", capacity_bytes=self.config.cpu_bytes)
            )
        if self._disk is not None:
            stats["disk"] = self._disk.stats()
        if self._remote is not None:
            stats["remote"] = self._remote.stats()
        return stats

    def _queue_stats(self) -> QueueStats | None:
        """Blocks in the pool still to be written to disk."""
        if self._pool is None or self._disk is None:
            return None
        blocks = self._pool.num_pending("disk")
        return QueueStats(blocks, blocks * self._block_nbytes)


def build_llm(
    model: str | os.PathLike[str] = "tiny",
    tier_config: TierConfig | None = None,
    **engine_config: Any,
) -> LLM:
    """An :class:`engine.LLM` whose KV connector is a new :class:`TierManager`.

    The manager is ``llm.engine.connector``; closing the LLM closes it (and flushes it).
    """
    manager = TierManager(tier_config)
    try:
        return LLM(model, kv_connector=manager, **engine_config)
    except BaseException:
        manager.close()
        raise
