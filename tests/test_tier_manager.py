"""The tier manager on the tiny model: restores are bit-exact, keys keep tenants and block
sizes apart, a record that does not belong is recomputed, loads run beside other requests,
and the counters count."""
from __future__ import annotations

import dataclasses
import sys
import threading

import pytest
from prometheus_client import generate_latest

from engine import LLM, SamplingParams
from engine_testing import one_thread  # noqa: F401  (autouse fixture)
from storage.lmdb_store import LmdbStore
from tiered_kv import TierConfig, TierManager
from tiered_kv.block_mover import BlockMover
from tiered_kv.tier_manager import SWITCH_INTERVAL_S
from tier_testing import (
    BLOCK, FLUSH, GREEDY, PROMPTS, hit_tokens, make_llm, stall_disk, tiny_block_nbytes,
)
from tier_testing import disk, reference  # noqa: F401  (fixtures)


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(cpu_bytes=0), "no tier"),
        (dict(cpu_bytes=-1), "cpu_bytes"),
        (dict(codec="lz4"), "unknown codec"),
        (dict(write_policy="write-around"), "write_policy"),
        (dict(offload="decode"), "offload"),
        (dict(staging_bytes=0), "staging_bytes"),
        (dict(flush_timeout_s=float("nan")), "flush_timeout_s"),
        (dict(kv_cache_dir="x", cpu_bytes=0, write_policy="write-back"), "needs a CPU pool"),
        (dict(kv_cache_dir=""), "kv_cache_dir"),
        (dict(sync=1), "sync"),
    ],
)
def test_config_is_validated(fields, message):
    with pytest.raises(ValueError, match=message):
        TierConfig(**fields)


def test_a_cpu_pool_smaller_than_a_block_is_refused():
    with pytest.raises(ValueError, match="holds no KV block"):
        make_llm(TierConfig(cpu_bytes=1000))


# ---------------------------------------------------------------- restores


def test_cpu_pool_restores_what_the_engine_evicted(reference):
    with make_llm(TierConfig(cpu_bytes=4 << 20)) as llm:
        manager: TierManager = llm.engine.connector
        first = llm.generate(PROMPTS[0], GREEDY)[0]
        llm.generate(FLUSH, GREEDY)  # takes every block of the engine's pool
        again = llm.generate(PROMPTS[0], GREEDY)[0]
        engine = llm.engine.stats()
        stats = manager.stats()
    assert first.token_ids == again.token_ids == reference[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == hit_tokens(PROMPTS[0]) > 0
    assert engine.connector_hits == again.num_cached_tokens  # not from the engine's own cache
    cpu = stats["cpu"]
    assert cpu["hit_blocks"] == again.num_cached_tokens // BLOCK
    assert cpu["hit_tokens"] == again.num_cached_tokens
    assert cpu["stored_blocks"] == cpu["entries"] == 8 + len(FLUSH) // BLOCK
    assert cpu["loaded_bytes"] > 0 and cpu["load_bytes_per_s"] > 0
    assert set(stats) == {"cpu"}


def test_a_request_waiting_for_blocks_loads_its_hit_and_leaves_no_lookup_behind(reference):
    """The second request waits while the first holds the engine's blocks, and is looked up
    again at every step from the same answer; it loads its hit once it fits."""
    with make_llm(TierConfig(cpu_bytes=4 << 20)) as llm:
        manager: TierManager = llm.engine.connector
        llm.generate(PROMPTS[0], GREEDY)
        llm.generate(FLUSH, GREEDY)
        asked: list[tuple[str, int | None]] = []
        lookup = manager.get_num_matched_blocks

        def counted(request_id, block_hashes, num_computed_blocks):
            asked.append((request_id, lookup(request_id, block_hashes, num_computed_blocks)))
            return asked[-1][1]

        manager.get_num_matched_blocks = counted
        _, again = llm.generate([FLUSH, PROMPTS[0]], GREEDY)
        waiting = [n for request_id, n in asked if request_id == again.request_id]
        assert len(waiting) > 1 and set(waiting) == {hit_tokens(PROMPTS[0]) // BLOCK}
        assert again.token_ids == reference[0]
        assert again.num_cached_tokens == hit_tokens(PROMPTS[0])
        assert manager._lookup._lookups == {}


def test_restores_wait_for_the_fence_taken_on_the_engine_thread_when_the_load_starts(
    reference, disk, monkeypatch
):
    """A load's blocks may have been freed while a forward still writes them (a request
    aborted mid-prefill): every restore of the load is ordered after the work queued when
    the engine handed the blocks out (the mover's fence; on a GPU an event, see
    test_block_mover's cuda test)."""
    fences, afters = [], []

    def fence(self):
        fences.append((object(), threading.current_thread()))
        return fences[-1][0]

    def restore(self, pairs, after=None):
        afters.append(after)
        return real_restore(self, pairs)

    real_restore = BlockMover.restore
    monkeypatch.setattr(BlockMover, "fence", fence)
    monkeypatch.setattr(BlockMover, "restore", restore)
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=4 << 20, disk_bytes=64 << 20)
    with make_llm(tiers) as llm:
        llm.generate(PROMPTS[0], GREEDY)
        llm.generate(FLUSH, GREEDY)  # the CPU-pool hit below is a load
        assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == reference[0]
    with make_llm(tiers) as llm:  # a disk hit, read on the reader threads
        assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == reference[0]
    assert len(fences) == 2 and all(t is threading.main_thread() for _, t in fences)
    assert afters and set(map(id, afters)) == {id(f) for f, _ in fences}


def test_disk_restores_in_a_new_engine_and_promotes_to_cpu(reference, disk):
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=4 << 20, disk_bytes=64 << 20)
    with make_llm(tiers) as llm:
        assert [llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS[:2]] == reference[:2]
    with make_llm(tiers) as llm:  # a fresh CPU pool: only the disk has the blocks
        manager = llm.engine.connector
        restored = llm.generate(PROMPTS[0], GREEDY)[0]
        after_disk = manager.stats()
        llm.generate(FLUSH, GREEDY)  # evicts the first from the engine again
        promoted = llm.generate(PROMPTS[0], GREEDY)[0]
        stats = manager.stats()
    assert restored.token_ids == promoted.token_ids == reference[0]
    assert restored.num_cached_tokens == promoted.num_cached_tokens == hit_tokens(PROMPTS[0])
    assert after_disk["disk"]["hit_blocks"] == hit_tokens(PROMPTS[0]) // BLOCK
    assert after_disk["cpu"]["hit_blocks"] == 0
    # the promoted blocks are stored into the CPU tier, as its counter says
    assert after_disk["cpu"]["stored_blocks"] == after_disk["cpu"]["entries"] == hit_tokens(PROMPTS[0]) // BLOCK
    assert stats["cpu"]["hit_blocks"] == hit_tokens(PROMPTS[0]) // BLOCK  # promoted on the disk hit
    assert stats["disk"]["corrupt"] == 0 and stats["disk"]["load_failures"] == 0


