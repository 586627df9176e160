"""Which slot of the CPU pool a new block gets, and which block leaves for it.

Eviction takes, among the blocks neither pending nor read, those committed with the
highest ``priority`` value first (a lower value matters more, as a request's priority
does; a tenant's blocks carry its priority); within one priority, blocks that end their
chain in the pool (no child here) before those whose chain goes on, and among those the
one read or written out longest ago. ``reserve(priority)`` evicts only blocks that matter
no more than the newcomer: O(1), no scan of the pool.

Chains are evicted from their end, as a lookup walks a chain from its start and stops at
the first block no tier holds: a chain's first block, saved and read first, is its least
recently used, and evicting it first would leave the rest in the pool and of no use. When
a chain's last block goes, the block before it becomes the chain's end as the least
recently used of its kind (it was used no later), so a cold chain goes from its end on::

    a0 ─ a1 ─ a2 ─ a3   (a3 a leaf)   evicted: a3, then a2, ...   a0 ─ a1 still a hit

A block is filed by whether it had a child in the pool when it became evictable; one that
gets a child later is refiled when eviction comes to it (the commit only counts the child,
so a save costs one dict update a block).

``pass_through=True`` (a pool in front of lower tiers) lets a block through that every
evictable block outranks: it takes the slot of the block evicted first all the same, and
leaves once no tier is pending for it, as in a staging buffer. Its slot is then kept for
the next passing block (or for a block that matters as much as any in the pool), never
handed to one that would have been outranked, so passing never moves the pool's share
from a tenant to one that matters less. At most one slot in ``PASSING_SHARE`` is taken so
(``_passing`` and ``_passed`` together): a tenant that matters less still reaches the
lower tiers from a pool full of blocks that matter more, at the cost of a bounded share
of their places (blocks already written, as only clean ones are evicted)::

    full of clean gold blocks, a batch block saved:   [g g g g g g g g]  -> [b g g g g g g g]
    written below, its slot is kept for the next:     [p g g g g g g g]  (p: _passed)

``load_reserve`` (a pool in front of lower tiers) keeps slots from saves for loads: a hit
from the disk or the remote tier is decoded into a reserved slot, and otherwise a slow disk
fills the pool with blocks not yet written and every such hit is recomputed, when the
tiers are busiest. A save's reservation (``reserve_many(..., save=True)``) takes a slot
only while more than ``load_reserve`` of them are free, kept for passing blocks, or clean
and unread (:meth:`Eviction.num_evictable`); a load's may take them all. At most one slot
in ``LOAD_SHARE`` is kept so. Saves then wait for the writers while loads find slots::

    a slow disk, the saves' share pending:   [P P P P P P c f]   a save waits
                                                          └─┘    a disk hit takes c or f
                                                     load_reserve   (P pending, c clean, f free)

A block saved again while the pool holds it becomes pending without a reservation, and a
hit from the remote tier may be promoted pending for the disk: either may hold part of the
reserve until the writers catch up, and saves are refused meanwhile.

:class:`Eviction` is a part of :class:`storage.cpu_pool.CpuBlockPool`. It owns the free
list, the evictable blocks by priority and the count of blocks per priority, and the
passing slots (set up by ``_init_eviction``; the pool's slab sets ``_free``,
``_max_passing`` and ``_load_reserve``). It uses the pool's lock, ``_entries``,
``_stats``, ``keep_clean``, ``pass_through`` and ``num_slots``; every ``_locked`` method
needs the lock.
"""
from __future__ import annotations

import collections
from collections.abc import Iterable

from storage.base import BlockKey
from storage.chain_levels import drop_child, refile_as_end
from storage.cpu_slots import SlotEntry
from storage.priority_lru import PriorityLru

# With pass_through, at most one slot in this many holds a passing block.
PASSING_SHARE = 16
# At most one slot in this many is kept from saves for loads (``load_reserve``): a pool too
# small to spare one keeps none, and saves always have most of the pool.
LOAD_SHARE = 8


