"""The disk tier's eviction order with priorities: the highest value first, least recently
accessed first within one; a put never evicts records that matter more than its own."""
from __future__ import annotations

import hashlib
import random
from pathlib import Path

import torch

from storage.base import BlockKey
from storage.lmdb_store import LmdbStore
from storage.record import Record

NS = hashlib.sha256(b"priority namespace").digest()


def key(i: int) -> BlockKey:
    return BlockKey(NS, hashlib.sha256(i.to_bytes(8, "little")).digest())


def record(i: int, size: int = 1000) -> Record:
    return Record(
        key=key(i), parent_hash=None, token_ids=tuple(range(i, i + 16)), codec="raw",
        dtype=torch.uint8, shape=(size,), payload=random.Random(i).randbytes(size),
        created_ns=1_000 + i,
    )


def store(tmp_path: Path, evicted: list[BlockKey], blocks: int = 4) -> LmdbStore:
    """A store with room for ``blocks`` records (their stored size measured first)."""
    probe = LmdbStore(tmp_path / "probe", 1 << 20, sync=False)
    probe.put(key(0), record(0))
    nbytes = probe.stats().bytes_used
    probe.close()
    return LmdbStore(tmp_path / "store", blocks * nbytes, sync=False, on_evict=evicted.append)


def test_the_highest_priority_value_goes_first_then_the_least_recent(tmp_path: Path):
    evicted: list[BlockKey] = []
    with store(tmp_path, evicted) as s:
        for i, priority in enumerate([5, 0, -1, 5]):
            assert s.put(key(i), record(i), priority=priority)
        s.get(key(0))  # 0 is now the more recent of the two at 5
        for i in (4, 5, 6):
            assert s.put(key(i), record(i))
        assert evicted == [key(3), key(0), key(1)]
        s.flush()
        assert sorted(s.keys()) == sorted(key(i) for i in (2, 4, 5, 6))
        assert s.stats().evictions == 3


def test_a_put_that_would_evict_what_matters_more_is_refused(tmp_path: Path):
    evicted: list[BlockKey] = []
    with store(tmp_path, evicted, blocks=2) as s:
        assert s.put_many([(key(0), record(0)), (key(1), record(1))], priorities=[-1, 0]) == [
            True, True,
        ]
        assert s.put_many([(key(2), record(2))], priorities=[1]) == [False]
        assert evicted == [] and s.stats().dropped == 1 and not s.contains(key(2))
        assert s.put(key(1), record(1), priority=3)  # replaces itself: its own room
        assert s.put(key(3), record(3), priority=0)  # evicts 1, now at 3
        assert evicted == [key(1)]
        assert not s.put(key(4), record(4), priority=1)  # 0 and 3 both matter more
        assert s.put(key(4), record(4), priority=0)  # 3 matters as much: the older goes
        assert evicted == [key(1), key(3)]
        assert s.contains(key(0)) and s.contains(key(4))
