"""The host-memory tier: one (pinned) slab of equal slots, one KV block per slot.

The slab is reserved once (:class:`storage.pinned.PinnedSlab`, exactly the slots that fit
the budget), so a block is stored and restored as one contiguous copy, in place. It is
also the write-behind buffer of the lower tiers: a block is stored with the tiers it
still has to reach (``pending``: ``disk``, ``remote``), and a slot that is pending, or
that someone is copying from, is never evicted. Writers take pending blocks
(:meth:`CpuBlockPool.take_pending`) and report them done (:meth:`CpuBlockPool.done_pending`):
that bookkeeping is :mod:`storage.cpu_write_behind`; what a slot holds and hands out,
:mod:`storage.cpu_slots`.

A slot's life::

    free ─ reserve() ─▶ reserved ─ commit(key, pending) ─▶ visible ─ (evicted: not pending,
     ▲                 (filled by   │                       │         no readers) ─▶ free
     └──── unreserve() ◀────────────┘ its owner)            acquire()/release(): readers

Which slot a new block gets, and which block is evicted for it (by priority, then least
recently used; with ``pass_through``, a slot for blocks on their way to the lower tiers
only; with ``load_reserve``, slots saves leave free or clean for loads), is
:mod:`storage.cpu_eviction`.

``keep_clean=False`` makes the pool a pure staging buffer: a block leaves as soon as no
tier is pending for it.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Collection, Iterable, Iterator, Sequence, Sized

import torch

from storage.base import BlockKey, BlockStore, StoreStats, check_keys
from storage.cpu_eviction import LOAD_SHARE, PASSING_SHARE, Eviction
from storage.cpu_slots import Commit, Commits, HostBlock, SlotBlock, SlotEntry
from storage.cpu_write_behind import WriteBehind
from storage.pinned import PinnedSlab
from storage.priority_lru import DEFAULT_PRIORITY


class CpuBlockPool(Eviction, WriteBehind, BlockStore[HostBlock]):
    """LRU pool of raw KV blocks in one host slab. Thread-safe.

    ``get`` returns a copy. :meth:`acquire` returns a view of a block's slot and keeps the
    slot from being reused until :meth:`release`, for copies that outlive the call.

    ``load_reserve``: slots that saves (``reserve_many(..., save=True)``) leave free or
    clean for loads, so that a hit from a lower tier finds a slot while a slow writer
    holds the rest of the pool; at most one slot in ``LOAD_SHARE``, and none in a staging
    buffer (it holds no clean block, and its size is the writers' budget).
    """

    tier = "cpu"

    def __init__(
        self,
        capacity_bytes: int,
        *,
        block_nbytes: int | None = None,
        pin_memory: bool | None = None,
        keep_clean: bool = True,
        pass_through: bool = False,
        load_reserve: int = 0,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if block_nbytes is not None and not 0 < block_nbytes <= capacity_bytes:
            raise ValueError(f"block_nbytes must be in (0, {capacity_bytes}], got {block_nbytes}")
        if load_reserve < 0:
            raise ValueError(f"load_reserve must be at least 0, got {load_reserve}")
        self.capacity_bytes = capacity_bytes
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.keep_clean = keep_clean
        self.pass_through = pass_through and keep_clean  # a staging buffer keeps nothing
        self._load_reserve_asked = load_reserve if keep_clean else 0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._entries: dict[BlockKey, SlotEntry] = {}
        self._slab: PinnedSlab | None = None
        self._slot_nbytes = 0
        self._init_eviction()
        self._init_write_behind()
        self._stats = StoreStats(tier=self.tier, capacity_bytes=capacity_bytes)
        self._closed = False
        if block_nbytes is not None:
            self._reserve_slab(block_nbytes)

    # ------------------------------------------------------------------ slab

    @property
    def slot_nbytes(self) -> int:
        return self._slot_nbytes

    @property
    def num_slots(self) -> int:
        return 0 if self._slab is None else self._slab.tensor.shape[0]

    @property
    def load_reserve(self) -> int:
        """Slots saves leave free or clean for loads (0 until the slab is reserved)."""
        return self._load_reserve

    @property
    def slab(self) -> torch.Tensor:
        """The whole slab, ``[num_slots, slot_nbytes]`` uint8 (for batched copies)."""
        if self._slab is None:
            raise RuntimeError("the pool has no slab yet (no block size known)")
        return self._slab.tensor

    def _reserve_slab(self, slot_nbytes: int) -> None:
        num_slots = self.capacity_bytes // slot_nbytes
        self._slab = PinnedSlab(num_slots, slot_nbytes, pin=self.pin_memory)
        self._slot_nbytes = slot_nbytes
        self._free = list(range(num_slots - 1, -1, -1))
        self._max_passing = max(1, num_slots // PASSING_SHARE) if self.pass_through else 0
        self._load_reserve = min(self._load_reserve_asked, num_slots // LOAD_SHARE)

    def slot_view(self, slot: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return self.slab[slot].view(dtype).view(shape)

    # ------------------------------------------------------------------ reserve and commit

    def reserve(self, priority: int = DEFAULT_PRIORITY) -> int | None:
        """A slot for a new block of ``priority``: a free one, or the slot of the block
        evicted first (see above) if that one matters no more than the newcomer (or, with
        ``pass_through``, a slot for a passing block while there is room for one). ``None``
        when no slot can be had."""
        slots = self.reserve_many((priority,))
        return slots[0] if slots else None

    def reserve_many(self, priorities: Iterable[int], *, save: bool = False) -> list[int]:
        """:meth:`reserve` for new blocks of ``priorities`` in order, under one lock: their
        slots, stopping at the first block that gets none. The slots come in ascending
        order (whichever block's priority freed which, they are all the batch's), so that
        consecutive blocks meet consecutive slots and move as one copy: slots given back
        one by one return to the free list in the order they left it, and would otherwise
        be handed out backwards.

        ``save``: slots for saved blocks, which stay pending until the lower tiers have
        them: they leave the reserve for loads alone (:meth:`num_savable`); being held
        back by it counts as a refusal."""
        slots: list[int] = []
        with self._lock:
            self._check_open()
            if save:
                priorities = list(priorities)
                room = max(0, self._save_room_locked())
                if len(priorities) > room:
                    self._refused += 1
                    del priorities[room:]
            free = self._free
            if isinstance(priorities, Sized) and len(priorities) <= len(free):
                slots = free[len(free) - len(priorities) :]  # what as many pops would take
                del free[len(free) - len(priorities) :]
                priorities = ()
            for priority in priorities:
                slot = self._take_slot_locked(priority, may_pass=True)
                if slot is None:
                    break
                slots.append(slot)
        slots.sort()
        return slots

    def commit(
        self,
        key: BlockKey,
        slot: int,
        kv_dtype: torch.dtype,
        kv_shape: tuple[int, ...],
        parent_hash: bytes | None,
        token_ids: Iterable[int],
        pending: Collection[str] = (),
        *,
        hold: bool = False,
        priority: int = DEFAULT_PRIORITY,
    ) -> bool:
        """Make the block filled into ``slot`` visible under ``key``, still to be written to
        the tiers in ``pending``; ``hold``: also :meth:`acquire` it. ``priority``: its place
        in the order of eviction. ``False`` (and the slot freed) if ``key`` is already here
        (it is then pending for ``pending`` too) or the pool is closed."""
        commit = Commit(key, slot, parent_hash, tuple(token_ids), pending, priority)
        return self.commit_many((commit,), kv_dtype, kv_shape, hold=hold)[0]

    def commit_many(
        self,
        commits: Sequence[Commit] | Commits,
        kv_dtype: torch.dtype,
        kv_shape: tuple[int, ...],
        *,
        hold: bool = False,
    ) -> list[bool]:
        """:meth:`commit` for many blocks of one dtype and shape (as :class:`Commit` s, or
        columns), under one lock. An invalid key raises before any slot is committed or
        freed: the slots are still the caller's."""
        if not isinstance(commits, Commits):
            commits = Commits.of(commits)
        check_keys(commits.keys)
        kv_shape = tuple(kv_shape)
        readers = int(hold)
        done: list[bool] = []
        with self._lock:
            if self._closed:
                return [False] * len(commits.keys)
            entries, counts, children = self._entries, self._priorities, self._children
            pending_count, queues, passing = self._pending_count, self._queues, self._passing
            queued = False
            for key, slot, parent_hash, token_ids, pending, priority in zip(*commits):
                if key in entries:
                    self._free_slot_locked(slot)
                    done.append(False)
                    # the block came in meanwhile (a load promoted it): the tiers this save
                    # was for are its to reach still, or a flush would say so wrongly
                    entry = entries[key]
                    if any(tier not in entry.pending for tier in pending):
                        new = [tier for tier in pending if tier not in entry.pending]
                        entry.pending.update(new)
                        self._evictable.pop(key, None)
                        self._queue_pending_locked(key, new)
                        queued = True
                    continue
                done.append(True)
                if not pending and not hold and (not self.keep_clean or slot in passing):
                    if slot in passing:  # nothing to write: it passes at once
                        self._stats.evictions += 1
                    self._free_slot_locked(slot)
                    continue
                entry = entries[key] = SlotEntry(
                    slot, kv_dtype, kv_shape, parent_hash, tuple(token_ids), set(pending),
                    readers, set(), priority,
                )
                counts[priority] += 1
                if parent_hash is not None:  # its parent's chain goes on here
                    children[parent_hash] = children.get(parent_hash, 0) + 1
                if pending:  # a new key is in no queue and not evictable: nothing to settle
                    queued = True
                    for tier in pending:  # newly pending: counted, and last in the queue
                        pending_count[tier] += 1
                        queues[tier][key] = None
                elif not hold:
                    self._settle_locked(key, entry)
            stored = done.count(True)
            self._stats.puts += stored
            self._stats.bytes_written += self._slot_nbytes * stored
            if queued:
                self._changed.notify_all()
        return done

    def unreserve(self, slot: int) -> None:
        """Give back a reserved slot that was not committed."""
        with self._lock:
            if not self._closed:
                self._free_slot_locked(slot)

    # ------------------------------------------------------------------ reads

    def contains(self, key: BlockKey) -> bool:
        with self._lock:
            return key in self._entries

    @property
    def removals(self) -> int:
        """How many blocks have left the pool (evicted, dropped from a staging pool once
        written, deleted): while it stays the same, every block :meth:`contains` found is
        still here."""
        with self._lock:
            return self._removals

    def contains_many(self, keys: Iterable[BlockKey]) -> list[bool]:
        with self._lock:
            return [k in self._entries for k in keys]

    def acquire(self, key: BlockKey) -> SlotBlock | None:
        """A view of ``key``'s slot (``None`` on a miss); the slot is not reused until
        :meth:`release`. Counts a hit or a miss."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._stats.misses += 1
                return None
            entry.readers += 1
            self._evictable.pop(key, None)
            self._stats.hits += 1
            self._stats.bytes_read += self._slot_nbytes
            view = self.slot_view(entry.slot, entry.dtype, entry.shape)
            return SlotBlock(
                key, entry.slot, view, entry.parent_hash, entry.token_ids, entry.priority
            )

    def acquire_slots(self, keys: Iterable[BlockKey]) -> list[int | None]:
        """:meth:`acquire` for many blocks under one lock, giving only their slots (for
        copies that take the slab and slot numbers)."""
        slots: list[int | None] = []
        held: list[BlockKey] = []  # the ones that were evictable until now
        with self._lock:
            entries = self._entries
            for key in keys:
                entry = entries.get(key)
                if entry is None:
                    slots.append(None)
                    continue
                if not entry.readers and not entry.pending:
                    held.append(key)
                entry.readers += 1
                slots.append(entry.slot)
            self._evictable.discard_many(held)
            hits = len(slots) - slots.count(None)
            self._stats.hits += hits
            self._stats.misses += len(slots) - hits
            self._stats.bytes_read += self._slot_nbytes * hits
        return slots

    def release_many(self, keys: Iterable[BlockKey]) -> None:
        """:meth:`release` for many blocks under one lock."""
        with self._lock:
            entries = self._entries
            settled: list[tuple[BlockKey, SlotEntry]] = []
            for key in keys:
                entry = entries.get(key)
                if entry is None:
                    continue
                entry.readers -= 1
                if not entry.readers:
                    settled.append((key, entry))
            if not settled:
                return
            self._settle_clean_locked([(k, e) for k, e in settled if not e.pending])
            self._changed.notify_all()

    def release(self, key: BlockKey) -> None:
        """Let go of a block :meth:`acquire` held."""
        self.release_many((key,))

    def get(self, key: BlockKey) -> HostBlock | None:
        held = self.acquire(key)
        if held is None:
            return None
        try:
            return HostBlock(held.kv.clone(), held.parent_hash, held.token_ids)
        finally:
            self.release(key)

    # ------------------------------------------------------------------ BlockStore

    def put(self, key: BlockKey, value: HostBlock, *, priority: int = DEFAULT_PRIORITY) -> bool:
        key.validate()
        kv = value.kv
        nbytes = kv.numel() * kv.element_size()
        with self._lock:
            self._check_open()
            if self._slab is None and 0 < nbytes <= self.capacity_bytes:
                self._reserve_slab(nbytes)
            if nbytes != self._slot_nbytes:
                self._stats.dropped += 1
                return False
            if key in self._entries:
                if key in self._evictable:
                    self._evictable.move_to_end(key)
                return True
            slot = self._take_slot_locked(priority)
            if slot is None:
                self._stats.dropped += 1
                return False
        # The slot belongs to no entry and is not free: nobody else touches it meanwhile.
        self.slot_view(slot, kv.dtype, tuple(kv.shape)).copy_(kv)
        self.commit(
            key, slot, kv.dtype, tuple(kv.shape), value.parent_hash, value.token_ids,
            priority=priority,
        )
        return True

    def delete(self, key: BlockKey) -> bool:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return False
            while entry.readers:
                self._changed.wait()
            if self._entries.get(key) is not entry:
                return False
            self._remove_locked(key)
            self._evictable.pop(key, None)
            self._unqueue_pending_locked(key, entry.pending)
            self._free_slot_locked(entry.slot)
            self._changed.notify_all()
            return True

    def keys(self, namespace: bytes | None = None) -> Iterator[BlockKey]:
        with self._lock:
            snapshot = list(self._entries)
        return (k for k in snapshot if namespace is None or k.namespace == namespace)

    def stats(self) -> StoreStats:
        with self._lock:
            self._stats.entries = len(self._entries)
            self._stats.bytes_used = len(self._entries) * self._slot_nbytes
            return dataclasses.replace(self._stats)

    def close(self) -> None:
        """Drop every block and the slab. Only once no copy can still use a slot."""
        with self._lock:
            self._closed = True
            self._removals += len(self._entries)
            self._entries.clear()
            self._priorities.clear()
            self._evictable.clear()
            self._children.clear()
            self._free.clear()
            self._passing.clear()
            self._passed.clear()
            self._clear_pending_locked()
            slab, self._slab = self._slab, None
            self._changed.notify_all()
        if slab is not None:
            slab.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("CpuBlockPool is closed")
