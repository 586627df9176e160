"""The tier manager: the engine's KV connector, backed by the CPU pool, the disk tier and
the shared remote tier.

::

    save_blocks ─▶ CPU pool ───── write-back: on eviction ─────┐
         │                                                     ▼
         ├─ write-through, or no CPU pool: host copy ─▶ disk queue ─▶ writer ─▶ LmdbStore
         └─ remote write-through: the same host copy ─▶ remote queue ─▶ writer ─▶ RemoteStore
    load_blocks ◀─ CPU pool (read_into)
                ◀─ disk queue, or LmdbStore (get, verify, decode) ─▶ promote to CPU pool
                ◀─ remote queue, or RemoteStore (get, verify, decode) ─▶ promote to CPU pool
                                                      (and queue for disk if write-through)

Lookups go CPU → disk → remote: the run of blocks the CPU pool and the disk hold is
extended by the remote tier with one pipelined round-trip for the rest of the chain.

Threads. The engine calls every connector method from its one thread. The manager adds a
writer thread per lower tier (:mod:`tiered_kv.disk_writer`), and the LMDB store runs its
own committer. The engine thread never waits for a write: stores it cannot queue are
dropped and counted. Loads run on the engine thread; a remote lookup or load is bounded by
``remote_timeout_s``, and skipped altogether while the remote store's breaker is open.

Keys. A block's key is ``BlockKey(namespace, block_hash)`` with the engine's chained hash
(which covers the request's ``cache_salt``). The namespace is the engine's, so another
model, KV dtype or block size never hits; with a lossy codec it is a digest of the
engine's namespace and the codec, so lossy records never serve a lossless configuration
(and the reverse). See ``docs/tiers.md``.
"""
from __future__ import annotations

import atexit
import dataclasses
import hashlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from prometheus_client import CollectorRegistry

from engine.connector import KVConnector, SavedBlock
from engine.hashing import block_hash as chain_hash
from engine.llm import LLM
from storage.base import BlockKey, BlockStore, StoreStats
from storage.codecs import CodecError, decode_block, get_codec
from storage.cpu_pool import CpuBlockPool, HostBlock
from storage.lmdb_store import LmdbStore
from storage.record import Record
from storage.remote_store import RemoteStore
from tiered_kv.config import TierConfig
from tiered_kv.disk_writer import DiskWriter, WriteItem
from tiered_kv.metrics import QueueStats, TierMetrics

logger = logging.getLogger(__name__)

# Blocks per LMDB read transaction while loading. Small: each block's buffer is copied into
# the engine while it is still in cache and freed before the next read, so the allocator
# hands the same memory back instead of faulting in fresh pages (measured with 512 KiB
# blocks: 2 per read ~8.5 GB/s, 32 per read ~2.5 GB/s).
DISK_READ_CHUNK = 2
# Blocks per remote round-trip while loading: enough to hide the network latency.
REMOTE_READ_CHUNK = 16
_LOSSY_NAMESPACE = b"tiered-kv/lossy-codec"


@dataclasses.dataclass(frozen=True)
class _Lookup:
    """A request's hash chain as of its last lookup: gives the parent of each loaded block."""

    hashes: tuple[bytes, ...]
    first: int  # index of the first block the lookup was asked about

    def parents(self, block_hashes: Sequence[bytes]) -> list[bytes | None] | None:
        """The parent hash of each of ``block_hashes`` (a run of this chain; ``None`` for
        the chain's first block), or ``None`` if the run is not part of this chain."""
        start = self.first
        if self.hashes[start : start + 1] != (block_hashes[0],):
            try:
                start = self.hashes.index(block_hashes[0])
            except ValueError:
                return None
        if self.hashes[start : start + len(block_hashes)] != tuple(block_hashes):
            return None
        return [self.hashes[start - 1] if start else None, *block_hashes[:-1]]


class _BadRecord(Exception):
    """A record that must not be served (decode error, wrong shape, broken hash chain)."""


