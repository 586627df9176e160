"""The tier manager's lookup side: how many of a request's next blocks the tiers hold.

The engine asks :meth:`TierLookup.num_matched` on its thread, again step after step for a
request it could not schedule yet. The walk goes CPU → disk → remote and counts the run of
consecutive blocks some tier holds: the CPU pool and the disk are index checks; the rest of
the chain is asked of the remote tier in one pipelined round-trip (gated by the store's
breaker) on a ``tiered-kv-lookup`` thread. Until that answers the lookup is "not yet"
(``None``); the answer wakes an engine waiting in ``poll`` and is kept per request, so a
repeated lookup costs no further round-trip. What a lookup found (each block's tier) is
kept until the request finishes, for :meth:`TierLookup.wanted` when its load starts.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence

from storage.base import BlockKey
from storage.cpu_pool import CpuBlockPool
from storage.priority_lru import DEFAULT_PRIORITY
from storage.lmdb_store import LmdbStore
from storage.remote_store import RemoteStore
from tiered_kv.block_loader import WantedBlock
from tiered_kv.metrics import TierMetrics

logger = logging.getLogger(__name__)

LOOKUP_WORKERS = 2  # remote lookups in flight at once
LOOKUP_CHUNK = 64  # keys asked of the pool at once while walking a request's chain


@dataclasses.dataclass(frozen=True)
class _Lookup:
    """A request's hash chain as of its last lookup, and where each block was found."""

    hashes: tuple[bytes, ...]
    first: int  # index of the first block the lookup was asked about
    tiers: tuple[str, ...]  # tier of hashes[first + i], for the matched run
    # the keys of hashes[first:] made so far: the lookup asked again (the request waits for
    # blocks) reuses them, as making a key costs more than asking the pool about it
    keys: list[BlockKey] = dataclasses.field(default_factory=list)

    def wanted(
        self,
        namespace: bytes,
        block_hashes: Sequence[bytes],
        block_ids: Sequence[int],
        priority: int,
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
            WantedBlock(BlockKey(namespace, h), b, p, self.tiers[offset + i], priority)
            for i, (h, b, p) in enumerate(zip(block_hashes, block_ids, parents))
        ]


