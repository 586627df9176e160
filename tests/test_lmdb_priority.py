"""The disk tier's eviction order with priorities: the highest value first, least recently
accessed first within one; a put never evicts records that matter more than its own."""
from __future__ import annotations

import errno
import hashlib
import json
import random
from pathlib import Path

import pytest
import torch

from lmdb_testing import write_old_version
from storage.base import BlockKey
from storage.lmdb_store import DESCRIPTOR_NAME, STORE_VERSION, LmdbStore
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


# ---------------------------------------------------------------- priorities on disk


GOLD, BATCH = -1, 5


def priorities(s: LmdbStore) -> dict[BlockKey, int]:
    return {m.key: m.priority for m in s.metadata()}


def fill(tmp_path: Path) -> Path:
    """A store with room for 4 records: two gold ones, then (more recently) two batch ones."""
    with store(tmp_path, []) as s:
        assert s.put_many(
            [(key(i), record(i)) for i in range(4)], priorities=[GOLD, GOLD, BATCH, BATCH]
        ) == [True] * 4
    return tmp_path / "store"


def test_priorities_survive_a_restart(tmp_path: Path):
    path = fill(tmp_path)
    with LmdbStore(path, sync=False) as s:
        assert s.get(key(2)) is not None and s.get(key(3)) is not None  # batch: most recent
    evicted: list[BlockKey] = []
    with LmdbStore(path, sync=False, on_evict=evicted.append) as s:
        assert priorities(s) == {key(0): GOLD, key(1): GOLD, key(2): BATCH, key(3): BATCH}
        assert not s.put(key(4), record(4), priority=BATCH + 1)  # everything matters more
        assert s.put_many([(key(4), record(4)), (key(5), record(5))]) == [True, True]
        assert evicted == [key(2), key(3)]
        s.flush()
        assert sorted(s.keys()) == sorted(key(i) for i in (0, 1, 4, 5))


def test_a_record_put_again_keeps_its_latest_priority(tmp_path: Path):
    path = fill(tmp_path)
    with LmdbStore(path, sync=False) as s:
        assert s.put(key(0), record(0), priority=BATCH + 1)  # demoted by another tenant
        assert s.put(key(2), record(2), priority=GOLD)  # promoted
    evicted: list[BlockKey] = []
    with LmdbStore(path, sync=False, on_evict=evicted.append) as s:
        assert priorities(s) == {key(0): BATCH + 1, key(1): GOLD, key(2): GOLD, key(3): BATCH}
        assert s.put_many([(key(4), record(4)), (key(5), record(5))]) == [True, True]
        assert evicted == [key(0), key(3)]


def test_a_version_1_store_opens_as_it_is_at_priority_0(tmp_path: Path):
    path = fill(tmp_path)
    write_old_version(path, 1)
    with LmdbStore(path, readonly=True) as reader:
        assert set(priorities(reader).values()) == {0}
        assert reader.get(key(0)) == record(0)
    evicted: list[BlockKey] = []
    with LmdbStore(path, sync=False, on_evict=evicted.append) as s:
        assert s.descriptor.version == STORE_VERSION == 3
        assert [s.get(key(i)) for i in range(4)] == [record(i) for i in range(4)]
        assert set(priorities(s).values()) == {0}
        assert not s.put(key(4), record(4), priority=1)  # the old records count as 0
        assert s.put(key(4), record(4), priority=0)
        assert evicted == [key(0)]  # the least recently used of them
    assert json.loads((path / DESCRIPTOR_NAME).read_text())["version"] == 3


def test_a_priority_the_meta_db_cannot_hold_is_refused(tmp_path: Path):
    with store(tmp_path, []) as s:
        for bad in (1 << 63, -(1 << 63) - 1):
            with pytest.raises(ValueError, match="64 bits"):
                s.put(key(0), record(0), priority=bad)
        assert not s.contains(key(0))


def test_compaction_keeps_priorities(tmp_path: Path):
    path = fill(tmp_path)
    expected = {key(0): GOLD, key(1): GOLD, key(2): BATCH, key(3): BATCH}
    with LmdbStore(path, readonly=True) as reader:
        reader.copy_compacted(tmp_path / "copy")
    LmdbStore(path).compact_and_close()
    for compacted in (tmp_path / "copy", path):
        with LmdbStore(compacted, sync=False) as s:
            assert priorities(s) == expected


def test_repair_keeps_priorities_and_a_smaller_budget_keeps_what_matters_most(tmp_path: Path):
    path = fill(tmp_path)
    with LmdbStore(path, sync=False) as s:
        budget = s.capacity_bytes // 2
        assert s.get(key(2)) is not None and s.get(key(3)) is not None
    result = LmdbStore.repair(path, tmp_path / "fixed")
    assert (result.salvaged, result.skipped, result.evicted) == (4, 0, 0)
    with LmdbStore(tmp_path / "fixed", sync=False) as fixed:
        assert priorities(fixed) == {key(0): GOLD, key(1): GOLD, key(2): BATCH, key(3): BATCH}
    result = LmdbStore.repair(path, tmp_path / "smaller", capacity_bytes=budget)
    assert (result.salvaged, result.skipped, result.evicted) == (4, 0, 2)
    with LmdbStore(tmp_path / "smaller", readonly=True) as smaller:
        assert sorted(smaller.keys()) == sorted([key(0), key(1)])


def test_repair_of_a_store_without_meta_pages_still_finds_priorities(tmp_path: Path):
    path = fill(tmp_path)
    data = bytearray((path / "data.mdb").read_bytes())
    data[16:20] = data[4096 + 16 : 4096 + 20] = bytes(4)  # both meta pages' magic numbers
    (path / "data.mdb").write_bytes(bytes(data))
    result = LmdbStore.repair(path, tmp_path / "fixed")
    assert result.salvaged == 4 and any("scanning" in problem for problem in result.problems)
    with LmdbStore(tmp_path / "fixed", sync=False) as fixed:
        assert priorities(fixed) == {key(0): GOLD, key(1): GOLD, key(2): BATCH, key(3): BATCH}


def test_an_eviction_undone_after_a_failed_commit_keeps_its_priority(tmp_path: Path, monkeypatch):
    from lmdb_testing import FailingDisk, disk_error

    evicted: list[BlockKey] = []
    with store(tmp_path, evicted) as s:
        assert s.put_many(
            [(key(i), record(i)) for i in range(4)], priorities=[GOLD, GOLD, BATCH, BATCH]
        ) == [True] * 4
        assert s.flush()
        disk = FailingDisk(s, monkeypatch, disk_error(errno.EIO), room=None)
        assert s.put(key(4), record(4), priority=GOLD)  # evicts 2; evicting 3 too fails
        assert s.flush(timeout=10) is False and s.degraded
        assert evicted == [key(2), key(4)]  # 4 could not be written
        disk.room = 1 << 30
        assert s.put(key(5), record(5), priority=BATCH)
        assert s.put(key(6), record(6), priority=BATCH)  # 3 is back, at its own priority
        assert evicted == [key(2), key(4), key(3)]
