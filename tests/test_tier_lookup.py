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

    def contains(self, k: BlockKey) -> bool:
        return k in self.held


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


def make(remote: Remote | None) -> tuple[TierLookup, TierMetrics, threading.Event]:
    answered = threading.Event()
    tiers = ("cpu", "disk") + (("remote",) if remote is not None else ())
    metrics = TierMetrics(tiers, lambda: {}, lambda: None)
    lookup = TierLookup(
        NAMESPACE, pool_with([0, 1]), Disk({2}), remote, metrics,
        count_cpu=True, on_answer=answered.set,
    )
    return lookup, metrics, answered


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