def test_without_a_cpu_pool_blocks_go_straight_to_disk(reference, disk):
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=0, disk_bytes=64 << 20)
    with make_llm(tiers) as llm:
        llm.generate(PROMPTS[0], GREEDY)
        llm.generate(FLUSH, GREEDY)
        again = llm.generate(PROMPTS[0], GREEDY)[0]
        stats = llm.engine.connector.stats()
    assert again.token_ids == reference[0] and again.num_cached_tokens == hit_tokens(PROMPTS[0])
    assert set(stats) == {"disk"}
    assert stats["disk"]["hit_blocks"] == again.num_cached_tokens // BLOCK
    assert set(llm.engine.connector.stores()) == {"disk"}


def test_queued_blocks_are_found_before_they_are_written(reference, disk, monkeypatch):
    """A block waiting for the disk writer counts as present and is served from the queue."""
    release = stall_disk(monkeypatch).release
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=0, disk_bytes=64 << 20)
    with make_llm(tiers) as llm:
        manager = llm.engine.connector
        llm.generate(PROMPTS[0], GREEDY)
        llm.generate(FLUSH, GREEDY)
        again = llm.generate(PROMPTS[0], GREEDY)[0]
        stats = manager.stats()
        release.set()
        assert manager.flush(30)
        written = manager.stats()["disk"]
    assert again.token_ids == reference[0] and again.num_cached_tokens == hit_tokens(PROMPTS[0])
    queued = 8 + len(FLUSH) // BLOCK
    assert stats["disk"]["entries"] == 0 and stats["disk"]["queued_blocks"] == queued
    assert stats["disk"]["hit_blocks"] == again.num_cached_tokens // BLOCK
    assert written["entries"] == queued and written["queued_blocks"] == 0


def test_offload_all_also_keeps_generated_blocks(disk):
    long_output = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    stored = {}
    for mode in ("prompt", "all"):
        with make_llm(TierConfig(cpu_bytes=4 << 20, offload=mode)) as llm:
            llm.generate(PROMPTS[0], long_output)
            stored[mode] = llm.engine.connector.stats()["cpu"]["stored_blocks"]
    assert stored["prompt"] == len(PROMPTS[0]) // BLOCK
    assert stored["all"] == (len(PROMPTS[0]) + 40 - 1) // BLOCK  # the last token has no KV