class TierLookup:
    """Lookups over the pool, the disk and the remote tier, and what each request matched.

    ``count_cpu``: count the pool's lookups under ``cpu`` (the pool is a tier, not only the
    staging buffer). ``on_answer`` is called on a lookup thread when a remote lookup ends.
    Every method but :meth:`close` runs on the engine thread.
    """

    def __init__(
        self,
        namespace: bytes,
        pool: CpuBlockPool,
        disk: LmdbStore | None,
        remote: RemoteStore | None,
        metrics: TierMetrics,
        *,
        count_cpu: bool,
        on_answer: Callable[[], None],
    ) -> None:
        self._namespace = namespace
        self._pool = pool
        self._disk = disk
        self._remote = remote
        self._metrics = metrics
        self._count_cpu = count_cpu
        self._on_answer = on_answer
        self._lookups: dict[str, _Lookup] = {}
        # Remote lookups by request: the keys asked about and the lookup's future, so a
        # repeated lookup of a request the engine could not schedule yet costs no further
        # round-trip.
        self._remote_runs: dict[str, tuple[tuple[BlockKey, ...], concurrent.futures.Future]] = {}
        self._lookup_pool: concurrent.futures.ThreadPoolExecutor | None = None
        if remote is not None:
            self._lookup_pool = concurrent.futures.ThreadPoolExecutor(
                LOOKUP_WORKERS, thread_name_prefix="tiered-kv-lookup"
            )

    def num_matched(
        self, request_id: str, block_hashes: Sequence[bytes], num_computed_blocks: int
    ) -> int | None:
        """:meth:`engine.connector.KVConnector.get_num_matched_blocks` over the tiers."""
        wanted = block_hashes[num_computed_blocks:]
        previous = self._lookups.get(request_id)
        # The engine asks again, step after step, for a request it could not schedule yet.
        repeated = (
            previous is not None
            and previous.hashes == tuple(block_hashes)
            and previous.first == num_computed_blocks
        )
        if not wanted:
            return 0
        keys = previous.keys if repeated else []
        tiers, cpu_lookups, disk_lookups = self._local_run(wanted, keys)
        remote_lookups = 0
        if self._remote is not None and len(tiers) < len(wanted):
            self._make_keys(keys, wanted, len(wanted))
            rest = tuple(keys[len(tiers):])
            remote_lookups = len(rest)
            run = self._remote_run(request_id, rest)
            if run is None:
                return None  # the engine asks again at a later step
            tiers += ["remote"] * run
        self._lookups[request_id] = _Lookup(
            tuple(block_hashes), num_computed_blocks, tuple(tiers), keys
        )
        if not repeated:
            if self._count_cpu:
                self._metrics.add("cpu", lookups=cpu_lookups)
            if self._disk is not None:
                self._metrics.add("disk", lookups=disk_lookups)
            if self._remote is not None:
                self._metrics.add("remote", lookups=remote_lookups)
        return len(tiers)

    def _local_run(self, hashes: Sequence[bytes], made: list[BlockKey]) -> tuple[list[str], int, int]:
        """The tier (``cpu`` or ``disk``) of each leading block of ``hashes`` the pool or the
        disk holds, and how many blocks each was asked about. ``made``: the keys of the first
        ``hashes`` made already; extended with those made here. The pool is asked
        :data:`LOOKUP_CHUNK` keys at a time, so the first block neither holds ends the walk
        (a cold 32K-token prompt cost ~1 ms a lookup when every key was made and asked)."""
        tiers: list[str] = []
        disk_lookups = 0
        for start in range(0, len(hashes), LOOKUP_CHUNK):
            stop = min(start + LOOKUP_CHUNK, len(hashes))
            self._make_keys(made, hashes, stop)
            keys = made[start:stop]
            in_pool = self._pool.contains_many(keys)
            i = 0
            while i < len(keys):  # a run the pool holds, then a block the disk may hold
                end = in_pool.index(False, i) if False in in_pool[i:] else len(keys)
                tiers += ["cpu"] * (end - i)
                if end == len(keys):
                    break
                disk_lookups += self._disk is not None
                if self._disk is None or not self._disk.contains(keys[end]):
                    return tiers, len(tiers) + 1, disk_lookups
                tiers.append("disk")
                i = end + 1
        return tiers, len(tiers), disk_lookups

    def _make_keys(self, made: list[BlockKey], hashes: Sequence[bytes], stop: int) -> None:
        """Extend ``made`` (the keys of the first ``hashes``) to the first ``stop``."""
        made += map(BlockKey, itertools.repeat(self._namespace), hashes[len(made) : stop])

    def wanted(
        self,
        request_id: str,
        block_hashes: Sequence[bytes],
        block_ids: Sequence[int],
        priority: int = DEFAULT_PRIORITY,
    ) -> list[WantedBlock] | None:
        """The blocks to load for ``start_load``, each with its parent, the tier its
        request's last lookup found it in and the eviction ``priority`` of its tenant;
        ``None`` if the run is not what that lookup matched (the records' chain cannot be
        checked: recompute instead)."""
        if not block_hashes:
            return []
        lookup = self._lookups.get(request_id)
        if lookup is None:
            return None
        return lookup.wanted(self._namespace, block_hashes, block_ids, priority)

    def matched_tiers(self, request_id: str) -> tuple[str, ...]:
        """The tier of each block the request's last lookup matched, in order."""
        lookup = self._lookups.get(request_id)
        return () if lookup is None else lookup.tiers

    def forget(self, request_id: str) -> None:
        """The request finished: drop what its lookups found."""
        self._lookups.pop(request_id, None)
        self._remote_runs.pop(request_id, None)

    def close(self) -> None:
        """Wait for the remote lookups in flight; no lookup may start after this."""
        if self._lookup_pool is not None:
            self._lookup_pool.shutdown(wait=True)

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
        self._on_answer()  # ends a poll(timeout) of an engine with nothing else to run
