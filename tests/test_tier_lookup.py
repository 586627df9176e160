"""The lookup side on its own: the walk CPU → disk → remote, the remote answer on a lookup
thread, and what a request matched."""
from __future__ import annotations

import threading

import torch

from storage.base import BlockKey
from storage.cpu_pool import CpuBlockPool
from tiered_kv.metrics import TierMetrics
from tiered_kv import tier_lookup
from tiered_kv.tier_lookup import TierLookup

NAMESPACE = bytes(32)
HASHES = [bytes([i + 1]) * 32 for i in range(6)]


def key(i: int) -> BlockKey:
    return BlockKey(NAMESPACE, HASHES[i])


class Disk:
    def __init__(self, held: set[int]) -> None:
        self.held = {key(i) for i in held}
        self.removals = 0

    def contains(self, k: BlockKey) -> bool:
        return k in self.held

    def contains_many(self, keys: list[BlockKey]) -> list[bool]:
        return [k in self.held for k in keys]

    def remove(self, k: BlockKey) -> None:
        self.held.discard(k)
        self.removals += 1


class Remote:
    """Holds blocks ``held``; each lookup waits for ``answer`` (the round-trip)."""

    def __init__(self, held: set[int]) -> None:
        self.held = {key(i) for i in held}
        self.answer = threading.Event()
        self.asked: list[list[BlockKey]] = []

    def longest_prefix(self, keys: list[BlockKey]) -> int:
        self.asked.append(keys)
        self.answer.wait(10)
        run = 0
        while run < len(keys) and keys[run] in self.held:
            run += 1
        return run


def pool_with(blocks: list[int]) -> CpuBlockPool:
    pool = CpuBlockPool(8 * 64, block_nbytes=64, pin_memory=False)
    for i in blocks:
        slot = pool.reserve()
        pool.commit(key(i), slot, torch.float32, (16,), None, (i,))
    return pool


def make(
    remote: Remote | None, pool: CpuBlockPool | None = None, disk: Disk | None = None
) -> tuple[TierLookup, TierMetrics, threading.Event]:
    """A lookup over ``pool`` (default: blocks 0 and 1), ``disk`` (default: block 2) and
    ``remote``."""
    answered = threading.Event()
    tiers = ("cpu", "disk") + (("remote",) if remote is not None else ())
    metrics = TierMetrics(tiers, lambda: {}, lambda: None)
    lookup = TierLookup(
        NAMESPACE, pool_with([0, 1]) if pool is None else pool, Disk({2}) if disk is None else disk,
        remote, metrics, count_cpu=True, on_answer=answered.set,
    )
    return lookup, metrics, answered


def put(pool: CpuBlockPool, k: BlockKey) -> None:
    pool.commit(k, pool.reserve(), torch.float32, (16,), None, ())


def test_the_run_goes_cpu_then_disk_then_remote_and_loads_with_its_tiers():
    remote = Remote({3, 4})
    lookup, metrics, answered = make(remote)
    assert lookup.num_matched("r", HASHES, 0) is None  # the remote lookup is in flight
    assert lookup.num_matched("r", HASHES, 0) is None  # asked again: no second round-trip
    remote.answer.set()
    assert answered.wait(10)
    assert lookup.num_matched("r", HASHES, 0) == 5
    assert remote.asked == [[key(3), key(4), key(5)]]  # one round-trip for the rest
    wanted = lookup.wanted("r", HASHES[:5], [10, 11, 12, 13, 14])
    assert [w.tier for w in wanted] == ["cpu", "cpu", "disk", "remote", "remote"]
    assert [w.parent for w in wanted] == [None, *HASHES[:4]]
    assert [w.block_id for w in wanted] == [10, 11, 12, 13, 14]
    assert lookup.num_matched("r", HASHES, 0) == 5  # the engine asks again: not recounted
    counters = metrics.counters()
    # the pool was asked up to its first miss past the disk's run, the remote tier the rest
    looked_up = [counters[tier].lookups for tier in ("cpu", "disk", "remote")]
    assert looked_up == [4, 2, 3]
    lookup.close()


