"""The disk tier's eviction order: by priority, chain ends first, LRU within each.

Records go, as in the CPU pool (:mod:`storage.cpu_eviction`), with the highest
``priority`` value first; within one priority, records that end their chain in the store
(no child here) before those whose chain goes on, and among those the one put or read
longest ago. A record's child is a record whose parent hash (stored with its metadata,
:mod:`storage.lmdb_meta`) is the record's block hash; a block hash is unique to its
namespace (a chain's root hash covers it), so children are counted by hash alone.

Chains are evicted from their end, as a lookup walks a chain from its start and stops at
the first block no tier holds: a chain's first block, saved and read first, is its least
recently used, and evicting it first would leave the rest on disk and of no use. When a
chain's last record goes, the record before it becomes the chain's end as the least
recently used of its kind (it was used no later), so a cold chain goes from its end on::

    a0 ─ a1 ─ a2 ─ a3   (a3 a leaf)   evicted: a3, then a2, ...   a0 ─ a1 still a hit

A put files its record as a chain's end, the most recent; one with a child here is
refiled, as the most recent of the records with one, when eviction comes to it. So a put
costs a count for its parent and no look at its own children, and a group of new records
is indexed with a few calls. Opening a store files every record as its children say,
each kind by last access.

:class:`ChainLru` is not thread-safe: the store's lock guards it.
"""
from __future__ import annotations

import collections
import itertools
import operator
from collections.abc import Iterable, Iterator, Sequence

from storage.base import DIGEST_SIZE
from storage.chain_levels import drop_child, refile_as_end
from storage.priority_lru import PriorityLru

_MISSING = object()
_BLOCK_HASH = operator.itemgetter(slice(DIGEST_SIZE, None))  # of a key's bytes


