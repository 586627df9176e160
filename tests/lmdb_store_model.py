"""The reference model of the disk tier for ``tests/test_lmdb_store_model.py``.

:class:`StoreModel` is what an :class:`~storage.lmdb_store.LmdbStore` must hold after a
sequence of calls, written from the contract (``storage/base.py``, ``docs/disk_tier.md``),
not from the store's code: a dict of key -> the version last put, its size, priority and
parent, and an access order. Capacity: a put evicts the records of the highest priority
value first until the budget holds, never itself nor a record that matters more; a put
that could only make room by evicting what matters more is refused, as is a record larger
than ``max_record_bytes``.

Within one priority, records that end their chain (no record here names them as parent)
go before those with a child, the least recently used first within each kind, as
``storage/lmdb_eviction.py`` states it: a put files its record as an end; one found with
a child when eviction comes to it is refiled as the most recent with one; a record whose
last child leaves, filed as having one, becomes the first end to go; an open files every
record as its children say. Blocks form chains of :data:`CHAIN` in one namespace, and a
version of a block may name another parent, or none (:meth:`Blocks.parent`).

The model knows the access order exactly while only the test's own thread reads
(``order_known``). Reader threads move keys it cannot follow: until it learns the order
again from the store's metadata, it checks only that each eviction is a legal one (the
highest priority present). A map that fills up evicts on the writer thread at moments no
model can tell (``exact=False``): then any key may vanish, but a key that is served is
served as last put, and one seen gone stays gone until it is put again.

Every version of a block has its own content (:class:`Blocks`), so a stale or foreign
value is never mistaken for the right one.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import random
from collections import Counter
from pathlib import Path

import torch

from storage.base import BlockKey
from storage.lmdb_layout import DATA_NAME
from storage.record import Record, encode_record
from storage.seal import SealKey

NAMESPACES = (hashlib.sha256(b"model ns a").digest(), hashlib.sha256(b"model ns b").digest())
CHAIN = 4  # blocks k // CHAIN form a chain, in one namespace
_SIZE_KEY = SealKey(b"only measures encoded sizes, 32 bytes")


def block_key(k: int) -> BlockKey:
    return BlockKey(
        NAMESPACES[k // CHAIN % 2], hashlib.sha256(f"model block {k}".encode()).digest()
    )


class Blocks:
    """The record of each version ``gen`` of a block: its key, size and content."""

    def __init__(self) -> None:
        self._gens = itertools.count(1)
        self._made: dict[int, tuple[int, int]] = {}  # gen -> (block, payload size)

    def new(self, k: int, size: int) -> int:
        gen = next(self._gens)
        self._made[gen] = (k, size)
        return gen

    @property
    def next_gen(self) -> int:
        """Newer than every version made so far."""
        return len(self._made) + 1

    def block(self, gen: int) -> int:
        return self._made[gen][0]

    def parent(self, gen: int) -> int | None:
        """The block version ``gen`` names as parent: the one before it in its chain; for a
        chain's last block, in every other version, the one before that (a branch); none
        for a chain's first block, and in every fifth version (put again without one)."""
        k = self.block(gen)
        if k % CHAIN == 0 or gen % 5 == 0:
            return None
        return k - 2 if k % CHAIN == CHAIN - 1 and gen % 2 else k - 1

    def record(self, gen: int) -> Record:
        k, size = self._made[gen]
        parent = self.parent(gen)
        return Record(
            key=block_key(k), parent_hash=None if parent is None else block_key(parent).block_hash,
            token_ids=(gen, k, size), codec="raw",
            dtype=torch.uint8, shape=(size,), payload=random.Random(gen).randbytes(size),
            created_ns=1_000 + gen,
        )

    def nbytes(self, gen: int) -> int:
        return len(encode_record(self.record(gen), _SIZE_KEY))

    def gen_of(self, k: int, record: Record) -> int:
        """The version ``record`` is, checked byte for byte; AssertionError if none is."""
        gen = record.token_ids[0] if record.token_ids else 0
        assert gen in self._made and self.block(gen) == k, f"block {k} served {record.token_ids}"
        want = self.record(gen)
        assert record.key == want.key and record.shape == want.shape, f"block {k} v{gen}"
        assert bytes(record.payload) == bytes(want.payload), f"block {k} v{gen}: wrong payload"
        assert record.created_ns == want.created_ns and record.token_ids == want.token_ids
        return gen