# ---------------------------------------------------------------- keys


def test_cache_salt_separates_at_every_tier(reference, disk):
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=4 << 20, disk_bytes=64 << 20)
    with make_llm(tiers, blocks=64) as llm:
        first = llm.generate(PROMPTS[0], GREEDY, cache_salt="tenant-a")[0]
        other = llm.generate(PROMPTS[0], GREEDY, cache_salt="tenant-b")[0]  # GPU and CPU hold "a"
        stats = llm.engine.connector.stats()
    assert first.num_cached_tokens == other.num_cached_tokens == 0
    assert stats["cpu"]["hit_blocks"] == stats["disk"]["hit_blocks"] == 0
    with make_llm(tiers) as llm:
        manager = llm.engine.connector
        other = llm.generate(PROMPTS[0], GREEDY, cache_salt="tenant-c")[0]
        unsalted = llm.generate(PROMPTS[0], GREEDY)[0]
        assert manager.stats()["disk"]["hit_blocks"] == 0
        same = llm.generate(PROMPTS[0], GREEDY, cache_salt="tenant-a")[0]
        stats = manager.stats()
    assert other.num_cached_tokens == unsalted.num_cached_tokens == 0
    assert same.num_cached_tokens == hit_tokens(PROMPTS[0])
    assert stats["disk"]["hit_blocks"] == same.num_cached_tokens // BLOCK
    outputs = [first.token_ids, other.token_ids, same.token_ids, unsalted.token_ids]
    assert outputs == [reference[0]] * 4


def test_the_cpu_pool_evicts_the_lower_priority_tenant_first(reference):
    # 16 slots: "gold" fills 8, then "batch" 8 (more recently used), then "gold" 8 more.
    # Plain LRU would evict gold's first prompt; by priority batch's blocks go.
    tiers = TierConfig(cpu_bytes=16 * tiny_block_nbytes(), tenant_priorities={"gold": -10, "batch": 10})
    with make_llm(tiers) as llm:
        llm.generate(PROMPTS[0], GREEDY, cache_salt="gold")
        llm.generate(PROMPTS[1], GREEDY, cache_salt="batch")
        llm.generate(PROMPTS[2], GREEDY, cache_salt="gold")
        gold = llm.generate(PROMPTS[0], GREEDY, cache_salt="gold")[0]
        batch = llm.generate(PROMPTS[1], GREEDY, cache_salt="batch")[0]
    assert gold.num_cached_tokens == hit_tokens(PROMPTS[0])
    assert batch.num_cached_tokens == 0
    assert [gold.token_ids, batch.token_ids] == reference[:2]



def test_blocks_a_load_brings_up_keep_their_tenants_priority(reference, disk):
    """Gold's blocks, loaded from disk into a fresh CPU pool, rank there as gold's: an
    unsalted newcomer that fills the pool evicts none of them but the one slot its blocks
    pass through on their way to disk (it evicted them all when a promotion entered the
    pool at the default priority)."""
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=16 * tiny_block_nbytes(), disk_bytes=64 << 20,
                       tenant_priorities={"gold": -10})
    with make_llm(tiers) as llm:  # gold's blocks reach the disk
        llm.generate(PROMPTS[0], GREEDY, cache_salt="gold")
    with make_llm(tiers) as llm:
        manager = llm.engine.connector
        promoted = llm.generate(PROMPTS[0], GREEDY, cache_salt="gold")[0]
        assert promoted.num_cached_tokens == hit_tokens(PROMPTS[0])  # from the disk
        llm.generate(FLUSH, GREEDY)  # unsalted: fills the engine and the pool
        assert manager.flush(30)
        before = manager.stats()["cpu"]["hit_blocks"]
        again = llm.generate(PROMPTS[0], GREEDY, cache_salt="gold")[0]
        from_pool = manager.stats()["cpu"]["hit_blocks"] - before
    assert again.num_cached_tokens == hit_tokens(PROMPTS[0])
    assert from_pool == hit_tokens(PROMPTS[0]) // BLOCK - 1  # 16 slots: one passing
    assert promoted.token_ids == again.token_ids == reference[0]