class ChainLru:
    """Block keys (``BlockKey.to_bytes()``) -> record size, in eviction order; see the
    module docstring. A key's level in the :class:`PriorityLru` beneath is
    ``2 * priority + 1`` while it is filed as a chain's end, ``2 * priority`` once it is
    filed as having a child: ``level >> 1`` is its priority."""

    def __init__(self) -> None:
        self._lru: PriorityLru[bytes] = PriorityLru()
        # children here by their parent's block hash (present or not)
        self._children: collections.Counter[bytes] = collections.Counter()
        self._parents: dict[bytes, bytes | None] = {}  # every key -> its parent hash, or None

    @classmethod
    def build(
        cls, kbs: Sequence[bytes], sizes: Sequence[int], priorities: Sequence[int],
        parent_hashes: Sequence[bytes | None],
    ) -> ChainLru:
        """The order of keys ``kbs`` with their sizes, priorities and parent hashes, given
        least recently used first, each filed as its children here say."""
        lru = cls()
        lru._parents.update(zip(kbs, parent_hashes))
        lru._children.update(filter(None, parent_hashes))
        doubled = map(operator.mul, priorities, itertools.repeat(2))
        ends = map(operator.not_, map(lru._children.__contains__, map(_BLOCK_HASH, kbs)))
        lru._lru.set_weights(kbs, sizes, list(map(operator.add, doubled, ends)))
        return lru

    # ------------------------------------------------------------------ changes

    def set(self, kb: bytes, size: int, priority: int, parent_hash: bytes | None) -> None:
        """Insert or update ``kb`` as the most recent chain's end of its priority."""
        self._link(kb, parent_hash)
        self._lru.set(kb, size, 2 * priority + 1)

    def set_many(
        self, kbs: list[bytes], sizes: list[int], priorities: list[int],
        parent_hashes: Sequence[bytes | None],
    ) -> int:
        """:meth:`set` of each key, in order, as one call; the total size the keys had
        before."""
        replaced = self._lru.set_weights(kbs, sizes, [2 * p + 1 for p in priorities])
        if replaced:  # a key that was here (none has size 0), or one put twice
            for kb, parent_hash in zip(kbs, parent_hashes):
                self._link(kb, parent_hash)
        else:  # new keys, each once: counted with a call or two (a root's parent is None)
            self._parents.update(zip(kbs, parent_hashes))
            self._children.update(filter(None, parent_hashes))
        return replaced

    def _link(self, kb: bytes, parent_hash: bytes | None) -> None:
        """Count ``kb`` as a child of ``parent_hash``'s block, not of another."""
        old = self._parents.get(kb)
        if old is not None:
            if old == parent_hash:
                return
            self._unlink(kb)
        self._parents[kb] = parent_hash
        if parent_hash is not None:
            self._children[parent_hash] += 1

    def _unlink(self, kb: bytes) -> None:
        """``kb`` is no child of its parent now: the parent may end its chain, the least
        recently used of its kind (a parent still filed as a chain's end stays where it is)."""
        parent_hash = self._parents.pop(kb, None)
        if parent_hash is not None and drop_child(self._children, parent_hash):
            refile_as_end(self._lru, kb[:DIGEST_SIZE] + parent_hash)

    def pop(self, kb: bytes, default: object = _MISSING) -> int:
        """Take ``kb`` out; its size (``default`` if it is not here, else ``KeyError``)."""
        if kb not in self._parents:
            if default is _MISSING:
                raise KeyError(kb)
            return default  # type: ignore[return-value]
        self._unlink(kb)
        return self._lru.pop(kb)

    def move_to_end(self, kb: bytes, last: bool = True) -> None:
        """The most recently used of its kind (``last=False``: the least)."""
        self._lru.move_to_end(kb, last)

    # ------------------------------------------------------------------ the order

    def first(self, keep: bytes | None = None) -> bytes | None:
        """The key evicted next, other than ``keep`` and none that matters more than it
        (None if there is no such key), after refiling the keys filed as chain ends
        that have a child."""
        lru, children = self._lru, self._children
        floor = None if keep is None else lru.priority(keep) >> 1
        while True:
            kb = lru.first()
            if kb is not None and kb == keep:  # the put's own record: the one after it
                kb = next(itertools.islice(lru, 1, None), None)
            if kb is None:
                return None
            level = lru.priority(kb)
            if level & 1 and kb[DIGEST_SIZE:] in children:  # its chain went on since it was filed
                lru.set(kb, lru[kb], level - 1)
                continue
            return None if floor is not None and level >> 1 < floor else kb

    def scan(self) -> Iterator[bytes]:
        """Every key, in eviction order as far as one pass can tell it, for a caller that
        skips some and takes others out as it goes: priority by priority, first the keys
        with no child here, each followed by its parent once the caller took the key (the
        chain's end then), then the others left."""
        order = [(kb, self._lru.priority(kb) >> 1) for kb in self._lru]
        for priority, group in itertools.groupby(order, key=operator.itemgetter(1)):
            keys = [kb for kb, _ in group]
            for kb in keys:
                while kb in self._parents and not self.has_child(kb):
                    parent_hash = self._parents[kb]
                    yield kb
                    if kb in self._parents or parent_hash is None:
                        break  # skipped, so its parent keeps a child; or the chain's start
                    kb = kb[:DIGEST_SIZE] + parent_hash
                    if kb in self._parents and self.priority(kb) != priority:
                        break  # a parent that matters more (or less) comes in its own turn
            yield from (kb for kb in keys if kb in self._parents)

    def weight_evicted_before(self, priority: int) -> int:
        """The total size of the records a newcomer of ``priority`` would be evicted after:
        every record of that priority or a higher value."""
        return self._lru.weight_evicted_before(2 * priority)

    # ------------------------------------------------------------------ lookups

    def priority(self, kb: bytes) -> int:
        return self._lru.priority(kb) >> 1

    def has_child(self, kb: bytes) -> bool:
        """Whether a key here names ``kb``'s block as its parent."""
        return kb[DIGEST_SIZE:] in self._children

    def parent_hash(self, kb: bytes) -> bytes | None:
        """The parent hash ``kb`` was put with (None for a root, or when not known)."""
        return self._parents.get(kb)

    def get(self, kb: bytes, default: int | None = None) -> int | None:
        return self._lru.get(kb, default)

    def __getitem__(self, kb: bytes) -> int:
        return self._lru[kb]

    def __contains__(self, kb: object) -> bool:
        return kb in self._parents

    def contains_many(self, kbs: Iterable[bytes]) -> list[bool]:
        return list(map(self._parents.__contains__, kbs))

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def removals(self) -> int:
        """Keys that left (see :attr:`PriorityLru.removals`): a refiling is no removal."""
        return self._lru.removals