class Eviction:
    """The CPU pool's choice of slots; see the module docstring."""

    def _init_eviction(self) -> None:
        self._evictable: PriorityLru[BlockKey] = PriorityLru()  # neither pending nor read
        self._priorities: collections.Counter[int] = collections.Counter()  # entries per priority
        self._free: list[int] = []
        self._passing: set[int] = set()  # slots of passing blocks, reserved or committed
        self._passed: list[int] = []  # free slots passing blocks left, kept for the next
        self._max_passing = 0
        self._load_reserve = 0  # slots a save's reservation leaves to loads
        self._removals = 0  # blocks that left: evicted, dropped once written, deleted
        self._refused = 0  # reservations that found no slot
        # children in the pool by their parent's block hash (present or not; a pool holds
        # one model's blocks): a block with one is filed after the chains' ends
        self._children: dict[bytes, int] = {}

    def _level(self, key: BlockKey, priority: int) -> int:
        """A block's level in ``_evictable`` (the higher, the sooner evicted): its priority,
        then whether its chain ends with it. ``level >> 1`` is the priority."""
        return 2 * priority + (key.block_hash not in self._children)

    def _unlink_locked(self, key: BlockKey, parent_hash: bytes | None) -> None:
        """A block left the pool: its parent may end its chain now, the least recently used
        of its level. (A block entering the pool is counted in ``_children`` by the pool's
        commit; its parent, if evictable, is refiled only when eviction comes to it.)"""
        if parent_hash is not None and drop_child(self._children, parent_hash):
            refile_as_end(self._evictable, BlockKey(key.namespace, parent_hash))

    def _take_slot_locked(self, priority: int, *, may_pass: bool = False) -> int | None:
        """A free slot; a slot passing blocks left, for a newcomer that matters as much as
        any block here; the slot of the block evicted first if it matters no more than the
        newcomer; or else (``may_pass``, a save) a slot for a passing block, room permitting:
        one passing blocks left, or the block evicted first's."""
        if self._free:
            return self._free.pop()
        passed = self._passed
        if passed and priority <= min(self._priorities, default=priority):
            return passed.pop()
        key = self._evictable.first()
        while key is not None and key.block_hash in self._children:
            level = self._evictable.priority(key)
            if not level & 1:  # the first block left is inside a chain: no end to take
                break
            self._evictable.set(key, 1, level - 1)  # its chain went on since it was filed
            key = self._evictable.first()
        if key is not None and self._evictable.priority(key) >> 1 >= priority:
            self._evictable.pop(key)
            self._stats.evictions += 1
            return self._remove_locked(key).slot
        if may_pass and passed:
            slot = passed.pop()
        elif may_pass and key is not None and len(self._passing) < self._max_passing:
            self._evictable.pop(key)
            self._stats.evictions += 1
            slot = self._remove_locked(key).slot
        else:
            self._refused += 1
            return None
        self._passing.add(slot)
        return slot

    def _free_slot_locked(self, slot: int) -> None:
        """Give ``slot`` back: to the free list, or kept for passing blocks if one held it."""
        if slot in self._passing:
            self._passing.discard(slot)
            self._passed.append(slot)
        else:
            self._free.append(slot)

    def _remove_locked(self, key: BlockKey) -> SlotEntry:
        """Take ``key``'s entry out of the pool's entries (its slot is the caller's)."""
        entry = self._entries.pop(key)
        self._unlink_locked(key, entry.parent_hash)
        self._removals += 1
        left = self._priorities[entry.priority] - 1
        if left:
            self._priorities[entry.priority] = left
        else:
            del self._priorities[entry.priority]
        return entry

    def _settle_locked(self, key: BlockKey, entry: SlotEntry) -> None:
        """File ``entry`` by its state: evictable (the most recent of its priority) once
        neither pending nor read, or gone at once if the pool does not keep it clean (a
        staging buffer, or a passing block)."""
        if entry.pending or entry.readers:
            self._evictable.pop(key, None)
        elif self.keep_clean and entry.slot not in self._passing:
            self._evictable.set(key, 1, self._level(key, entry.priority))
        else:
            self._remove_locked(key)
            self._evictable.pop(key, None)
            if entry.slot in self._passing:  # written: it leaves the tier, as if evicted
                self._stats.evictions += 1
            self._free_slot_locked(entry.slot)

    def _settle_clean_locked(self, clean: list[tuple[BlockKey, SlotEntry]]) -> None:
        """:meth:`_settle_locked` for entries neither pending nor read now, in order: all
        evictable at once where the pool keeps them."""
        if self.keep_clean and not self._passing:  # the most recent of their priorities
            children = self._children  # as _level, inline: a batch a call
            self._evictable.set_many(
                ((k, 2 * e.priority + (k.block_hash not in children)) for k, e in clean), 1)
        else:
            for key, entry in clean:
                self._settle_locked(key, entry)

    def outranked(self, priorities: Iterable[int]) -> list[bool]:
        """For new blocks of ``priorities``: whether no slot can free up for one by waiting,
        as every slot holds a block (written or not, read or not) that matters more, and
        none may pass through."""
        priorities = list(priorities)
        with self._lock:
            # a staging pool frees a slot once its block is written; a reserved one comes
            # back; a passing block's slot frees up once it is written, and a block that
            # matters more may be taken for one once it is
            if (not self.keep_clean or self._max_passing or not self._entries
                    or len(self._entries) < self.num_slots):
                return [False for _ in priorities]
            # the slot of a block that matters no more may free up: written, or read no longer
            least = max(self._priorities)  # the highest value: the block that matters least
            return [least < priority for priority in priorities]

    def refused(self) -> int:
        """Reservations so far that found no slot, saves' kept from the reserve for loads
        included. A write-back writer takes a rise as pressure: a newcomer's slot may be
        one only a pending block of its own priority can free, while blocks that matter
        more keep ``num_evictable`` up."""
        return self._refused

    def num_evictable(self) -> int:
        """Slots a :meth:`reserve` of any priority could have right now (free, kept for
        passing blocks, or clean and unread)."""
        with self._lock:
            return len(self._free) + len(self._passed) + len(self._evictable)

    def num_savable(self) -> int:
        """Slots a save's reservation could have right now: :meth:`num_evictable` less the
        reserve for loads."""
        with self._lock:
            return max(0, self._save_room_locked())

    def _save_room_locked(self) -> int:
        """:meth:`num_evictable` less the reserve for loads (negative while loads, or blocks
        made pending without a slot, hold part of the reserve)."""
        return len(self._free) + len(self._passed) + len(self._evictable) - self._load_reserve
