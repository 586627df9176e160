"""The stores a tier manager's :class:`~tiered_kv.config.TierConfig` names, and the
namespace of their keys.

:class:`TierStores` opens the disk tier (LMDB) and the remote tier with the manager, and
reserves the CPU pool when the engine registers its KV cache: the CPU tier, or with
``cpu_bytes=0`` only the staging buffer of the lower tiers. It lists them by tier, reads
their stats and closes them; the stats read at the close are kept for later scrapes.

Keys. A block's key is ``BlockKey(namespace, block_hash)`` with the engine's chained hash
(which covers the request's ``cache_salt``). The namespace is the engine's, so another
model, KV dtype or block size never hits; with a lossy codec it is a digest of the
engine's namespace and the codec, so lossy records never serve a lossless configuration
(and the reverse). See ``docs/tiers.md``.
"""
from __future__ import annotations

import hashlib

from storage.base import BlockStore, StoreStats
from storage.codecs import get_codec
from storage.cpu_pool import CpuBlockPool
from storage.lmdb_store import LmdbStore
from storage.remote_store import RemoteStore
from tiered_kv.config import TierConfig, remote_seal_key

STORE_PENDING_BYTES = 128 << 20  # LMDB puts accepted but not yet committed (two batches)
_LOSSY_NAMESPACE = b"tiered-kv/lossy-codec"


def storage_namespace(engine_namespace: bytes, codec: str) -> bytes:
    """The namespace of the tiers' keys: the engine's, or for a lossy codec a digest of
    the engine's and the codec's quantizer (so ``kivi4`` and ``kivi4+zstd`` share)."""
    spec = get_codec(codec)
    if spec.lossless:
        return engine_namespace
    quantizer = spec.name.split("+")[0].encode("ascii")
    return hashlib.sha256(_LOSSY_NAMESPACE + b"\0" + engine_namespace + quantizer).digest()


class TierStores:
    """The CPU pool (``None`` until :meth:`reserve_pool`), the disk and the remote store
    (``None`` where ``config`` has no such tier)."""

    def __init__(self, config: TierConfig) -> None:
        self.config = config
        self.pool: CpuBlockPool | None = None
        self.disk: LmdbStore | None = None
        self.remote: RemoteStore | None = None
        self._final_stats: dict[str, StoreStats] | None = None
        remote_key = remote_seal_key(config) if config.has_remote else None
        if config.has_disk:
            self.disk = LmdbStore(
                config.cache_path, config.disk_bytes, sync=config.sync,
                max_pending_bytes=STORE_PENDING_BYTES,
                replace_damaged=True,  # a damaged file is moved aside: serve, never crash
            )
        if config.has_remote:
            self.remote = RemoteStore(
                config.remote_url,
                seal_key=remote_key,
                prefix=config.remote_prefix,
                timeout_s=config.remote_timeout_s,
                ttl_s=config.remote_ttl_s,
            )

    def reserve_pool(
        self, slot_nbytes: int, pin_memory: bool, pass_through: bool = False, load_reserve: int = 0
    ) -> CpuBlockPool:
        """Reserve the CPU pool in slots of ``slot_nbytes`` (``pass_through``: saves have a
        lower tier to go to; ``load_reserve``: slots saves leave to loads; see
        :class:`CpuBlockPool`); a size that holds no slot, or more than the host can pin,
        raises ``ValueError`` naming the setting to change."""
        config = self.config
        pool_bytes = config.cpu_bytes if config.has_cpu else config.staging_bytes
        setting = "cpu_bytes" if config.has_cpu else "staging_bytes"
        if pool_bytes < slot_nbytes:
            raise ValueError(
                f"{setting}={pool_bytes} holds no KV block ({slot_nbytes} bytes each); "
                f"raise it" + (" or set 0 for no CPU tier" if config.has_cpu else "")
            )
        try:
            self.pool = CpuBlockPool(
                pool_bytes, block_nbytes=slot_nbytes, keep_clean=config.has_cpu,
                pass_through=pass_through, load_reserve=load_reserve,
                pin_memory=pin_memory,
            )
        except ValueError as e:  # more than the host can pin
            raise ValueError(f"{setting}={pool_bytes}: {e}; lower it") from None
        return self.pool

    def by_tier(self) -> dict[str, BlockStore]:
        """The open stores by tier; the pool is ``cpu`` only when it is a tier."""
        stores: dict[str, BlockStore] = {}
        if self.pool is not None and self.config.has_cpu:
            stores["cpu"] = self.pool
        if self.disk is not None:
            stores["disk"] = self.disk
        if self.remote is not None:
            stores["remote"] = self.remote
        return stores

    def first_lower_tier(self) -> str:
        """The highest tier below the CPU pool (``cpu`` when there is none)."""
        return "disk" if self.disk is not None else ("remote" if self.remote else "cpu")

    def stats(self) -> dict[str, StoreStats]:
        """Each tier's :class:`~storage.base.StoreStats` (the CPU tier's capacity before the
        pool is reserved); after :meth:`close`, those read at the close."""
        if self._final_stats is not None:
            return self._final_stats
        stats: dict[str, StoreStats] = {}
        if self.config.has_cpu:
            stats["cpu"] = (
                self.pool.stats()
                if self.pool is not None
                else StoreStats(tier="cpu", capacity_bytes=self.config.cpu_bytes)
            )
        if self.disk is not None:
            stats["disk"] = self.disk.stats()
        if self.remote is not None:
            stats["remote"] = self.remote.stats()
        return stats

    def close(self) -> None:
        """Keep the stats, then close the stores (what is pending must be written first)."""
        self._final_stats = self.stats()
        if self.disk is not None:
            self.disk.close()
        if self.remote is not None:
            self.remote.close()
        if self.pool is not None:
            self.pool.close()