def test_a_tenant_that_matters_less_reaches_disk_through_a_pool_full_of_gold(reference, disk):
    """A pool full of gold's written blocks, and a tenant that matters less: its blocks pass
    through one slot on their way to disk (they were dropped, none reaching the disk, when
    every slot held a block that matters more), and gold keeps the rest of the pool."""
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=8 * tiny_block_nbytes(), disk_bytes=64 << 20,
                       tenant_priorities={"gold": -10, "batch": 10})
    with make_llm(tiers) as llm:
        manager = llm.engine.connector
        llm.generate(PROMPTS[0], GREEDY, cache_salt="gold")  # 8 blocks: the pool is full
        assert manager.flush(30)
        llm.generate(PROMPTS[1], GREEDY, cache_salt="batch")
        assert manager.flush(30)  # nothing dropped
        llm.generate(FLUSH, GREEDY)  # the engine's own cache forgets both prompts
        # written: the disk hit below finds the slot the last passing block left (a load
        # that finds no slot recomputes, and this pool's other slots are the hit's own)
        assert manager.flush(30)
        before = manager.stats()["cpu"]["hit_blocks"]
        gold = llm.generate(PROMPTS[0], GREEDY, cache_salt="gold")[0]
        from_pool = manager.stats()["cpu"]["hit_blocks"] - before
        stats = manager.stats()
    assert stats["cpu"]["dropped"] == 0 and stats["disk"]["entries"] >= 16
    assert from_pool == 7 and gold.num_cached_tokens == hit_tokens(PROMPTS[0])  # one from disk
    assert gold.token_ids == reference[0]


def test_a_chain_partly_evicted_from_the_cpu_pool_still_hits_its_start(reference):
    """A CPU pool alone, full of one prompt's chain: a newcomer evicts its end, not its
    start (its start went first before, and the rest of the chain could not be hit)."""
    with make_llm(TierConfig(cpu_bytes=8 * tiny_block_nbytes())) as llm:
        llm.generate(PROMPTS[0], GREEDY)  # 8 blocks: the pool is full
        llm.generate(PROMPTS[1][:70], GREEDY)  # 4 more
        long = SamplingParams(temperature=0.0, max_tokens=230, ignore_eos=True)
        llm.generate(PROMPTS[2][:10], long)  # the engine's cache forgets both (no prompt block)
        again = llm.generate(PROMPTS[0], GREEDY)[0]
    assert again.num_cached_tokens == 4 * BLOCK and again.token_ids == reference[0]


def test_a_chain_partly_evicted_from_the_disk_still_hits_its_start(reference, disk):
    """A disk tier alone, full of one prompt's chain, reopened: a newcomer evicts the
    chain's end, not its start (its start went first before, and the rest of the chain
    could not be hit)."""
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=0, disk_bytes=8 * (tiny_block_nbytes() + 1024))
    with make_llm(tiers) as llm:
        llm.generate(PROMPTS[0], GREEDY)  # 8 blocks: the disk is full
    with make_llm(tiers) as llm:
        llm.generate(PROMPTS[1][:70], GREEDY)  # 4 more
    with make_llm(tiers) as llm:
        again = llm.generate(PROMPTS[0], GREEDY)[0]
    assert again.num_cached_tokens == 4 * BLOCK and again.token_ids == reference[0]


def test_another_block_size_never_hits(disk):
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=0, disk_bytes=64 << 20)
    with make_llm(tiers) as llm:
        llm.generate(PROMPTS[0], GREEDY)
    with make_llm(tiers, blocks=8, block_size=32) as llm:
        out = llm.generate(PROMPTS[0], GREEDY)[0]
        assert out.num_cached_tokens == 0
        assert llm.engine.connector.stats()["disk"]["hit_blocks"] == 0


# ---------------------------------------------------------------- damaged records


def _tamper(record, how: str):
    if how == "tokens":
        return dataclasses.replace(record, token_ids=tuple(reversed(record.token_ids)))
    if how == "parent":
        return dataclasses.replace(record, parent_hash=bytes(32))
    if how == "shape":
        return dataclasses.replace(record, shape=(record.shape[0] // 2, *record.shape[1:]))
    if how == "payload":
        return dataclasses.replace(record, payload=bytes(record.payload)[:-4])
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["tokens", "parent", "shape", "payload"])
def test_a_record_that_does_not_belong_is_recomputed(reference, disk, how):
    """Records with a valid checksum but the wrong tokens, parent, shape or payload length:
    the load stops there, the engine recomputes from that block on."""
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=0, disk_bytes=64 << 20)
    with make_llm(tiers) as llm:
        llm.generate(PROMPTS[0], GREEDY)
    with LmdbStore(disk) as store:
        records = [store.get(k) for k in store.keys()]
        victim = next(r for r in records if r.parent_hash is not None)
        store.put(victim.key, _tamper(victim, how))
    with make_llm(tiers) as llm:
        out = llm.generate(PROMPTS[0], GREEDY)[0]
        stats = llm.engine.connector.stats()["disk"]
        failures = llm.engine.stats().connector_load_failures
    blocks = [tuple(PROMPTS[0][i : i + BLOCK]) for i in range(0, len(PROMPTS[0]), BLOCK)]
    served = blocks.index(tuple(victim.token_ids))  # the blocks before the bad one load
    assert out.token_ids == reference[0] and out.num_cached_tokens == served * BLOCK
    assert stats["corrupt"] == 1 and stats["load_failures"] == 1 and failures == 1