def test_without_a_remote_tier_the_run_stops_at_the_first_miss():
    lookup, _, answered = make(None)
    assert lookup.num_matched("r", HASHES, 1) == 2  # blocks 1 (cpu) and 2 (disk)
    wanted = lookup.wanted("r", HASHES[1:3], [7, 8])
    assert [(w.tier, w.parent) for w in wanted] == [("cpu", HASHES[0]), ("disk", HASHES[1])]
    assert lookup.wanted("r", HASHES[1:4], [7, 8, 9]) is None  # past the matched run
    assert lookup.wanted("r", [], []) == []
    assert lookup.num_matched("r", HASHES, 6) == 0
    assert not answered.is_set()
    lookup.close()


def test_forget_drops_what_a_request_matched_and_its_remote_answer():
    remote = Remote({3})
    remote.answer.set()
    lookup, _, answered = make(remote)
    assert lookup.num_matched("r", HASHES, 0) is None
    assert answered.wait(10)
    assert lookup.num_matched("r", HASHES, 0) == 4
    lookup.forget("r")
    assert lookup.wanted("r", HASHES[:1], [0]) is None
    assert lookup.num_matched("r", HASHES, 0) is None  # asked again
    lookup.close()
    assert len(remote.asked) == 2


def test_a_long_chain_is_walked_a_chunk_at_a_time_across_tiers_and_stops_at_its_first_miss(
    monkeypatch,
):
    """Runs held across chunk boundaries, in the pool and on disk, are counted whole; the
    pool is asked only up to the chunk of the first block neither tier holds, so a cold
    long prompt costs one chunk of keys."""
    chunk = tier_lookup.LOOKUP_CHUNK
    hashes = [i.to_bytes(32, "big") for i in range(1, 4 * chunk + 1)]
    keys = [BlockKey(NAMESPACE, h) for h in hashes]
    in_pool = set(range(chunk + 5)) | set(range(chunk + 9, 2 * chunk + 3))  # a gap: on disk
    pool = CpuBlockPool((len(in_pool) + 1) * 64, block_nbytes=64, pin_memory=False)
    for i in sorted(in_pool):
        pool.commit(keys[i], pool.reserve(), torch.float32, (16,), None, (i,))
    asked: list[int] = []
    contains_many = pool.contains_many
    pool.contains_many = lambda ks: (asked.append(len(ks)), contains_many(ks))[1]
    disk = Disk(set())
    disk.held = {keys[i] for i in range(chunk + 5, chunk + 9)}
    metrics = TierMetrics(("cpu", "disk"), lambda: {}, lambda: None)
    lookup = TierLookup(NAMESPACE, pool, disk, None, metrics, count_cpu=True, on_answer=lambda: None)
    assert lookup.num_matched("r", hashes, 0) == 2 * chunk + 3
    assert asked == [chunk] * 3  # the third chunk holds the first miss: the fourth is not asked
    tiers = [w.tier for w in lookup.wanted("r", hashes[: 2 * chunk + 3], list(range(2 * chunk + 3)))]
    assert tiers == ["cpu"] * (chunk + 5) + ["disk"] * 4 + ["cpu"] * (chunk - 6)
    counters = metrics.counters()
    assert (counters["cpu"].lookups, counters["disk"].lookups) == (2 * chunk + 4, 5)
    asked.clear()
    assert lookup.num_matched("cold", [bytes([7]) * 32] + hashes, 0) == 0
    assert asked == [chunk]
    made: list[bytes] = []

    class CountedKey(BlockKey):
        def __new__(cls, namespace, block_hash):
            made.append(block_hash)
            return super().__new__(cls, namespace, block_hash)

    monkeypatch.setattr(tier_lookup, "BlockKey", CountedKey)
    # asked again (the request waits for blocks): its keys are not made again
    assert lookup.num_matched("r", hashes, 0) == 2 * chunk + 3 and made == []
    assert lookup.num_matched("r", hashes, 1) == 2 * chunk + 2 and len(made) == 3 * chunk
    lookup.close()


