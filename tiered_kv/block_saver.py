"""The tier manager's save side: blocks the engine saved, copied into the CPU pool.

A save reserves a pool slot per block and starts one batched copy (``BlockMover.offload``);
once the copy is complete its blocks are committed to the pool, pending for the lower tiers
the ``PoolWriter`` threads write, and reported saved (the engine then lets their GPU blocks
go). A synchronous copy (a plain host memcpy) is committed at once; an asynchronous one (CUDA,
or a transcoding host copy) by the ``tiered-kv-save-watcher`` thread, in order. A copy that
fails, when it is queued or on the way, drops its blocks (reported saved, counted, logged),
and so does any other step of a save that fails: a save never raises, since the engine lets
go of every block of a ``save_blocks`` that raises, and some may be reported already.

Saves reserve their slots as saves (``reserve_many(..., save=True)``): they leave the
pool's reserve for loads alone, so that a disk or remote hit still finds a slot while the
lower tiers lag behind. When every other slot holds a block not yet written to the lower
tiers, a save waits, deferred (its GPU block stays held), and is retried at each ``poll``
(or by a flush while the engine is idle), as many as ``num_savable`` allows, for up to
``SAVE_WAIT_S``; it is then dropped, counted and logged (one WARNING per
``drop_warning.DROP_WARNING_INTERVAL_S``, naming the setting to raise). It is dropped at once when the
engine runs short of blocks (``release_deferred``): a save never stalls a request. A save
of a tenant that matters less than every block in the pool (``tenant_priorities``) passes
through the pool on its way to the lower tiers (:mod:`storage.cpu_eviction`); with no
lower tier to write to, no slot can free up for it, and it is dropped at once.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from engine.connector import SavedBlock
from storage.base import BlockKey, block_keys
from storage.cpu_pool import CpuBlockPool
from storage.cpu_slots import Commits
from storage.lmdb_store import LmdbStore
from tiered_kv.block_mover import BlockMover, Copy
from tiered_kv.config import TierConfig
from tiered_kv.drop_warning import DropWarning
from tiered_kv.metrics import TierMetrics

logger = logging.getLogger(__name__)

# How long a save may wait for a pool slot before it is dropped. Its GPU block stays held
# meanwhile, which costs nothing while the engine has blocks to spare (it lets go of them
# when it has not), so the wait is long enough for a slow disk to take a long prompt: with
# 5 s, a 0.3 GB/s disk kept 1,376-1,984 of an 8B 32K prompt's 2,048 blocks; with 30 s, all.
SAVE_WAIT_S = 30.0


@dataclasses.dataclass
class _Save:
    """One save_blocks batch: its copy, and what to commit to the pool once it is done."""

    copy: Copy
    commits: _Commits
    block_ids: list[int]  # every block id of the batch (reported saved together)
    started: float


class _Commits(NamedTuple):
    """Blocks with reserved slots, one entry a block in each column."""

    keys: list[BlockKey]
    slots: list[int]
    blocks: list[SavedBlock]
    priorities: list[int]


class BlockSaver:
    """Saves the engine's blocks into the CPU pool, for one registered KV cache.

    ``pending_tiers``: the lower tiers a newly saved block still has to reach (those with a
    writer). ``drop_tier``: the tier dropped saves are counted under. ``on_saved`` is called
    with the block ids whose saves ended (committed, already below, skipped or dropped),
    from the engine's thread, a flush's or the save watcher's.

    :meth:`save` and :meth:`retry_deferred` hold the deferred lock: the engine's saves and a
    flush's retries take turns. Starts the save watcher if the mover's copies are
    asynchronous; :meth:`close` stops it.
    """

    def __init__(
        self,
        config: TierConfig,
        namespace: bytes,
        pool: CpuBlockPool,
        mover: BlockMover,
        disk: LmdbStore | None,
        metrics: TierMetrics,
        *,
        pending_tiers: tuple[str, ...],
        drop_tier: str,
        block_nbytes: int,
        on_saved: Callable[[list[int]], None],
    ) -> None:
        self._config = config
        self._namespace = namespace
        self._pool = pool
        self._mover = mover
        self._disk = disk
        self._metrics = metrics
        self._pending_tiers = pending_tiers
        self._drop_tier = drop_tier
        self._block_nbytes = block_nbytes
        self._on_saved = on_saved
        self._accepting = True
        self._deferred: collections.deque[tuple[SavedBlock, float]] = collections.deque()
        self._deferred_lock = threading.RLock()  # the engine's saves vs. a flush's retries
        self._saves: queue.SimpleQueue[_Save | None] = queue.SimpleQueue()
        self._saves_in_flight = 0  # copies not yet committed to the pool
        self._in_flight_lock = threading.Lock()
        self._drops = DropWarning(
            logger, "dropped %d KV blocks: the CPU pool's room for saves (all but the slots it "
            "keeps for loads) was full of blocks not yet written to the lower tiers; raise %s (or "
            "use a faster disk or codec)"
        )
        self._outranked = DropWarning(
            logger, "dropped %d KV blocks at once: every block in the CPU pool belongs to a "
            "tenant that matters more (tenant_priorities), so no slot would free up"
        )
        self._save_watcher: threading.Thread | None = None
        if mover.asynchronous:
            self._save_watcher = threading.Thread(
                target=self._watch_saves, name="tiered-kv-save-watcher", daemon=True
            )
            self._save_watcher.start()

    def save(self, blocks: Sequence[SavedBlock]) -> None:
        """:meth:`engine.connector.KVConnector.save_blocks`: start the copies. Takes every
        block, each reported once (copied, skipped, or dropped); never raises."""
        with self._deferred_lock:
            if not self._accepting:
                self._on_saved([b.block_id for b in blocks])
                return
            if self._config.offload == "prompt":
                skipped = [b.block_id for b in blocks if not b.is_prompt]
                if skipped:
                    self._on_saved(skipped)
                blocks = [b for b in blocks if b.is_prompt]
            if blocks:
                now = time.monotonic()
                self._offload([(block, now) for block in blocks])

    def retry_deferred(self) -> None:
        """Offload the oldest saves that found no slot, as many as a save could have slots
        now (from the engine's poll, or from a flush while the engine is idle; the slots
        kept for loads do not count, or each retry would take saves out and put them back
        for nothing). Only those are looked at: while the writers drain a full pool a few
        slots at a time, the engine thread retries step after step, and going over every
        deferred block each time cost it time in proportion to the backlog."""
        if not self._deferred:
            return
        with self._deferred_lock:
            self._drop_deferred(time.monotonic())
            room = min(len(self._deferred), self._pool.num_savable())
            if room == 0:
                return
            # each keeps the time it has waited since; those that find no slot go back in front
            self._offload([self._deferred.popleft() for _ in range(room)], retried=True)

    def release_deferred(self) -> None:
        """The engine is short of blocks: offload the deferred saves that find a slot now
        and drop the rest (counted and logged), so their GPU blocks go back at once."""
        with self._deferred_lock:
            self.retry_deferred()
            self._drop_deferred(time.monotonic(), force=True)

    def busy(self) -> bool:
        """Whether saves are deferred or still copying."""
        return bool(self._deferred or self._saves_in_flight)

    def stop_accepting(self) -> None:
        """From now on a save is reported at once and not kept (the manager is closing)."""
        self._accepting = False

    def close(self, deadline: float) -> None:
        """Retry the deferred saves until ``deadline`` (monotonic), drop what is left and
        stop the save watcher once it committed every copy."""
        self.stop_accepting()
        while self._deferred and time.monotonic() < deadline:
            self.retry_deferred()
            time.sleep(0.01)
        with self._deferred_lock:
            self._drop_deferred(time.monotonic(), force=True)
        if self._save_watcher is not None:
            self._saves.put(None)
            self._save_watcher.join()
        self._drops.close()
        self._outranked.close()

    def _offload(self, blocks: list[tuple[SavedBlock, float]], *, retried: bool = False) -> None:
        """Reserve a slot for each ``(block, monotonic time its save began)``, oldest first,
        and start one batched copy; blocks that find no slot wait in ``_deferred`` (their
        GPU blocks stay held), each with its own start, so the queue stays oldest first:
        behind the blocks already waiting, or (``retried``, the oldest taken from it) in
        front of them.

        Never raises: once one block is reported, waiting or copying, a raise would make the
        engine let go of it twice. A step that fails drops the blocks not yet placed so
        (reported saved, counted, logged) and gives back the slots no copy took."""
        placed: set[int] = set()  # block ids reported, waiting or handed to a copy
        slots: list[int] = []  # reserved, not yet handed to a copy
        try:
            keys = block_keys(self._namespace, [block.block_hash for block, _ in blocks])
            present = self._pool.contains_many(keys)
            todo, done = blocks, []
            if any(present):  # in the pool already (saved before, or loaded): nothing to copy
                done = [block.block_id for (block, _), here in zip(blocks, present) if here]
                self._pend_again([key for key, here in zip(keys, present) if here])
                todo = [item for item, here in zip(blocks, present) if not here]
                keys = [key for key, here in zip(keys, present) if not here]
            priorities = self._config.tenant_priorities_of([block.cache_salt for block, _ in todo])
            slots = self._pool.reserve_many(priorities, save=True)
            if len(slots) < len(todo):  # the rest wait for slots (their GPU blocks stay held)
                rest = todo[len(slots):]
                # unless every slot holds a block that matters more: none will free up
                outranked = self._pool.outranked(priorities[len(slots):])
                waiting = [item for item, no in zip(rest, outranked) if not no]
                dropped = [block.block_id for (block, _), no in zip(rest, outranked) if no]
                placed.update(dropped)
                self._drop_outranked(dropped)
                if retried:
                    self._deferred.extendleft(reversed(waiting))
                else:
                    self._deferred.extend(waiting)
                placed.update(block.block_id for block, _ in waiting)
                self._drop_deferred(time.monotonic())
            if done:
                self._on_saved(done)
                placed.update(done)
            if slots:
                n = len(slots)
                saved = [block for block, _ in todo[:n]]
                block_ids = [block.block_id for block in saved]
                placed.update(block_ids)
                commits = _Commits(keys[:n], slots, saved, priorities[:n])
                slots = []
                self._copy(commits, block_ids)
        except Exception:
            left = [block.block_id for block, _ in blocks if block.block_id not in placed]
            self._drop_failed("saving", left, slots)

    def _pend_again(self, keys: list[BlockKey]) -> None:
        """Blocks saved again while the pool holds them go to the lower tiers again, as new
        ones would (the disk only if it lacks them): a tier may have dropped them (an
        outage, a full disk) or never had them (loaded from another tier), and a flush that
        says True covers every block saved since the last."""
        if not keys:
            return
        on_disk = self._on_disk(keys)
        for tier in self._pending_tiers:
            there = on_disk if tier == "disk" else [False] * len(keys)
            self._pool.add_pending(tier, [key for key, here in zip(keys, there) if not here])

    def _on_disk(self, keys: list[BlockKey]) -> list[bool]:
        """Which of ``keys`` the disk has, where blocks go to disk; none if the lookup fails
        (a failing disk: write them again rather than lose them)."""
        if "disk" not in self._pending_tiers:
            return [False] * len(keys)
        try:
            return self._disk.contains_many(keys)
        except Exception:
            logger.exception("looking up %d saved blocks on disk failed", len(keys))
            return [False] * len(keys)

    def _copy(self, commits: _Commits, block_ids: list[int]) -> None:
        """Start the batched copy of ``commits``; it reports ``block_ids`` once, done or
        dropped."""
        try:
            # On CUDA the copies are queued here, so a device error (out of memory for the
            # staging temporaries, a kernel that does not compile) raises here, not in wait().
            copy = self._mover.offload(list(zip(block_ids, commits.slots)))
        except Exception:
            self._drop_failed("offloading", block_ids, commits.slots)
            return
        save = _Save(copy, commits, block_ids, time.perf_counter())
        if self._save_watcher is None:
            self._commit_save(save)  # a host memcpy: complete already
        else:
            with self._in_flight_lock:
                self._saves_in_flight += 1
            self._saves.put(save)

    def _drop_deferred(self, now: float, *, force: bool = False) -> None:
        dropped: list[int] = []
        while self._deferred and (force or now - self._deferred[0][1] >= SAVE_WAIT_S):
            dropped.append(self._deferred.popleft()[0].block_id)
        if dropped:
            self._on_saved(dropped)  # first: they left the queue, nothing else reports them
            self._metrics.add(self._drop_tier, dropped=len(dropped))  # counted once, here
            self._drops.add(
                len(dropped), "--kv-offloading-size" if self._config.has_cpu else "staging_bytes"
            )

    def _drop_outranked(self, block_ids: list[int]) -> None:
        """Saves no slot can free up for, as every block in the pool matters more: dropped at
        once (reported, counted, logged), not after SAVE_WAIT_S, so that neither the engine's
        blocks nor a flush or a close wait for nothing."""
        if block_ids:
            self._on_saved(block_ids)
            self._metrics.add(self._drop_tier, dropped=len(block_ids))
            self._outranked.add(len(block_ids))

    def _watch_saves(self) -> None:
        """Asynchronous copies (CUDA, or a transcoding host copy): commit each save once its
        copy is complete (the copies run in order)."""
        while (save := self._saves.get()) is not None:
            try:
                save.copy.wait()
            except Exception:
                self._drop_failed("offloading", save.block_ids, save.commits.slots)
            else:
                self._commit_save(save)
            with self._in_flight_lock:
                self._saves_in_flight -= 1

    def _drop_failed(self, step: str, block_ids: list[int], slots: list[int]) -> None:
        """A save ``step`` that failed: ``block_ids`` are reported saved first (the engine
        lets them go), then counted dropped, and ``slots`` (holding nothing to keep) given
        back. The save never raises, since the engine would then let go of blocks this save
        still reports."""
        logger.exception("%s KV blocks failed; dropping %d", step, len(block_ids))
        if block_ids:
            self._on_saved(block_ids)
            self._metrics.add(self._drop_tier, dropped=len(block_ids))
        for slot in slots:
            self._pool.unreserve(slot)

    def _commit_save(self, save: _Save) -> None:
        """Commit a completed copy's slots to the pool and report its blocks saved. It never
        raises: the engine holds the blocks until they are reported, and on CUDA this runs on
        the save watcher, which every later save waits for."""
        try:
            self._commit(save)
        except Exception:  # counting failed, or giving slots back: the blocks still go back
            logger.exception("finishing the save of %d KV blocks failed", len(save.block_ids))
        self._on_saved(save.block_ids)

    def _commit(self, save: _Save) -> None:
        """:meth:`_commit_save` but the report; the pool's slots are given back if it
        refuses them."""
        pending = self._pending_tiers
        commits = save.commits
        # a block already on disk is pending only for the others
        on_disk = self._on_disk(commits.keys)
        below = tuple(t for t in pending if t != "disk")
        try:
            stored = self._pool.commit_many(
                Commits(commits.keys, commits.slots, [b.parent_hash for b in commits.blocks],
                        [b.token_ids for b in commits.blocks],
                        [below if there else pending for there in on_disk], commits.priorities),
                self._mover.slot_dtype, self._mover.slot_shape,
            ).count(True)
        except Exception:  # the pool raises before it takes any slot: give them all back
            logger.exception("committing %d saved blocks to the CPU pool failed; dropping them",
                             len(commits.slots))
            for slot in commits.slots:
                self._pool.unreserve(slot)
            self._metrics.add(self._drop_tier, dropped=len(commits.slots))
        else:
            if self._config.has_cpu:
                self._metrics.observe_store(
                    "cpu", time.perf_counter() - save.started, stored, stored * self._block_nbytes
                )