# ---------------------------------------------------------------- metrics


def test_metrics_are_per_manager_and_per_tier(disk):
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=4 << 20, disk_bytes=64 << 20)
    with make_llm(tiers) as llm, make_llm(TierConfig(cpu_bytes=4 << 20)) as other:
        llm.generate(PROMPTS[0], GREEDY)
        llm.generate(FLUSH, GREEDY)
        llm.generate(PROMPTS[0], GREEDY)
        text = generate_latest(llm.engine.connector.registry).decode()
        idle = generate_latest(other.engine.connector.registry).decode()
    for name in (
        "tiered_kv_lookups_total", "tiered_kv_hit_blocks_total", "tiered_kv_hit_tokens_total",
        "tiered_kv_loaded_bytes_total", "tiered_kv_stored_bytes_total", "tiered_kv_evictions_total",
        "tiered_kv_dropped_stores_total", "tiered_kv_corrupt_records_total", "tiered_kv_used_bytes",
        "tiered_kv_entries", "tiered_kv_load_seconds_bucket", "tiered_kv_store_seconds_bucket",
    ):
        assert f'{name}{{tier="cpu"}}' in text or f'{name}{{le=' in text, name
    assert 'tiered_kv_hit_blocks_total{tier="cpu"} 8.0' in text
    assert 'tiered_kv_queued_blocks{tier="disk"}' in text
    assert 'tiered_kv_hit_blocks_total{tier="cpu"} 0.0' in idle and 'tier="disk"' not in idle


def test_a_manager_serves_one_engine():
    manager = TierManager(TierConfig(cpu_bytes=4 << 20))
    with LLM(max_model_len=256, num_gpu_blocks_override=16, kv_connector=manager, device="cpu"):
        with pytest.raises(RuntimeError, match="one engine"):
            LLM(max_model_len=256, num_gpu_blocks_override=16, kv_connector=manager, device="cpu")
    manager.close()  # idempotent after the engine closed it


# ---------------------------------------------------------------- asynchronous loads


def test_a_request_loading_from_disk_does_not_stall_the_others(reference, disk, monkeypatch):
    """A slow disk read holds only the request that needs it: another request keeps
    getting tokens meanwhile, and the loaded one still matches a recompute."""
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=0, disk_bytes=64 << 20)
    with make_llm(tiers, blocks=64) as llm:
        llm.generate(PROMPTS[0], GREEDY)
        assert llm.engine.connector.flush(30)
    entered, release = threading.Event(), threading.Event()
    reading = LmdbStore.reading

    def slow_reading(self, keys):
        entered.set()
        release.wait(30)
        return reading(self, keys)

    monkeypatch.setattr(LmdbStore, "reading", slow_reading)
    with make_llm(tiers, blocks=64) as llm:
        engine = llm.engine
        other = engine.add_request(PROMPTS[1], GREEDY)
        engine.step()  # the other request is running
        loading = engine.add_request(PROMPTS[0], GREEDY)
        tokens = {other: 0, loading: 0}
        outputs = {}
        while not entered.is_set() or tokens[other] < GREEDY.max_tokens:
            for out in engine.step():
                tokens[out.request_id] = len(out.token_ids)
                outputs[out.request_id] = out
        assert tokens[loading] == 0  # still waiting for the disk while the other finished
        release.set()
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = out
    assert outputs[other].token_ids == reference[1]
    assert outputs[loading].token_ids == reference[0]
    assert outputs[loading].num_cached_tokens == hit_tokens(PROMPTS[0])


def test_a_manager_lowers_the_gil_switch_interval_for_the_engine_thread():
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # CPython's default
    try:
        with make_llm(TierConfig(kv_cache_dir=None, cpu_bytes=8 << 20)):
            assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
    finally:
        sys.setswitchinterval(before)
