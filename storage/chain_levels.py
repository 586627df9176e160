"""Chain-end levels, shared by the CPU pool's eviction (:mod:`storage.cpu_eviction`) and the
disk tier's (:mod:`storage.lmdb_eviction`): in a :class:`~storage.priority_lru.PriorityLru`
a block sits at level ``2 * priority + 1`` while filed as its chain's end (no child here),
``2 * priority`` once filed as having one, so within a priority the ends go first. Children
are counted by their parent's block hash."""
from __future__ import annotations

from collections.abc import Hashable, MutableMapping

from storage.priority_lru import PriorityLru


def drop_child(children: MutableMapping[bytes, int], parent_hash: bytes) -> bool:
    """Count one child of ``parent_hash`` less; whether the parent has none left (it ends
    its chain now)."""
    left = children[parent_hash] - 1
    if left:
        children[parent_hash] = left
        return False
    del children[parent_hash]
    return True


def refile_as_end(lru: PriorityLru, parent: Hashable) -> None:
    """A block whose last child left: if it is filed as having one, it becomes a chain's end,
    the least recently used of its kind (it was used no later than its child). A block not
    here, or filed as an end already, stays as it is."""
    level = lru.get_priority(parent)
    if level is not None and not level & 1:
        lru.set(parent, lru[parent], level + 1)
        lru.move_to_end(parent, last=False)
