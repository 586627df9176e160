"""One contract, every tier: the checks from storage/base.py run against each block store,
the remote one on a single server and on a 3-node cluster."""
from __future__ import annotations

import hashlib
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from redis_server import redis_cluster  # noqa: F401  (fixture)
from remote_testing import ANSWER_S
from storage.base import BlockKey, BlockStore
from storage.cpu_pool import CpuBlockPool
from storage.cpu_slots import HostBlock
from storage.lmdb_store import LmdbStore
from storage.record import Record, encode_record
from storage.seal import SealKey
from storage.remote_store import RemoteStore

NS = hashlib.sha256(b"namespace-a").digest()
OTHER_NS = hashlib.sha256(b"namespace-b").digest()
SHAPE = (2, 2, 4, 2, 8)  # [L, 2, T, H, D]


def key(i: int, ns: bytes = NS) -> BlockKey:
    return BlockKey(ns, hashlib.sha256(f"block-{i}".encode()).digest())


def kv_tensor(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(SHAPE, generator=g).to(torch.float16)


@dataclass
class Tier:
    """A store under test, how to make its i-th value, and how to compare two values."""

    store: BlockStore
    make: Callable[[int], Any]
    same: Callable[[Any, Any], bool]
    evicts: bool = True  # whether the store itself keeps to a byte budget by LRU


def _host_block(i: int) -> HostBlock:
    return HostBlock(kv_tensor(i), _parent(i), (i, i + 1, i + 2))


def _parent(i: int) -> bytes | None:
    """Block ``i``'s parent: none of the blocks the tests store, so each is a chain's end."""
    return None if i == 0 else hashlib.sha256(b"parent %d" % i).digest()


def _same_host(a: HostBlock, b: HostBlock) -> bool:
    return torch.equal(a.kv, b.kv) and a.parent_hash == b.parent_hash and a.token_ids == b.token_ids


def _record(i: int) -> Record:
    return Record(
        key=key(i), parent_hash=_parent(i),
        token_ids=(i, i + 1, i + 2), codec="raw", dtype=torch.float16, shape=SHAPE,
        payload=kv_tensor(i).numpy().tobytes(), created_ns=1_700_000_000_000_000_000 + i,
    )


def _same_record(a: Record, b: Record) -> bool:
    return encode_record(a, TEST_KEY) == encode_record(b, TEST_KEY)


TEST_KEY = SealKey.generate()  # compares records as bytes
BLOCK_BYTES = kv_tensor(0).numel() * 2
RECORD_BYTES = _record(0).nbytes


def make_cpu(tmp_path, capacity_blocks: int) -> Tier:
    return Tier(CpuBlockPool(capacity_blocks * BLOCK_BYTES, pin_memory=False), _host_block, _same_host)


def make_disk(tmp_path, capacity_blocks: int) -> Tier:
    store = LmdbStore(tmp_path / "store", capacity_bytes=capacity_blocks * RECORD_BYTES, sync=False)
    return Tier(store, _record, _same_record)


def make_remote(tmp_path, capacity_blocks: int, url: str) -> Tier:
    # Capacity is the server's (maxmemory, allkeys-lru), not the store's: evicts=False.
    # Each store gets its own prefix, so tests sharing one server never see each other.
    # The server always answers here: a long deadline keeps a busy moment from being a drop.
    store = RemoteStore(url, prefix=f"tkv-test-{uuid.uuid4().hex}:", timeout_s=ANSWER_S,
                        stats_interval_s=0, seal_key=SealKey.generate())
    return Tier(store, _record, _same_record, evicts=False)


@pytest.fixture(params=["cpu", "disk", "remote", "remote-cluster"])
def tier_factory(request, tmp_path):
    made: list[Tier] = []
    if request.param.startswith("remote"):
        server = "redis_cluster" if request.param == "remote-cluster" else "redis_server"
        url = request.getfixturevalue(server).url
        make = lambda tmp, n: make_remote(tmp, n, url)  # noqa: E731
    else:
        make = {"cpu": make_cpu, "disk": make_disk}[request.param]

    def factory(capacity_blocks: int = 64) -> Tier:
        tier = make(tmp_path, capacity_blocks)
        made.append(tier)
        return tier

    yield factory
    for tier in made:
        tier.store.close()


def test_miss_on_empty(tier_factory):
    t = tier_factory()
    assert t.store.get(key(0)) is None
    assert not t.store.contains(key(0))
    assert key(0) not in t.store
    assert t.store.stats().misses >= 1
    assert t.store.stats().entries == 0


def test_put_is_visible_at_once_and_round_trips(tier_factory):
    t = tier_factory()
    assert t.store.put(key(3), t.make(3))
    assert t.store.contains(key(3))
    assert t.same(t.store.get(key(3)), t.make(3))
    s = t.store.stats()
    assert (s.hits, s.puts, s.entries) == (1, 1, 1)
    assert s.bytes_used > 0


def test_values_survive_flush(tier_factory):
    t = tier_factory()
    t.store.put_many((key(i), t.make(i)) for i in range(5))
    assert t.store.flush(timeout=30)
    assert all(t.same(t.store.get(key(i)), t.make(i)) for i in range(5))


def test_returned_value_is_caller_owned(tier_factory):
    t = tier_factory(capacity_blocks=2)
    t.store.put(key(0), t.make(0))
    got = t.store.get(key(0))
    snapshot = t.make(0)
    # Reuse every slot/page the store has: the returned value must not change.
    t.store.delete(key(0))
    for i in range(1, 6):
        t.store.put(key(i), t.make(i))
    t.store.flush(timeout=30)
    assert t.same(got, snapshot)


def test_put_twice_keeps_one_entry(tier_factory):
    t = tier_factory()
    t.store.put(key(1), t.make(1))
    t.store.put(key(1), t.make(1))
    t.store.flush(timeout=30)
    assert t.store.stats().entries == 1
    assert list(t.store.keys()) == [key(1)]


def test_delete(tier_factory):
    t = tier_factory()
    t.store.put(key(1), t.make(1))
    t.store.put(key(2), t.make(2))
    assert t.store.delete(key(1))
    assert not t.store.delete(key(1))
    assert t.store.get(key(1)) is None
    assert t.same(t.store.get(key(2)), t.make(2))
    t.store.flush(timeout=30)
    assert t.store.stats().entries == 1


def test_keys_by_namespace_without_duplicates(tier_factory):
    t = tier_factory()
    for i in range(10):
        t.store.put(key(i), t.make(i))
    other = [key(i, OTHER_NS) for i in range(3)]
    for i, k in enumerate(other):
        t.store.put(k, _rekey(t.make(i), k))
    t.store.flush(timeout=30)
    everything = list(t.store.keys())
    assert len(everything) == len(set(everything)) == 13
    assert sorted(t.store.keys(NS)) == sorted(key(i) for i in range(10))
    assert sorted(t.store.keys(OTHER_NS)) == sorted(other)


def _rekey(value, k: BlockKey):
    if isinstance(value, Record):
        return Record(k, value.parent_hash, value.token_ids, value.codec, value.dtype,
                      value.shape, value.payload, value.created_ns)
    return value


def test_batch_forms_and_longest_prefix(tier_factory):
    t = tier_factory()
    chain = [key(i) for i in range(8)]
    assert t.store.longest_prefix(chain) == 0
    assert all(t.store.put_many((chain[i], t.make(i)) for i in (0, 1, 2, 4, 5)))
    assert t.store.contains_many(chain) == [True, True, True, False, True, True, False, False]
    assert t.store.longest_prefix(chain) == 3
    assert t.store.longest_prefix([]) == 0
    got = t.store.get_many(chain[:4])
    assert [g is None for g in got] == [False, False, False, True]
    assert all(t.same(got[i], t.make(i)) for i in range(3))
    assert t.store.delete_many(chain) == 5
    assert t.store.longest_prefix(chain) == 0


def test_capacity_evicts_least_recently_used(tier_factory):
    """Among blocks of one chain each (the CPU pool evicts the ends of longer chains first:
    tests/test_cpu_pool.py)."""
    t = tier_factory(capacity_blocks=4)
    if not t.evicts:
        pytest.skip("the server evicts (maxmemory-policy), not the store: no budget to test")
    for i in range(4):
        t.store.put(key(i), t.make(i))
    t.store.flush(timeout=30)
    assert t.store.get(key(0)) is not None  # key 0 becomes the most recently used
    for i in range(4, 6):
        t.store.put(key(i), t.make(i))
        t.store.flush(timeout=30)
    s = t.store.stats()
    assert s.evictions == 2
    assert s.entries == 4 and s.bytes_used <= s.capacity_bytes
    assert [t.store.contains(key(i)) for i in range(6)] == [True, False, False, True, True, True]


def test_bad_key_is_rejected(tier_factory):
    t = tier_factory()
    with pytest.raises(ValueError):
        t.store.put(BlockKey(b"short", b"x" * 32), t.make(0))


def test_concurrent_readers_and_writers(tier_factory):
    t = tier_factory(capacity_blocks=256)
    errors: list[str] = []

    def worker(base: int) -> None:
        for i in range(base, base + 25):
            t.store.put(key(i), t.make(i))
            got = t.store.get(key(i))
            if got is not None and not t.same(got, t.make(i)):
                errors.append(f"block {i} read back different bytes")

    threads = [threading.Thread(target=worker, args=(100 * n,)) for n in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert t.store.flush(timeout=30)
    assert errors == []
    assert t.store.stats().entries == 100
    assert all(t.same(t.store.get(key(100 * n + j)), t.make(100 * n + j))
               for n in range(4) for j in range(25))


def test_close_is_idempotent(tier_factory):
    t = tier_factory()
    t.store.put(key(0), t.make(0))
    t.store.close()
    t.store.close()