class TierManager(KVConnector):
    """Implements :class:`engine.connector.KVConnector` with the tiers ``config`` describes.

    Pass it to the engine (``LLM(model, kv_connector=TierManager(config))``, or use
    :func:`build_llm`). The disk store is opened here, so a directory problem (not a store,
    already open for writing by another process) raises :class:`storage.base.StoreError`
    at once; the CPU pool is reserved when the engine registers its KV cache.
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
        self._cpu: CpuBlockPool | None = None
        self._disk: LmdbStore | None = None
        self._writer: DiskWriter | None = None
        self._remote: RemoteStore | None = None
        self._remote_writer: DiskWriter | None = None
        self._final_stats: dict[str, StoreStats] | None = None
        if config.has_disk:
            self._disk = LmdbStore(
                config.cache_path,
                config.disk_bytes,
                sync=config.sync,
                max_pending_bytes=config.max_queue_bytes,
            )
            self._writer = DiskWriter(
                self._disk,
                self._codec,
                self.metrics,
                max_bytes=config.max_queue_bytes,
                max_blocks=config.max_queue_blocks,
            )
        if config.has_remote:
            self._remote = RemoteStore(
                config.remote_url,
                prefix=config.remote_prefix,
                timeout_s=config.remote_timeout_s,
                ttl_s=config.remote_ttl_s,
            )
            if config.remote_write_policy == "write-through":
                self._remote_writer = DiskWriter(
                    self._remote,
                    self._codec,
                    self.metrics,
                    max_bytes=config.max_queue_bytes,
                    max_blocks=config.max_queue_blocks,
                    tier="remote",
                )
        self._kv_cache: torch.Tensor | None = None  # [L, 2, num_blocks, T, H, D]
        self._namespace = b""
        self._block_size = 0
        self._block_shape: tuple[int, ...] = ()  # [L, 2, T, H, D]
        self._block_nbytes = 0
        self._lookups: dict[str, _Lookup] = {}
        # request id -> (keys asked of the remote tier, its answer): a repeated lookup of a
        # request the engine could not schedule yet costs no further round-trip.
        self._remote_runs: dict[str, tuple[tuple[BlockKey, ...], int]] = {}
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

    def stores(self) -> dict[str, BlockStore]:
        """The open stores by tier (``cpu`` once the engine registered its cache, ``disk``,
        ``remote``), for admin views; they must not be used after :meth:`close`."""
        stores: dict[str, BlockStore] = {}
        if self._cpu is not None:
            stores["cpu"] = self._cpu
        if self._disk is not None:
            stores["disk"] = self._disk
        if self._remote is not None:
            stores["remote"] = self._remote
        return stores

    def stats(self) -> dict[str, dict[str, int | float]]:
        """Per tier (``cpu``, ``disk``, ``remote``): counters, occupancy and load bandwidth."""
        return self.metrics.snapshot()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every block queued so far is committed to disk (fsynced) and handed to
        the remote server; ``False`` if ``timeout`` seconds passed first."""
        if self._closed:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout

        def remaining() -> float | None:
            return None if deadline is None else max(deadline - time.monotonic(), 0.0)

        if self._remote_writer is not None and not self._remote_writer.drain(remaining()):
            return False
        if self._writer is None:
            return True
        if not self._writer.drain(remaining()):
            return False
        return self._disk.flush(remaining())

    def close(self) -> None:
        """Write what is queued (and, with write-back, what only the CPU pool holds) to disk
        and the remote tier within ``flush_timeout_s``, then close the stores. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        deadline = time.monotonic() + self.config.flush_timeout_s
        try:
            if self._writer is not None:
                if self.config.write_policy == "write-back" and self._cpu is not None:
                    self._write_back_all(deadline)
                self._writer.close(max(deadline - time.monotonic(), 0.0))
            if self._remote_writer is not None:
                self._remote_writer.close(max(deadline - time.monotonic(), 0.0))
        finally:
            self._final_stats = self._store_stats()
            if self._disk is not None:
                self._disk.close()
            if self._remote is not None:
                self._remote.close()
            if self._cpu is not None:
                self._cpu.close()
            self._kv_cache = None

    # ------------------------------------------------------------------ connector

    def register_kv_cache(self, kv_cache: torch.Tensor, namespace: bytes, block_size: int) -> None:
        if self._kv_cache is not None:
            raise RuntimeError("a TierManager serves one engine; create one per engine")
        if self._closed:
            raise RuntimeError("the TierManager is closed")
        num_layers, two, _, tokens, heads, head_dim = kv_cache.shape
        if two != 2 or tokens != block_size:
            raise ValueError(
                f"unexpected KV cache shape {list(kv_cache.shape)} for block size {block_size}"
            )
        self._kv_cache = kv_cache
        self._block_size = block_size
        self._block_shape = (num_layers, 2, block_size, heads, head_dim)
        self._block_nbytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()
        self._namespace = self.storage_namespace(namespace, self.config.codec)
        if self.config.has_cpu:
            if self.config.cpu_bytes < self._block_nbytes:
                raise ValueError(
                    f"cpu_bytes={self.config.cpu_bytes} holds no KV block ({self._block_nbytes} "
                    "bytes each); raise it or set 0 for no CPU tier"
                )
            write_back = self.config.write_policy == "write-back" and self._writer is not None
            self._cpu = CpuBlockPool(
                self.config.cpu_bytes,
                block_nbytes=self._block_nbytes,
                on_evict=self._on_cpu_evict if write_back else None,
            )

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
    ) -> int:
        if self._kv_cache is None or self._closed:
            return 0
        lookup = _Lookup(tuple(block_hashes), num_computed_blocks)
        # The engine asks again, step after step, for a request it could not schedule yet.
        repeated = self._lookups.get(request_id) == lookup
        self._lookups[request_id] = lookup
        keys = [BlockKey(self._namespace, h) for h in block_hashes[num_computed_blocks:]]
        if not keys:
            return 0
        in_cpu = self._cpu.contains_many(keys) if self._cpu is not None else [False] * len(keys)
        matched = cpu_lookups = disk_lookups = 0
        for key, cpu_hit in zip(keys, in_cpu):
            cpu_lookups += 1
            if cpu_hit:
                matched += 1
                continue
            if self._disk is None:
                break
            disk_lookups += 1
            if not (self._writer.contains(key) or self._disk.contains(key)):
                break
            matched += 1
        remote_lookups = 0
        if self._remote is not None and matched < len(keys):
            rest = tuple(keys[matched:])
            remote_lookups = len(rest)
            cached = self._remote_runs.get(request_id)
            if cached is not None and cached[0] == rest:
                run = cached[1]
            else:
                run = self._remote_run(list(rest))
                self._remote_runs[request_id] = (rest, run)
            matched += run
        if not repeated and self._cpu is not None:
            self.metrics.add("cpu", lookups=cpu_lookups)
        if not repeated and self._disk is not None:
            self.metrics.add("disk", lookups=disk_lookups)
        if not repeated and self._remote is not None:
            self.metrics.add("remote", lookups=remote_lookups)
        return matched

    def load_blocks(
        self, request_id: str, block_hashes: Sequence[bytes], block_ids: Sequence[int]
    ) -> bool:
        kv_cache = self._kv_cache
        if kv_cache is None or self._closed or len(block_hashes) != len(block_ids):
            return False
        if not block_hashes:
            return True
        non_blocking = kv_cache.is_cuda  # one synchronize below instead of one per block
        start = time.perf_counter()
        rest: list[tuple[int, BlockKey, int]] = []  # (index, key, block id) not in the CPU pool
        for i, (h, block_id) in enumerate(zip(block_hashes, block_ids)):
            key = BlockKey(self._namespace, h)
            out = kv_cache[:, :, block_id]  # [L, 2, T, H, D]
            if self._cpu is None or not self._cpu.read_into(key, out, non_blocking=non_blocking):
                rest.append((i, key, block_id))
        cpu_blocks = len(block_hashes) - len(rest)
        if non_blocking and cpu_blocks:
            # Before anything else is put into the pool, whose slots these copies read.
            torch.cuda.current_stream(kv_cache.device).synchronize()
        cpu_seconds = time.perf_counter() - start
        if rest and self._disk is None and self._remote is None:
            self.metrics.add("cpu", load_failures=1)  # evicted since the lookup
            return False
        if rest:
            lookup = self._lookups.get(request_id)
            parents = lookup.parents(block_hashes) if lookup is not None else None
            if parents is None:  # cannot check the records' chain: recompute instead
                self.metrics.add("disk" if self._disk is not None else "remote", load_failures=1)
                return False
            wanted = [(key, block_id, parents[i]) for i, key, block_id in rest]
            on_disk = [
                self._disk is not None and (self._writer.contains(k) or self._disk.contains(k))
                for k, _, _ in wanted
            ]
            from_disk = [w for w, d in zip(wanted, on_disk) if d]
            from_remote = [w for w, d in zip(wanted, on_disk) if not d]
            if from_remote and self._remote is None:
                self.metrics.add("disk", load_failures=1)  # evicted since the lookup
                return False
            for tier, blocks in (("disk", from_disk), ("remote", from_remote)):
                if not blocks:
                    continue
                start = time.perf_counter()
                if not self._load_from(tier, blocks):
                    return False
                self.metrics.observe_load(
                    tier, time.perf_counter() - start, len(blocks), self._block_size,
                    len(blocks) * self._block_nbytes,
                )
        if cpu_blocks:
            self.metrics.observe_load(
                "cpu", cpu_seconds, cpu_blocks, self._block_size, cpu_blocks * self._block_nbytes
            )
        return True

    def save_blocks(self, blocks: Sequence[SavedBlock]) -> None:
        kv_cache = self._kv_cache
        if kv_cache is None or self._closed:
            return
        if self.config.offload == "prompt":
            blocks = [b for b in blocks if b.is_prompt]
        if not blocks:
            return
        write_through = self.config.write_policy == "write-through"
        start = time.perf_counter()
        cpu_stored = 0
        for block in blocks:
            key = BlockKey(self._namespace, block.block_hash)
            view = src = kv_cache[:, :, block.block_id]  # [L, 2, T, H, D], the engine's pool
            if write_through and self._writer is not None:
                src = self._queue_for_disk(key, block, src)
            if self._remote_writer is not None:
                src = self._queue_for_remote(key, block, src, is_copy=src is not view)
            if self._cpu is not None and not self._cpu.contains(key):
                if self._cpu.put(key, HostBlock(src, block.parent_hash, block.token_ids)):
                    cpu_stored += 1
        if self._cpu is not None:
            self.metrics.observe_store(
                "cpu", time.perf_counter() - start, cpu_stored, cpu_stored * self._block_nbytes
            )

    def on_blocks_evicted(self, block_hashes: Sequence[bytes]) -> None:
        """Nothing to do: a block is copied down when it becomes full, not when evicted."""

    def request_finished(self, request_id: str) -> None:
        self._lookups.pop(request_id, None)
        self._remote_runs.pop(request_id, None)

    # ------------------------------------------------------------------ internals

    def _queue_for_disk(self, key: BlockKey, block: SavedBlock, src: torch.Tensor) -> torch.Tensor:
        """Queue a host copy of ``src`` for the disk unless the disk has it; returns the
        tensor to copy into the CPU pool from (the host copy when one was made)."""
        if self._writer.contains(key) or self._disk.contains(key):
            return src
        if not self._writer.has_room(self._block_nbytes):
            self.metrics.add("disk", dropped=1)
            return src
        host = _host_copy(src)
        if not self._writer.offer(WriteItem(key, block.parent_hash, tuple(block.token_ids), host)):
            self.metrics.add("disk", dropped=1)
        return host

    def _queue_for_remote(
        self, key: BlockKey, block: SavedBlock, src: torch.Tensor, *, is_copy: bool
    ) -> torch.Tensor:
        """Queue a host copy of ``src`` for the remote tier (``src`` itself when it is the
        disk queue's copy); returns the tensor to copy into the CPU pool from.

        Whether the server has the block is not asked (that would be a round-trip on the
        engine thread): a block already there is written again, which refreshes its LRU.
        """
        if self._remote_writer.contains(key):
            return src
        if not self._remote.available or not self._remote_writer.has_room(self._block_nbytes):
            self.metrics.add("remote", dropped=1)
            return src
        host = src if is_copy else _host_copy(src)
        item = WriteItem(key, block.parent_hash, tuple(block.token_ids), host)
        if not self._remote_writer.offer(item):
            self.metrics.add("remote", dropped=1)
        return host

    def _remote_run(self, keys: list[BlockKey]) -> int:
        """How many leading ``keys`` the remote tier (or its write queue) holds."""
        if not self._remote.available:
            return 0
        queued = [self._remote_writer is not None and self._remote_writer.contains(k) for k in keys]
        n = 0
        while n < len(keys) and queued[n]:
            n += 1
        if n < len(keys):
            n += self._remote.longest_prefix(keys[n:])
        return n

    def _on_cpu_evict(self, key: BlockKey, evicted: HostBlock) -> None:
        """Write-back: a block leaving the CPU pool goes to disk unless it is there already."""
        if self._writer.contains(key) or self._disk.contains(key):
            return
        item = WriteItem(key, evicted.parent_hash, tuple(evicted.token_ids), evicted.kv)
        if not self._writer.offer(item):
            self.metrics.add("disk", dropped=1)

    def _write_back_all(self, deadline: float) -> None:
        """At shutdown, queue every block only the CPU pool holds (oldest first)."""
        for key in self._cpu.keys():
            if self._writer.contains(key) or self._disk.contains(key):
                continue
            held = self._cpu.get(key)
            if held is None:
                continue
            item = WriteItem(key, held.parent_hash, tuple(held.token_ids), held.kv)
            if not self._writer.offer(item, wait_until=deadline):
                self.metrics.add("disk", dropped=1)

    def _load_from(self, tier: str, wanted: list[tuple[BlockKey, int, bytes | None]]) -> bool:
        """Load ``(key, block id, parent hash)`` blocks from ``tier``'s (``disk`` or
        ``remote``) writer queue or store into the engine's blocks and promote them into the
        CPU pool (remote blocks also into the disk queue, with write-through); ``False`` at
        the first block that cannot be served.

        Sequential on purpose: a chunk is copied into the engine while its buffers are still
        in this core's cache (reading ahead on another thread measured slower).
        """
        kv_cache = self._kv_cache
        if tier == "disk":
            writer, store, chunk_size = self._writer, self._disk, DISK_READ_CHUNK
        else:
            writer, store, chunk_size = self._remote_writer, self._remote, REMOTE_READ_CHUNK
        to_disk = (
            tier == "remote" and self._writer is not None
            and self.config.write_policy == "write-through"
        )
        for start in range(0, len(wanted), chunk_size):
            chunk = wanted[start : start + chunk_size]
            queued = [writer.get(key) if writer is not None else None for key, _, _ in chunk]
            to_read = [key for (key, _, _), item in zip(chunk, queued) if item is None]
            records = iter(store.get_many(to_read) if to_read else ())
            for (key, block_id, parent), item in zip(chunk, queued):
                out = kv_cache[:, :, block_id]  # [L, 2, T, H, D]
                if item is not None:
                    out.copy_(item.kv)
                    host, tokens, parent_hash = item.kv, item.token_ids, item.parent_hash
                else:
                    record = next(records)
                    if record is None:  # gone since the lookup, or corrupt (the store counts it)
                        self.metrics.add(tier, load_failures=1)
                        return False
                    try:
                        host = self._decode_into(record, parent, out)
                    except _BadRecord as e:
                        logger.warning("%s tier: not serving %s: %s", tier, key.short(), e)
                        self.metrics.add(tier, corrupt=1, load_failures=1)
                        return False
                    tokens, parent_hash = record.token_ids, record.parent_hash
                    if to_disk and not self._disk.contains(key):
                        copy = _host_copy(out)
                        if not self._writer.offer(WriteItem(key, parent_hash, tuple(tokens), copy)):
                            self.metrics.add("disk", dropped=1)
                if self._cpu is not None and not self._cpu.contains(key):
                    if self._cpu.put(key, HostBlock(host, parent_hash, tokens)):  # promote
                        self.metrics.add("cpu", stored_blocks=1, stored_bytes=self._block_nbytes)
        return True

    def _decode_into(self, record: Record, parent: bytes | None, out: torch.Tensor) -> torch.Tensor:
        """Write the block in ``record`` into ``out`` after checking it belongs there;
        returns a host tensor holding it (``out`` itself when that is in host memory).

        The key was checked by the store. Here: the record's parent is the request's previous
        block, and its token ids hash with that parent to its key (so they are the request's
        tokens); a request's first block has the salted root as its parent, which the
        connector does not know, so for it only ``parent is None`` is checked.
        """
        if record.dtype != out.dtype or tuple(record.shape) != self._block_shape:
            raise _BadRecord(
                f"record holds {record.dtype}{list(record.shape)}, the engine's blocks are "
                f"{out.dtype}{list(self._block_shape)}"
            )
        if len(record.token_ids) != self._block_size:
            raise _BadRecord(
                f"record has {len(record.token_ids)} token ids, blocks hold {self._block_size}"
            )
        if record.parent_hash != parent:
            raise _BadRecord("record's parent is not the request's previous block")
        if parent is not None and chain_hash(parent, record.token_ids) != record.key.block_hash:
            raise _BadRecord("record's token ids do not hash to its key")
        if record.codec == "raw" and out.device.type == "cpu":
            # The raw payload is the block's bytes in memory order: copy it straight into
            # the engine's block instead of decoding into a temporary tensor first.
            dst = out.view(torch.uint8).numpy()  # [L, 2, T, H, D * itemsize], strided
            src = np.frombuffer(record.payload, dtype=np.uint8)
            if src.size != dst.size:
                raise _BadRecord(f"raw payload of {src.size} bytes for a {dst.size}-byte block")
            dst[...] = src.reshape(dst.shape)
            return out
        try:
            kv = decode_block(record)
        except CodecError as e:
            raise _BadRecord(str(e)) from None
        if kv.dtype != out.dtype or tuple(kv.shape) != self._block_shape:
            raise _BadRecord(f"decoded to {kv.dtype}{list(kv.shape)}")
        out.copy_(kv)
        return kv

    def _store_stats(self) -> dict[str, StoreStats]:
        if self._final_stats is not None:
            return self._final_stats
        stats: dict[str, StoreStats] = {}
        if self.config.has_cpu:
            stats["cpu"] = (
                self._cpu.stats()
                if self._cpu is not None
                else StoreStats(tier="cpu", capacity_bytes=self.config.cpu_bytes)
            )
        if self._disk is not None:
            stats["disk"] = self._disk.stats()
        if self._remote is not None:
            stats["remote"] = self._remote.stats()
        return stats

    def _queue_stats(self) -> QueueStats | None:
        return self._writer.stats() if self._writer is not None else None


def _host_copy(kv: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of one block (pinned when it comes from a GPU)."""
    out = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=kv.is_cuda)  # [L, 2, T, H, D]
    out.copy_(kv)
    return out


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
