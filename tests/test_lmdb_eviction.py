"""The disk tier's eviction order: by priority, chain ends first, LRU within each; kept
across a reopening and by every path that removes a record."""
from __future__ import annotations

import errno
import hashlib
import random
from pathlib import Path

import lmdb
import pytest
import torch

from lmdb_testing import FailingDisk, corrupt_stored, disk_error, flip, write_old_version
from storage.base import BlockKey
from storage.lmdb_eviction import ChainLru
from storage.lmdb_store import LmdbStore
from storage.record import Record

NS = hashlib.sha256(b"chain namespace").digest()


def block_hash(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def kb(name: str) -> bytes:
    return NS + block_hash(name)


def parent_of(name: str) -> bytes | None:
    """``"a2"``'s parent is ``"a1"``; ``"a0"`` is a chain's first block."""
    position = int(name[1:])
    return block_hash(f"{name[0]}{position - 1}") if position else None


def chain(prefix: str, length: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(length)]


def filled(*chains: list[str], priority: int = 0) -> ChainLru:
    lru = ChainLru()
    for names in chains:
        for name in names:
            lru.set(kb(name), 1, priority, parent_of(name))
    return lru


def drain(lru: ChainLru) -> list[str]:
    """Evict everything; the names in the order evicted."""
    names = {kb(f"{p}{i}"): f"{p}{i}" for p in "abxyz" for i in range(10)}
    order = []
    while (victim := lru.first()) is not None:
        lru.pop(victim)
        order.append(names[victim])
    return order


def evict_one(lru: ChainLru) -> str:
    """Evict the first key; its name."""
    victim = lru.first()
    lru.pop(victim)
    return next(n for n in chain("a", 10) if kb(n) == victim)


# ---------------------------------------------------------------- the order


def test_a_chain_goes_from_its_end_and_its_parent_is_the_next_to_go():
    lru = filled(chain("a", 4), chain("b", 2))  # a0 the least recently used
    assert drain(lru) == ["a3", "a2", "a1", "a0", "b1", "b0"]


def test_a_read_end_stays_longer_and_its_chain_with_it():
    lru = filled(chain("a", 4), chain("b", 2))
    lru.move_to_end(kb("a3"))  # a lookup reads a chain from its start: its end last
    assert drain(lru) == ["b1", "b0", "a3", "a2", "a1", "a0"]


def test_priority_comes_before_the_chain():
    lru = ChainLru()
    lru.set(kb("x0"), 1, 5, None)  # a block of a tenant that matters less
    lru.set(kb("x1"), 1, 0, parent_of("x1"))  # its child, of one that matters more
    lru.set(kb("y0"), 1, 0, None)
    assert drain(lru) == ["x0", "x1", "y0"]


def test_a_put_never_evicts_itself_nor_what_matters_more():
    lru = ChainLru()
    lru.set(kb("x0"), 1, 5, None)
    lru.set(kb("x1"), 1, 0, parent_of("x1"))
    lru.set(kb("y0"), 1, 5, None)  # the put: a chain's end, x0 has a child
    assert lru.first(keep=kb("y0")) == kb("x0") and lru.first() == kb("y0")
    lru.pop(kb("x0"))
    assert lru.first(keep=kb("y0")) is None  # only x1, which matters more, is left


def test_a_record_put_again_with_another_parent_leaves_the_old_one_an_end():
    lru = filled(chain("a", 3))
    assert evict_one(lru) == "a2"  # a0 and a1 refiled as having a child
    lru.set_many([kb("a1"), kb("a1")], [1, 1], [0, 0], [None, parent_of("a1")])  # twice
    assert lru.has_child(kb("a0"))
    lru.set(kb("a1"), 1, 0, None)  # now a root: a0 ends its chain, the first end to go
    assert not lru.has_child(kb("a0")) and lru.first() == kb("a0")


def test_built_from_the_meta_db_each_record_is_filed_as_its_children_say():
    # least recently used first: the chain's end a1 was used after its start a0
    names = ["a0", "b0", "a1"]
    lru = ChainLru.build([kb(n) for n in names], [1] * 3, [0] * 3, [parent_of(n) for n in names])
    assert drain(lru) == ["b0", "a1", "a0"]


def test_a_scan_takes_ends_first_and_a_parent_once_its_children_are_taken():
    lru = filled(chain("a", 3), chain("b", 2))
    lru.set(kb("z0"), 1, 7, None)  # a higher value: first whatever its place
    taken = []
    for victim in lru.scan():
        if victim == kb("b1"):
            continue  # a caller's skip (a key with a pending operation)
        lru.pop(victim)
        taken.append(victim)
    names = {kb(n): n for n in chain("a", 3) + chain("b", 2) + ["z0"]}
    assert [names[k] for k in taken] == ["z0", "a2", "a1", "a0", "b0"]


# ---------------------------------------------------------------- the store


def record(name: str, size: int = 1000) -> Record:
    return Record(
        key=BlockKey(NS, block_hash(name)), parent_hash=parent_of(name),
        token_ids=tuple(range(16)), codec="raw", dtype=torch.uint8, shape=(size,),
        payload=random.Random(name).randbytes(size), created_ns=1_000,
    )


def put_chain(store: LmdbStore, names: list[str]) -> list[bool]:
    return store.put_many([(record(n).key, record(n)) for n in names])


def hit(store: LmdbStore, names: list[str]) -> int:
    """The blocks of ``names`` a prefix lookup finds."""
    return store.longest_prefix([record(n).key for n in names])


def nbytes(tmp_path: Path) -> int:
    """A record's stored size."""
    with LmdbStore(tmp_path / "probe", 1 << 20, sync=False) as probe:
        probe.put(record("a0").key, record("a0"))
        return probe.stats().bytes_used


@pytest.mark.parametrize("reopen", [False, True])
def test_a_chain_partly_evicted_from_disk_still_hits_its_start(tmp_path: Path, reopen: bool):
    """A store full of one chain, read from its start as a lookup reads it; another chain's
    puts evict the first one's end (plain LRU took its start, and left nothing to hit)."""
    path, evicted = tmp_path / "store", []
    store = LmdbStore(path, 8 * nbytes(tmp_path), sync=False, on_evict=evicted.append)
    assert all(put_chain(store, chain("a", 8)))
    assert all(r is not None for r in store.get_many([record(n).key for n in chain("a", 8)]))
    if reopen:  # the order comes back from the meta db
        store.close()
        store = LmdbStore(path, sync=False, on_evict=evicted.append)
    with store:
        assert all(put_chain(store, chain("b", 4)))
        assert evicted == [record(n).key for n in ("a7", "a6", "a5", "a4")]
        assert hit(store, chain("a", 8)) == 4 and hit(store, chain("b", 4)) == 4


def test_parents_survive_a_reopening_in_the_metadata(tmp_path: Path):
    with LmdbStore(tmp_path / "store", 1 << 20, sync=False) as store:
        put_chain(store, chain("a", 3))
    with LmdbStore(tmp_path / "store", readonly=True) as reader:
        parents = {m.key: m.parent_hash for m in reader.metadata()}
    assert parents == {record(n).key: parent_of(n) for n in chain("a", 3)}


@pytest.mark.parametrize("removal", ["delete", "quarantine"])
def test_a_removed_end_leaves_its_parent_the_chains_end(tmp_path: Path, removal: str):
    path, evicted = tmp_path / "store", []
    capacity = 6 * nbytes(tmp_path)
    with LmdbStore(path, capacity, sync=False) as store:
        put_chain(store, chain("a", 4) + chain("b", 2))
        for name in chain("a", 4) + chain("b", 2):  # a0 the least recently used
            assert store.get(record(name).key) is not None
    if removal == "quarantine":
        corrupt_stored(path, record("a3").key, flip)
    with LmdbStore(path, sync=False, on_evict=evicted.append) as store:
        if removal == "delete":
            assert store.delete(record("a3").key)
        else:
            assert store.get(record("a3").key) is None and evicted == [record("a3").key]
            evicted.clear()
        put_chain(store, chain("x", 2))
        assert evicted == [record("a2").key]  # not b1: a2 has no child now


def test_recovery_from_a_full_disk_evicts_chain_ends_first(tmp_path: Path, monkeypatch):
    evicted = []
    with LmdbStore(tmp_path / "store", 1 << 20, sync=False, on_evict=evicted.append) as store:
        put_chain(store, chain("a", 4))
        assert store.flush()
        disk = FailingDisk(store, monkeypatch, disk_error(errno.ENOSPC), room=None)
        disk.room = disk.on_disk  # full: a put fits once a record of its size is gone
        put_chain(store, ["x0"])
        assert store.flush(timeout=10)
        assert evicted == [record("a3").key] and hit(store, chain("a", 4)) == 3


def test_metadata_rebuilt_from_the_records_takes_each_parent_from_its_header(tmp_path: Path):
    """A crash between the two dbs (here: the meta db emptied): the rebuilt metadata names
    each record's parent, so the chain still goes from its end."""
    path, evicted = tmp_path / "store", []
    with LmdbStore(path, 1 << 20, sync=False) as store:
        put_chain(store, chain("a", 4))
    env = lmdb.open(str(path), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(b"meta", txn=txn), delete=False)
    env.close()
    with LmdbStore(path, 4 * nbytes(tmp_path), sync=False, on_evict=evicted.append) as store:
        assert {m.key: m.parent_hash for m in store.metadata()} == {
            record(n).key: parent_of(n) for n in chain("a", 4)
        }
        put_chain(store, ["x0"])
        assert evicted == [record("a3").key]


@pytest.mark.parametrize("version", [1, 2])
def test_an_older_store_opened_for_writing_names_each_parent_and_evicts_chain_ends(
    tmp_path: Path, version: int, caplog
):
    """A store of version 1 or 2 (meta values without a parent) is upgraded by its first
    open for writing: each parent is read from its record's header, the access order and
    the priorities are kept, and from then on its chains go from their ends."""
    path, evicted = tmp_path / "store", []
    with LmdbStore(path, 1 << 20, sync=False) as store:
        put_chain(store, chain("a", 4))
        for name in chain("a", 4):  # a0 the least recently used
            assert store.get(record(name).key) is not None
        before = {m.key: m for m in store.metadata()}
    write_old_version(path, version)
    with LmdbStore(path, readonly=True) as reader:  # a reader takes the store as it is
        assert {m.parent_hash for m in reader.metadata()} == {None}
    with caplog.at_level("INFO", logger="storage"):
        store = LmdbStore(path, 4 * nbytes(tmp_path), sync=False, on_evict=evicted.append)
    assert "metadata of 4 records now names their parents" in caplog.text
    with store:
        assert store.descriptor.version == 3
        after = {m.key: m for m in store.metadata()}
        assert {k: m.parent_hash for k, m in after.items()} == {
            record(n).key: parent_of(n) for n in chain("a", 4)
        }
        assert all(after[k].last_access_ns == m.last_access_ns for k, m in before.items())
        assert all(after[k].nbytes == m.nbytes and after[k].created_ns == m.created_ns
                   for k, m in before.items())
        put_chain(store, ["x0"])
        assert evicted == [record("a3").key]  # the chain's end, not a0 (its LRU start)
    caplog.clear()
    with caplog.at_level("INFO", logger="storage"), LmdbStore(path, sync=False):
        pass
    assert "now names their parents" not in caplog.text  # once


def test_an_upgrade_keeps_each_records_priority_and_leaves_an_unreadable_header_parentless(
    tmp_path: Path,
):
    path = tmp_path / "store"
    with LmdbStore(path, 1 << 20, sync=False) as store:
        assert store.put(record("a0").key, record("a0"), priority=5)
        put_chain(store, ["a1", "b0"])
    write_old_version(path, 2)
    env = lmdb.open(str(path), max_dbs=4)
    with env.begin(write=True) as txn:  # a header that is no record's: no parent to read
        records = env.open_db(b"records", txn=txn)
        txn.put(kb("a1"), b"\0" * 64, db=records)
    env.close()
    with LmdbStore(path, sync=False) as store:
        meta = {m.key: m for m in store.metadata()}
    assert meta[record("a0").key].priority == 5 and meta[record("b0").key].priority == 0
    assert meta[record("a1").key].parent_hash is None
