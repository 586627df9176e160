"""The tier manager's lookup side: how many of a request's next blocks the tiers hold.

The engine asks :meth:`TierLookup.num_matched` on its thread, again step after step for a
request it could not schedule yet. The walk goes CPU → disk → remote and counts the run of
consecutive blocks some tier holds: the CPU pool and the disk are index checks; the rest of
the chain is asked of the remote tier in one pipelined round-trip (gated by the store's
breaker) on a ``tiered-kv-lookup`` thread. Until that answers the lookup is "not yet"
(``None``); the answer wakes an engine waiting in ``poll`` and is kept per request, so a
repeated lookup costs no further round-trip. What a lookup found (each block's tier) is
kept until the request finishes, for :meth:`TierLookup.wanted` when its load starts.

A repeated lookup does not walk the run again while nothing left the pool or the disk
(their ``removals`` counts, read before each walk, are unchanged): it checks only the block
after the run, and walks on from there if a tier now holds it. A removal makes the next
lookup walk the chain again. A block found on disk and promoted into the pool since still
counts as a disk block; the load takes it from the pool all the same.
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


@dataclasses.dataclass(slots=True)
class _Lookup:
    """A request's last lookup: its hash chain, where each block of the matched run was
    found, and what answers the same lookup again without walking the run.

    The pool's and the disk's removal counts are read before the walk: while both stay the
    same, every block the walk found is still there, and the run can only have grown at its
    end (a block saved or promoted since)."""

    hashes: tuple[bytes, ...]
    first: int  # index of the first block the lookup was asked about
    # the keys of hashes[first:] made so far: the lookup asked again (the request waits for
    # blocks) reuses them, as making a key costs more than asking the pool about it
    keys: list[BlockKey] = dataclasses.field(default_factory=list)
    local: list[str] = dataclasses.field(default_factory=list)  # cpu or disk, of hashes[first + i]
    removals: tuple[int, int] | None = None  # (pool, disk) before the walk; None: not walked
    # the remote tier's answer for the blocks from hashes[first + remote_from] on
    remote: concurrent.futures.Future[int] | None = None
    remote_from: int = 0
    tiers: tuple[str, ...] | None = None  # of the matched run; None until answered

    def is_for(self, block_hashes: Sequence[bytes], first: int) -> bool:
        """Whether this lookup was of ``block_hashes`` from ``first``: the hashes are chained,
        so the last one stands for the whole chain (and the request's cache salt)."""
        return (
            first == self.first
            and len(block_hashes) == len(self.hashes)
            and block_hashes[-1] == self.hashes[-1]
        )

    def wanted(
        self,
        namespace: bytes,
        block_hashes: Sequence[bytes],
        block_ids: Sequence[int],
        priority: int,
    ) -> list[WantedBlock] | None:
        """The blocks to load with their parents (``None`` for the chain's first block), or
        ``None`` if the run is not part of this lookup's matched chain."""
        if self.tiers is None:
            return None
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
        self._lookup_pool: concurrent.futures.ThreadPoolExecutor | None = None
        if remote is not None:
            self._lookup_pool = concurrent.futures.ThreadPoolExecutor(
                LOOKUP_WORKERS, thread_name_prefix="tiered-kv-lookup"
            )

    def num_matched(
        self, request_id: str, block_hashes: Sequence[bytes], num_computed_blocks: int
    ) -> int | None:
        """:meth:`engine.connector.KVConnector.get_num_matched_blocks` over the tiers.

        The engine asks again, step after step, for a request it could not schedule yet:
        such a lookup costs two counter reads and one check of the block after the run
        while nothing left the pool or the disk, and walks only what changed otherwise."""
        if num_computed_blocks >= len(block_hashes):
            return 0
        removals = self._removals()  # before the walk: a removal meanwhile shows next time
        lookup = self._lookups.get(request_id)
        if lookup is None or not lookup.is_for(block_hashes, num_computed_blocks):
            lookup = self._lookups[request_id] = _Lookup(
                tuple(block_hashes), num_computed_blocks
            )
            cpu_lookups, disk_lookups = self._walk(lookup, removals)
            if self._count_cpu:
                self._metrics.add("cpu", lookups=cpu_lookups)
            if self._disk is not None:
                self._metrics.add("disk", lookups=disk_lookups)
            if self._remote is not None:
                rest = len(lookup.hashes) - lookup.first - len(lookup.local)
                self._metrics.add("remote", lookups=rest)
        elif lookup.removals != removals or self._run_grew(lookup):
            self._walk(lookup, removals)
        if lookup.tiers is None:
            run = self._remote_run(request_id, lookup)
            if run is None:
                return None  # the engine asks again at a later step
            lookup.tiers = (*lookup.local, *["remote"] * run)
        return len(lookup.tiers)

    def _removals(self) -> tuple[int, int]:
        return self._pool.removals, 0 if self._disk is None else self._disk.removals

    def _walk(self, lookup: _Lookup, removals: tuple[int, int]) -> tuple[int, int]:
        """Find the run the pool and the disk hold (on from where the last walk stopped, if
        nothing left them since); how many blocks each was asked about."""
        if lookup.removals != removals:
            lookup.local.clear()
        lookup.removals = removals
        lookup.tiers = None
        return self._local_run(lookup.hashes[lookup.first :], lookup.keys, lookup.local)

    def _run_grew(self, lookup: _Lookup) -> bool:
        """Whether the pool or the disk now holds the block after the run the last walk
        found (that walk made its key)."""
        end = len(lookup.local)
        if lookup.first + end == len(lookup.hashes):
            return False
        key = lookup.keys[end]
        return self._pool.contains(key) or (self._disk is not None and self._disk.contains(key))

    def _local_run(
        self, hashes: Sequence[bytes], made: list[BlockKey], tiers: list[str]
    ) -> tuple[int, int]:
        """Extend ``tiers`` (the tier, ``cpu`` or ``disk``, of each leading block of
        ``hashes`` the pool or the disk holds) past the blocks it has; how many blocks the
        pool and the disk were asked about. ``made``: the keys of the first ``hashes`` made
        already; extended with those made here. The pool is asked :data:`LOOKUP_CHUNK` keys
        at a time, so the first block neither holds ends the walk (a cold 32K-token prompt
        cost ~1 ms a lookup when every key was made and asked)."""
        begin = len(tiers)
        disk_lookups = 0
        for start in range(begin, len(hashes), LOOKUP_CHUNK):
            stop = min(start + LOOKUP_CHUNK, len(hashes))
            self._make_keys(made, hashes, stop)
            keys = made[start:stop]
            in_pool = self._pool.contains_many(keys)
            if all(in_pool):  # the usual long hit: no walk a block at a time
                tiers += ["cpu"] * len(keys)
                continue
            if self._disk is None:
                tiers += ["cpu"] * in_pool.index(False)
                return len(tiers) - begin + 1, disk_lookups
            # the disk asked once for the chunk's blocks the pool lacks (one lock, not one
            # call each: 2,048 disk blocks cost ~2.7 ms asked one at a time)
            found = iter(self._disk.contains_many([k for k, here in zip(keys, in_pool) if not here]))
            on_disk = [here or next(found) for here in in_pool]
            for here, below in zip(in_pool, on_disk):
                if not here:
                    disk_lookups += 1  # asked of the disk because the pool lacks it
                if not below:
                    return len(tiers) - begin + 1, disk_lookups
                tiers.append("cpu" if here else "disk")
        return len(tiers) - begin, disk_lookups

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
        return () if lookup is None or lookup.tiers is None else lookup.tiers

    def forget(self, request_id: str) -> None:
        """The request finished: drop what its lookups found."""
        self._lookups.pop(request_id, None)

    def close(self) -> None:
        """Wait for the remote lookups in flight; no lookup may start after this."""
        if self._lookup_pool is not None:
            self._lookup_pool.shutdown(wait=True)

    def _remote_run(self, request_id: str, lookup: _Lookup) -> int | None:
        """How many of the blocks after ``lookup``'s local run the remote tier holds (0
        without one); ``None`` while the lookup (one pipelined round-trip for all of them,
        gated by the store's breaker) runs on a lookup thread. Asked again only when the
        local run changed, so a repeated lookup costs no further round-trip."""
        run = len(lookup.local)
        if self._remote is None or lookup.first + run == len(lookup.hashes):
            return 0
        if lookup.remote is None or lookup.remote_from != run:
            wanted = lookup.hashes[lookup.first :]
            self._make_keys(lookup.keys, wanted, len(wanted))
            future = self._lookup_pool.submit(self._remote.longest_prefix, lookup.keys[run:])
            future.add_done_callback(self._lookup_done)
            lookup.remote, lookup.remote_from = future, run
            return None
        if not lookup.remote.done():
            return None
        try:
            return lookup.remote.result()
        except Exception:  # the store turns its errors into misses; anything else is a bug
            logger.exception("remote lookup for %s failed", request_id)
            return 0

    def _lookup_done(self, future: concurrent.futures.Future[int]) -> None:
        self._on_answer()  # ends a poll(timeout) of an engine with nothing else to run