@dataclasses.dataclass
class Entry:
    gen: int
    nbytes: int
    priority: int
    pos: int  # in the access order: larger is more recent
    parent: int | None = None
    poisoned: bool = False  # its bytes on disk were damaged behind the store's back
    end: bool = True  # filed as a chain's end (it may have got a child since)
    rank: int = 0  # in the order of its kind: smaller goes first


class StoreModel:
    def __init__(self, capacity: int, max_record_bytes: int, *, exact: bool) -> None:
        self.capacity = capacity
        self.max_record_bytes = max_record_bytes
        self.exact = exact
        self.order_known = exact
        self.entries: dict[int, Entry] = {}
        self.counts: Counter[str] = Counter()  # the store's counters since it opened
        self._clock = itertools.count()

    @property
    def used(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def has_child(self, k: int) -> bool:
        return any(e.parent == k for e in self.entries.values())

    def next_victim(self, keep: int | None = None) -> int | None:
        """The block evicted next, other than ``keep`` and none that matters more than it;
        the records filed as ends found with a child on the way are refiled."""
        while True:
            others = [k for k in self.entries if k != keep]
            if not others:
                return None
            k = min(others, key=lambda k: (
                -self.entries[k].priority, not self.entries[k].end, self.entries[k].rank
            ))
            entry = self.entries[k]
            if entry.end and self.has_child(k):
                entry.end, entry.rank = False, next(self._clock)
                continue
            if keep is not None and entry.priority < self.entries[keep].priority:
                return None
            return k

    def remove(self, k: int) -> Entry | None:
        """``k`` leaves (evicted, deleted, quarantined); its entry, if it was here."""
        entry = self.entries.pop(k, None)
        if entry is not None:
            self.orphaned(entry.parent)
        return entry

    def orphaned(self, k: int | None) -> None:
        """``k`` may have lost its last child: filed as having one, it is the first end now."""
        entry = self.entries.get(k) if k is not None else None
        if entry is not None and not entry.end and not self.has_child(k):
            entry.end, entry.rank = True, -next(self._clock)

    def touch(self, k: int) -> None:
        self.entries[k].pos = self.entries[k].rank = next(self._clock)

    # ------------------------------------------------------------------ puts

    def admits(self, k: int, nbytes: int, priority: int) -> bool:
        """Whether the store must accept a put of ``nbytes`` under ``k`` at ``priority``."""
        if nbytes > self.max_record_bytes:
            return False
        free = self.capacity - self.used
        if nbytes <= free:
            return True
        old = self.entries.get(k)
        room = free + sum(e.nbytes for e in self.entries.values() if e.priority >= priority)
        if old is not None and old.priority < priority:
            room += old.nbytes
        return nbytes <= room

    def put(self, k: int, gen: int, nbytes: int, priority: int, parent: int | None) -> None:
        """Store a put (as a chain's end, the most recent), without evicting."""
        now = next(self._clock)
        old = self.entries.get(k)
        self.entries[k] = Entry(gen, nbytes, priority, now, parent, rank=now)
        if old is not None and old.parent != parent:
            self.orphaned(old.parent)

    def accept(
        self, k: int, gen: int, nbytes: int, priority: int, parent: int | None,
        victims: list[int],
    ) -> list[int]:
        """Store an accepted put and evict to the budget. With the order known, returns the
        victims the model chooses; else consumes from ``victims`` (what the store evicted,
        in order) the ones this put took, each checked to be a legal choice."""
        self.put(k, gen, nbytes, priority, parent)
        self.counts["puts"] += 1
        chosen = []
        while self.used > self.capacity:
            if self.order_known:
                victim = self.next_victim(keep=k)
                if victim is None:
                    break  # as the store does; the budget check then fails
            else:
                assert victims, f"a put of block {k} left {self.used} > {self.capacity} bytes"
                victim = victims.pop(0)
                self.check_legal(victim, k)
            self.remove(victim)
            self.counts["evictions"] += 1
            chosen.append(victim)
        return chosen

    def check_legal(self, victim: int, keep: int) -> None:
        """Whether the store may evict ``victim`` for a put of ``keep`` while the access
        order is not known: of the highest priority value, and a chain's end if any other
        record of that priority is one."""
        assert victim != keep and victim in self.entries, f"block {victim} evicted for {keep}"
        others = {k: e for k, e in self.entries.items() if k != keep}
        top = max(e.priority for e in others.values())
        assert self.entries[victim].priority == top, f"block {victim} evicted out of order"
        if self.has_child(victim):
            ends = [k for k, e in others.items() if e.priority == top and not self.has_child(k)]
            assert not ends, f"block {victim} evicted before the chain ends {ends}"

    def refuse(self) -> None:
        self.counts["dropped"] += 1

    # ------------------------------------------------------------------ reads and deletes

    def read(self, ks: list[int]) -> list[int | None]:
        """The versions a ``get_many(ks)`` must return; hits become the most recent (in
        the order asked), poisoned records are misses and leave the store."""
        found: list[int | None] = []
        quarantined: set[int] = set()  # a key asked twice fails twice: it was read twice
        for k in ks:
            entry = self.entries.get(k)
            if entry is None or entry.poisoned:
                self.counts["misses"] += 1
                if entry is not None:
                    self.remove(k)
                    quarantined.add(k)
                self.counts["corrupt"] += k in quarantined
                found.append(None)
                continue
            self.counts["hits"] += 1
            self.counts["bytes_read"] += entry.nbytes
            self.touch(k)
            found.append(entry.gen)
        return found

    def delete(self, ks: list[int]) -> int:
        return sum(self.remove(k) is not None for k in ks)

    # ------------------------------------------------------------------ reopening

    def reopen(
        self, capacity: int, max_record_bytes: int,
        metadata: dict[int, tuple[int, int, int, bytes | None]],
    ) -> list[int]:
        """The store was closed and opened again: check what its ``meta`` db says (block ->
        last access ns, size, priority, parent hash) and take its access order, file each
        record as its children say, then evict to a smaller budget as the open does.
        Returns the keys the open must have evicted."""
        assert sorted(metadata) == sorted(self.entries), "the reopened store holds other keys"
        for k, (_, nbytes, priority, parent_hash) in metadata.items():
            entry = self.entries[k]
            parent = None if entry.parent is None else block_key(entry.parent).block_hash
            assert (nbytes, priority, parent_hash) == (entry.nbytes, entry.priority, parent), (
                f"block {k}'s metadata"
            )
        if self.order_known:  # an access the model knows as later was stored as later
            by_access = sorted(self.entries, key=lambda k: self.entries[k].pos)
            times = [metadata[k][0] for k in by_access]
            assert times == sorted(times), "the access order did not survive reopening"
        for k in sorted(metadata, key=lambda k: (metadata[k][0], block_key(k).to_bytes())):
            self.touch(k)
        for k, entry in self.entries.items():
            entry.end = not self.has_child(k)
        self.capacity, self.max_record_bytes = capacity, max_record_bytes
        self.order_known = self.exact
        self.counts.clear()
        evicted = []
        while self.used > self.capacity:
            victim = self.next_victim()
            self.remove(victim)
            self.counts["evictions"] += 1
            evicted.append(victim)
        return evicted


# ---------------------------------------------------------------------- the data file


def damage_record(path: Path, stored: bytes) -> int:
    """Flip a byte in the middle of every copy of ``stored`` (a record's bytes as
    committed) in ``path``'s ``data.mdb``: the live one, and any copy LMDB left in pages it
    freed. Returns how many copies there were."""
    data_file = path / DATA_NAME
    data = data_file.read_bytes()
    copies = 0
    with data_file.open("r+b") as f:
        at = data.find(stored)
        while at >= 0:
            where = at + len(stored) // 2
            f.seek(where)
            f.write(bytes([data[where] ^ 0x5A]))
            copies += 1
            at = data.find(stored, at + 1)
    return copies