class Asked:
    """Counts the keys a lookup asks the pool and the disk about."""

    def __init__(self, pool: CpuBlockPool, disk: Disk) -> None:
        self.pool: list[int] = []  # keys per call
        self.disk = 0
        self.disk_calls = 0
        contains_many, contains, disk_contains = pool.contains_many, pool.contains, disk.contains
        disk_many = disk.contains_many

        def pool_many(keys):
            self.pool.append(len(keys))
            return contains_many(keys)

        def pool_one(k):
            self.pool.append(1)
            return contains(k)

        def disk_one(k):
            self.disk += 1
            self.disk_calls += 1
            return disk_contains(k)

        def disk_all(keys):
            self.disk += len(keys)
            self.disk_calls += 1
            return disk_many(keys)

        pool.contains_many, pool.contains, disk.contains = pool_many, pool_one, disk_one
        disk.contains_many = disk_all

    def clear(self) -> None:
        self.pool.clear()
        self.disk = 0


def long_chain(held: int, length: int) -> tuple[TierLookup, CpuBlockPool, Disk, list[bytes]]:
    """A lookup over a pool holding the first ``held`` blocks of a ``length``-block chain."""
    hashes = [i.to_bytes(32, "big") for i in range(1, length + 1)]
    pool = CpuBlockPool(length * 64, block_nbytes=64, pin_memory=False)
    for h in hashes[:held]:
        put(pool, BlockKey(NAMESPACE, h))
    disk = Disk(set())
    lookup, _, _ = make(None, pool, disk)
    return lookup, pool, disk, hashes


def test_a_repeated_lookup_asks_no_tier_about_the_run_it_found():
    """While no block left the pool or the disk, the same request asked again costs no walk:
    nothing is asked for a whole hit, one key (the block after the run) for a partial one."""
    chunk = tier_lookup.LOOKUP_CHUNK
    lookup, pool, disk, hashes = long_chain(3 * chunk, 3 * chunk)
    asked = Asked(pool, disk)
    assert lookup.num_matched("r", hashes, 0) == 3 * chunk
    assert asked.pool == [chunk] * 3
    asked.clear()
    for _ in range(3):
        assert lookup.num_matched("r", list(hashes), 0) == 3 * chunk  # a new list, the same chain
    assert (asked.pool, asked.disk) == ([], 0)
    wanted = lookup.wanted("r", hashes, list(range(3 * chunk)))
    assert [w.tier for w in wanted] == ["cpu"] * 3 * chunk
    lookup, pool, disk, hashes = long_chain(2 * chunk + 5, 3 * chunk)
    asked = Asked(pool, disk)
    assert lookup.num_matched("r", hashes, 0) == 2 * chunk + 5
    asked.clear()
    assert lookup.num_matched("r", hashes, 0) == 2 * chunk + 5
    assert (asked.pool, asked.disk) == ([1], 1)
    assert lookup.num_matched("r", hashes, 1) == 2 * chunk + 4  # asked from another block: walked
    assert sum(asked.pool) > chunk


