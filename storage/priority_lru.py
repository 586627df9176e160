"""An LRU order with priorities: what a tier evicts first.

Every key has a priority, an integer with the meaning a request's priority has: a lower
value matters more. The eviction order takes the keys of the highest value first, and
within one value the least recently used first::

    priority  10: [lru ... mru]  -> evicted first
    priority   0: [lru ... mru]
    priority  -5: [lru ... mru]  -> evicted last

Each key also has a weight (a record's size, or 1 for a slot), summed per priority so a
store can tell how much it could free for a newcomer without looking at every key.
:attr:`removals` counts the keys that left, so a store can tell that none did.
Lookups, updates and taking the first victim cost O(1) plus O(p) in the number ``p`` of
distinct priorities present (a handful of tenant classes). Not thread-safe: the owning
store's lock guards it.
"""
from __future__ import annotations

import bisect
import collections
import itertools
from collections.abc import Hashable, Iterable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
DEFAULT_PRIORITY = 0
_MISSING = object()


class PriorityLru(Generic[K]):
    """A mapping key -> weight whose iteration order is the eviction order."""

    def __init__(self) -> None:
        self._levels: dict[int, collections.OrderedDict[K, int]] = {}
        self._totals: dict[int, int] = {}
        self._order: list[int] = []  # the priorities present, ascending
        self._priority: dict[K, int] = {}
        # keys that left through pop, discard_many or clear (a set's update of a key is no
        # removal): while it stays the same, every key here before is still here
        self.removals = 0

    def set(self, key: K, weight: int, priority: int | None = None) -> None:
        """Insert or update ``key`` as the most recently used of its priority. ``None``
        keeps the priority the key has, or gives a new key the default one."""
        old = self._priority.get(key)
        if priority is None:
            priority = DEFAULT_PRIORITY if old is None else old
        if old is not None:
            self._unlink(key, old)
        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = collections.OrderedDict()
            self._totals[priority] = 0
            bisect.insort(self._order, priority)
        level[key] = weight
        self._totals[priority] += weight
        self._priority[key] = priority

    __setitem__ = set

    def set_many(self, items: Iterable[tuple[K, int]], weight: int) -> None:
        """:meth:`set` of each ``(key, priority)`` with one ``weight``, in order, as one
        call (a pool settles a request's blocks at once)."""
        items = list(items)
        self.set_weights([key for key, _ in items], itertools.repeat(weight),
                         [priority for _, priority in items])

    def set_weights(self, keys: Iterable[K], weights: Iterable[int], priorities: Iterable[int]) -> int:
        """:meth:`set` of each key with its own weight and priority, in order, as one call
        (a store indexes a group of puts at once); the total weight the keys had before."""
        levels, totals, known = self._levels, self._totals, self._priority
        replaced = 0
        for key, weight, priority in zip(keys, weights, priorities):
            old = known.get(key)
            if old is not None:
                replaced += self._unlink(key, old)
            level = levels.get(priority)
            if level is None:
                level = levels[priority] = collections.OrderedDict()
                totals[priority] = 0
                bisect.insort(self._order, priority)
            level[key] = weight
            totals[priority] += weight
            known[key] = priority
        return replaced

    def pop(self, key: K, default: object = _MISSING) -> int:
        priority = self._priority.get(key)
        if priority is None:
            if default is _MISSING:
                raise KeyError(key)
            return default  # type: ignore[return-value]
        self.removals += 1
        return self._unlink(key, priority)

    def _unlink(self, key: K, priority: int) -> int:
        """Take ``key`` (of ``priority``) out; its weight."""
        del self._priority[key]
        level = self._levels[priority]
        weight = level.pop(key)
        self._totals[priority] -= weight
        if not level:
            del self._levels[priority], self._totals[priority]
            self._order.remove(priority)
        return weight

    def discard_many(self, keys: Iterable[K]) -> None:
        """``pop(key, None)`` of each key, as one call."""
        levels, totals, priorities = self._levels, self._totals, self._priority
        for key in keys:
            priority = priorities.pop(key, None)
            if priority is None:
                continue
            self.removals += 1
            level = levels[priority]
            totals[priority] -= level.pop(key)
            if not level:
                del levels[priority], totals[priority]
                self._order.remove(priority)

    def move_to_end(self, key: K, last: bool = True) -> None:
        """Most recently used of its priority (``last=False``: least recently used)."""
        self._levels[self._priority[key]].move_to_end(key, last)

    def priority(self, key: K) -> int:
        return self._priority[key]

    def get_priority(self, key: K) -> int | None:
        """``key``'s priority, or None if it is not here."""
        return self._priority.get(key)

    def first(self) -> K | None:
        """The key evicted next, or None when empty."""
        if not self._order:
            return None
        return next(iter(self._levels[self._order[-1]]))

    def weight_evicted_before(self, priority: int) -> int:
        """The total weight of the keys a newcomer of ``priority`` would be evicted after:
        every key of that priority or a higher value."""
        start = bisect.bisect_left(self._order, priority)
        return sum(self._totals[p] for p in self._order[start:])

    def get(self, key: K, default: int | None = None) -> int | None:
        priority = self._priority.get(key)
        return default if priority is None else self._levels[priority][key]

    def __getitem__(self, key: K) -> int:
        return self._levels[self._priority[key]][key]

    def __contains__(self, key: object) -> bool:
        return key in self._priority

    def contains_many(self, keys: Iterable[K]) -> list[bool]:
        """``key in self`` of each key, as one call."""
        return list(map(self._priority.__contains__, keys))

    def __len__(self) -> int:
        return len(self._priority)

    def __bool__(self) -> bool:
        return bool(self._priority)

    def __iter__(self) -> Iterator[K]:
        """Keys in eviction order (do not change the mapping while iterating)."""
        for priority in reversed(self._order):
            yield from self._levels[priority]

    def values(self) -> Iterator[int]:
        for priority in reversed(self._order):
            yield from self._levels[priority].values()

    def clear(self) -> None:
        self.removals += len(self._priority)
        self._levels.clear()
        self._totals.clear()
        self._order.clear()
        self._priority.clear()
