"""The reference model of the disk tier for ``tests/test_lmdb_store_model.py``.

:class:`StoreModel` is what an :class:`~storage.lmdb_store.LmdbStore` must hold after a
sequence of calls, written from the contract (``storage/base.py``, ``docs/disk_tier.md``),
not from the store's code: a dict of key -> the version last put, its size and priority,
and an access order. Capacity: a put evicts the records of the highest priority value
first, the least recently accessed first within one, until the budget holds; a put that
could only make room by evicting what matters more is refused, as is a record larger than
``max_record_bytes``.

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
_SIZE_KEY = SealKey(b"only measures encoded sizes, 32 bytes")


def block_key(k: int) -> BlockKey:
    return BlockKey(NAMESPACES[k % 2], hashlib.sha256(f"model block {k}".encode()).digest())


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

    def record(self, gen: int) -> Record:
        k, size = self._made[gen]
        return Record(
            key=block_key(k), parent_hash=None, token_ids=(gen, k, size), codec="raw",
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
    poisoned: bool = False  # its bytes on disk were damaged behind the store's back


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

    def eviction_order(self) -> list[int]:
        return sorted(self.entries, key=lambda k: (-self.entries[k].priority, self.entries[k].pos))

    def touch(self, k: int) -> None:
        self.entries[k].pos = next(self._clock)

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

    def accept(self, k: int, gen: int, nbytes: int, priority: int, victims: list[int]) -> list[int]:
        """Store an accepted put and evict to the budget. With the order known, returns the
        victims the model chooses; else consumes from ``victims`` (what the store evicted,
        in order) the ones this put took, each checked to be a legal choice."""
        self.entries[k] = Entry(gen, nbytes, priority, next(self._clock))
        self.counts["puts"] += 1
        chosen = []
        while self.used > self.capacity:
            if self.order_known:
                victim = self.eviction_order()[0]
            else:
                assert victims, f"a put of block {k} left {self.used} > {self.capacity} bytes"
                victim = victims.pop(0)
                assert victim in self.entries, f"block {victim} evicted, but it was not stored"
                top = max(e.priority for e in self.entries.values())
                assert self.entries[victim].priority == top, f"block {victim} evicted out of order"
            if victim == k:
                break  # as the store does; the budget check then fails
            del self.entries[victim]
            self.counts["evictions"] += 1
            chosen.append(victim)
        return chosen

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
                    del self.entries[k]
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
        removed = 0
        for k in ks:
            removed += self.entries.pop(k, None) is not None
        return removed

    # ------------------------------------------------------------------ reopening

    def reopen(
        self, capacity: int, max_record_bytes: int, metadata: dict[int, tuple[int, int, int]]
    ) -> list[int]:
        """The store was closed and opened again: check what its ``meta`` db says (block ->
        last access ns, size, priority) and take its access order, then evict to a smaller
        budget as the open does. Returns the keys the open must have evicted."""
        assert sorted(metadata) == sorted(self.entries), "the reopened store holds other keys"
        for k, (_, nbytes, priority) in metadata.items():
            entry = self.entries[k]
            assert (nbytes, priority) == (entry.nbytes, entry.priority), f"block {k}'s metadata"
        if self.order_known:  # an access the model knows as later was stored as later
            by_access = sorted(self.entries, key=lambda k: self.entries[k].pos)
            times = [metadata[k][0] for k in by_access]
            assert times == sorted(times), "the access order did not survive reopening"
        for k in sorted(metadata, key=lambda k: (metadata[k][0], block_key(k).to_bytes())):
            self.touch(k)
        self.capacity, self.max_record_bytes = capacity, max_record_bytes
        self.order_known = self.exact
        self.counts.clear()
        evicted = []
        while self.used > self.capacity:
            victim = self.eviction_order()[0]
            del self.entries[victim]
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