def test_a_run_on_disk_is_asked_of_the_disk_a_chunk_at_a_time():
    chunk = tier_lookup.LOOKUP_CHUNK
    lookup, pool, disk, hashes = long_chain(chunk // 2, 3 * chunk)
    disk.held = {BlockKey(NAMESPACE, h) for h in hashes[: 2 * chunk + 3]}
    asked = Asked(pool, disk)
    assert lookup.num_matched("r", hashes, 0) == 2 * chunk + 3
    assert lookup.matched_tiers("r") == ("cpu",) * (chunk // 2) + ("disk",) * (3 * chunk // 2 + 3)
    assert asked.disk_calls == 3  # one call a chunk, not one a block
    lookup.close()


def test_a_block_that_left_the_pool_or_the_disk_since_the_lookup_shows_in_the_next():
    pool, disk = pool_with([0, 1, 2, 3]), Disk({2})
    lookup, _, _ = make(None, pool, disk)
    assert lookup.num_matched("r", HASHES, 0) == 4  # cpu, cpu, cpu (also on disk), cpu
    assert lookup.matched_tiers("r") == ("cpu",) * 4
    assert pool.delete(key(2))
    assert lookup.num_matched("r", HASHES, 0) == 4
    assert lookup.matched_tiers("r") == ("cpu", "cpu", "disk", "cpu")
    disk.remove(key(2))
    assert lookup.num_matched("r", HASHES, 0) == 2
    for i in (10, 11, 12, 13, 14):  # fill the pool: the next reserve evicts the oldest, key(0)
        put(pool, BlockKey(NAMESPACE, bytes([i]) * 32))
    put(pool, key(5))
    assert not pool.contains(key(0))
    assert lookup.num_matched("r", HASHES, 0) == 0
    assert lookup.wanted("r", HASHES[:1], [0]) is None
    lookup.close()


def test_blocks_saved_after_the_run_extend_it_and_only_they_are_asked():
    pool, disk = pool_with([0, 1]), Disk({2})
    lookup, _, _ = make(None, pool, disk)
    assert lookup.num_matched("r", HASHES, 0) == 3  # cpu, cpu, disk; block 3 in no tier
    asked = Asked(pool, disk)
    for i in (3, 4):
        put(pool, key(i))
    assert lookup.num_matched("r", HASHES, 0) == 5
    assert asked.pool == [1, 3]  # the block after the run, then the walk on from it
    assert lookup.matched_tiers("r") == ("cpu", "cpu", "disk", "cpu", "cpu")
    lookup.close()


def test_a_request_asked_about_another_chain_is_looked_up_anew():
    """A request id names one lookup: another chain of the same length (another cache salt)
    is walked, never answered from the first."""
    lookup, _, _ = make(None)
    assert lookup.num_matched("r", HASHES, 0) == 3
    salted = [bytes([i + 101]) * 32 for i in range(6)]
    assert lookup.num_matched("r", salted, 0) == 0
    assert lookup.wanted("r", HASHES[:1], [0]) is None
    assert lookup.num_matched("r", HASHES, 0) == 3
    lookup.close()


def test_a_finished_request_leaves_no_lookup_behind():
    pool, disk = pool_with([0, 1]), Disk({2})
    lookup, _, _ = make(None, pool, disk)
    asked = Asked(pool, disk)
    for request_id in ("a", "b"):
        assert lookup.num_matched(request_id, HASHES, 0) == 3
        lookup.forget(request_id)
    assert lookup._lookups == {}
    asked.clear()
    assert lookup.num_matched("a", HASHES, 0) == 3  # walked again
    assert asked.pool == [6]
    lookup.close()


def test_a_shorter_local_run_asks_the_remote_tier_again():
    remote = Remote({1, 3, 4})
    remote.answer.set()
    pool = pool_with([0, 1])
    lookup, _, answered = make(remote, pool)
    assert lookup.num_matched("r", HASHES, 0) is None
    assert answered.wait(10)
    assert lookup.num_matched("r", HASHES, 0) == 5
    assert lookup.num_matched("r", HASHES, 0) == 5 and len(remote.asked) == 1
    assert pool.delete(key(1))
    answered.clear()
    assert lookup.num_matched("r", HASHES, 0) is None
    assert answered.wait(10)
    assert lookup.num_matched("r", HASHES, 0) == 2  # block 1 from the remote tier, not 2
    assert remote.asked[-1] == [key(i) for i in range(1, 6)]
    assert lookup.matched_tiers("r") == ("cpu", "remote")
    lookup.close()
