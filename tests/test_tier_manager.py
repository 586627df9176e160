"""The tier manager on the tiny model: restores are bit-exact, failures recompute, and the
counters count."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest

from engine import LLM, SamplingParams
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.connector import SavedBlock
from engine.models.tiny import TINY_CONFIG
from engine.scheduler import Scheduler
from engine.stats import StatsCollector
from engine_testing import make_seq, scheduler_step
from engine_testing import one_thread  # noqa: F401  (autouse fixture)
from storage.codecs import get_codec
from storage.codecs.kivi import KiviCodec
from storage.lmdb_store import LmdbStore
from tiered_kv import TierConfig, TierManager, block_saver, build_llm, pool_writer
from tiered_kv.block_mover import BlockMover
from tiered_kv.tier_manager import SWITCH_INTERVAL_S

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(count)]


PROMPTS = random_prompts(3, 130, seed=7)  # 8 full blocks each; 9 blocks with the outputs
FLUSH = random_prompts(1, 240, seed=8)[0]  # with its outputs, fills all 16 blocks of the engine


def make_llm(tiers: TierConfig, blocks: int = 16, **engine) -> LLM:
    """A tiny engine whose block pool holds about one request, so hits must come from below."""
    return build_llm(
        "tiny", tiers, device="cpu", max_model_len=256, num_gpu_blocks_override=blocks, **engine
    )


def hit_tokens(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    with LLM(max_model_len=256, enable_prefix_caching=False, device="cpu") as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    return tmp_path / "kv"


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
    release = threading.Event()
    put_many = LmdbStore.put_many

    def stalled_put_many(self, items, **kwargs):
        release.wait(30)
        return put_many(self, items, **kwargs)

    monkeypatch.setattr(LmdbStore, "put_many", stalled_put_many)
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
    tiers = TierConfig(cpu_bytes=16 * _block_nbytes(), tenant_priorities={"gold": -10, "batch": 10})
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
    unsalted newcomer that fills the pool does not evict them (it did when a promotion
    entered the pool at the default priority)."""
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=16 * _block_nbytes(), disk_bytes=64 << 20,
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
    assert from_pool == hit_tokens(PROMPTS[0]) // BLOCK
    assert promoted.token_ids == again.token_ids == reference[0]

def test_another_block_size_never_hits(disk):
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=0, disk_bytes=64 << 20)
    with make_llm(tiers) as llm:
        llm.generate(PROMPTS[0], GREEDY)
    with make_llm(tiers, blocks=8, block_size=32) as llm:
        out = llm.generate(PROMPTS[0], GREEDY)[0]
        assert out.num_cached_tokens == 0
        assert llm.engine.connector.stats()["disk"]["hit_blocks"] == 0


# ---------------------------------------------------------------- write policies and pressure


@pytest.mark.parametrize("buffer", ["staging", "cpu"])
def test_write_pressure_drops_stores_and_never_stalls(reference, disk, monkeypatch, buffer):
    """A buffer of two blocks (the staging buffer, or a CPU tier) and a disk that does not
    keep up: the two wait for the disk, every other block is dropped and counted once (in
    the buffer's tier) once it has waited SAVE_WAIT_S, and the engine keeps producing the
    same tokens."""
    release = threading.Event()
    put_many = LmdbStore.put_many

    def stalled_put_many(self, items, **kwargs):
        release.wait(30)  # a disk that does not keep up
        return put_many(self, items, **kwargs)

    monkeypatch.setattr(LmdbStore, "put_many", stalled_put_many)
    monkeypatch.setattr(block_saver, "SAVE_WAIT_S", 0.0)
    block_nbytes = _block_nbytes()
    two = 2 * block_nbytes
    if buffer == "staging":
        tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=0, disk_bytes=64 << 20, staging_bytes=two)
    else:
        tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=two, disk_bytes=64 << 20)
    with make_llm(tiers, blocks=64) as llm:
        manager = llm.engine.connector
        outs = [llm.generate(p, GREEDY)[0] for p in PROMPTS]
        stats = manager.stats()
        exported = manager.registry.get_sample_value(
            "tiered_kv_dropped_stores_total", {"tier": "disk" if buffer == "staging" else "cpu"}
        )
        release.set()
    assert [o.token_ids for o in outs] == reference
    offered = sum(len(p) // BLOCK for p in PROMPTS)
    dropped = stats["disk" if buffer == "staging" else "cpu"]["dropped"]
    assert stats["disk"]["queued_blocks"] == 2 and dropped == exported == offered - 2
    if buffer == "cpu":
        assert stats["disk"]["dropped"] == 0
    with LmdbStore(disk) as store:
        assert store.stats().entries == 2


def test_a_save_waits_for_a_slot_instead_of_dropping(reference, disk, monkeypatch):
    """With the default wait, a full staging buffer holds the engine's block until the disk
    writer frees a slot: nothing is dropped."""
    put_many = LmdbStore.put_many

    def slow_put_many(self, items, **kwargs):
        time.sleep(0.02)
        return put_many(self, items, **kwargs)

    monkeypatch.setattr(LmdbStore, "put_many", slow_put_many)
    tiers = TierConfig(
        kv_cache_dir=disk, cpu_bytes=0, disk_bytes=64 << 20, staging_bytes=2 * _block_nbytes()
    )
    with make_llm(tiers, blocks=64) as llm:
        outs = [llm.generate(p, GREEDY)[0] for p in PROMPTS]
        assert llm.engine.connector.flush(30)
        stats = llm.engine.connector.stats()["disk"]
    assert [o.token_ids for o in outs] == reference
    offered = sum(len(p) // BLOCK for p in PROMPTS)
    assert stats["dropped"] == 0 and stats["entries"] == offered


def test_an_engine_short_of_blocks_does_not_wait_for_saves_that_wait_for_the_disk(
    reference, disk, monkeypatch
):
    """A CPU pool of two blocks, both waiting for a disk that does not keep up, and a GPU
    pool too small for two prompts: the saves that found no slot hold the blocks the next
    request needs. The engine has them dropped (counted) and goes on; it does not wait
    for the disk or for SAVE_WAIT_S."""
    release = threading.Event()
    put_many = LmdbStore.put_many

    def stalled_put_many(self, items, **kwargs):
        release.wait(30)  # a disk that does not keep up
        return put_many(self, items, **kwargs)

    monkeypatch.setattr(LmdbStore, "put_many", stalled_put_many)
    monkeypatch.setattr(block_saver, "SAVE_WAIT_S", 3600.0)
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=2 * _block_nbytes(), disk_bytes=64 << 20)
    try:
        with make_llm(tiers, blocks=16) as llm:
            engine, outs = llm.engine, {}
            for i, prompt in enumerate(PROMPTS):
                engine.add_request(prompt, GREEDY, request_id=str(i))
                for _ in range(400):  # a step that waits on the connector waits 50 ms
                    outs.update((o.request_id, o) for o in engine.step())
                    if str(i) in outs and outs[str(i)].finished:
                        break
                assert str(i) in outs and outs[str(i)].finished, "the engine waited on saves"
            dropped = llm.engine.connector.stats()["cpu"]["dropped"]
            release.set()
    finally:
        release.set()
    assert [outs[str(i)].token_ids for i in range(len(PROMPTS))] == reference
    assert dropped > 0


def test_close_gives_up_on_the_queue_after_flush_timeout(reference, disk, monkeypatch):
    release = threading.Event()
    put_many = LmdbStore.put_many

    def stalled_put_many(self, items, **kwargs):
        release.wait(30)
        return put_many(self, items, **kwargs)

    monkeypatch.setattr(LmdbStore, "put_many", stalled_put_many)
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=0, disk_bytes=64 << 20, flush_timeout_s=0.1)
    llm = make_llm(tiers, blocks=64)
    manager = llm.engine.connector
    assert [llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS] == reference
    assert not manager.flush(0.05)
    threading.Timer(0.5, release.set).start()  # the batch being written finishes late
    start = time.monotonic()
    llm.close()
    assert time.monotonic() - start < 5
    stats = manager.stats()["disk"]
    offered = sum(len(p) // BLOCK for p in PROMPTS)
    assert 0 < stats["dropped"] < offered and stats["entries"] + stats["dropped"] == offered
    with LmdbStore(disk) as store:
        assert store.stats().entries == stats["entries"]


def test_a_staging_buffer_smaller_than_a_block_is_refused(disk):
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=0, disk_bytes=64 << 20, staging_bytes=1024)
    with pytest.raises(ValueError, match="staging_bytes"):
        make_llm(tiers)


def _block_nbytes() -> int:
    c = TINY_CONFIG
    return c["num_hidden_layers"] * 2 * BLOCK * c["num_key_value_heads"] * c["head_dim"] * 4


def test_write_back_writes_to_disk_only_under_pressure_and_at_close(reference, disk):
    tiers = TierConfig(
        kv_cache_dir=disk, cpu_bytes=10 * _block_nbytes(), disk_bytes=64 << 20,
        write_policy="write-back",
    )
    with make_llm(tiers) as llm:
        manager = llm.engine.connector
        llm.generate(PROMPTS[0], GREEDY)
        time.sleep(0.3)  # the writer looks at the pool every 50 ms
        assert manager.stats()["disk"]["entries"] == 0  # only in the CPU pool: 2 slots free
        llm.generate(PROMPTS[1], GREEDY)  # 8 more blocks: the pool of 10 runs out of slots
        deadline = time.monotonic() + 10
        while manager.stats()["disk"]["entries"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = manager.stats()
        assert stats["disk"]["entries"] > 0 and stats["cpu"]["dropped"] == 0
        again = llm.generate(PROMPTS[0], GREEDY)[0]
    assert again.token_ids == reference[0] and again.num_cached_tokens == hit_tokens(PROMPTS[0])
    with LmdbStore(disk) as store:  # close() wrote back what only the pool held
        assert store.stats().entries == 16


def _tenant_write_back(disk):
    """A write-back manager over a 4-slot pool whose tenant ``batch`` matters less, with two
    clean blocks of the others in it, and ``save(salt, *block_ids)`` (block ``b``: hash
    ``b + 1``, tokens ``(b,) * 4``)."""
    bs = 4
    kv_cache = torch.randn(8, 1, 2, bs, 1, 2)  # [N, L, 2, T, H, D]
    slot = kv_cache[0].numel() * kv_cache.element_size()
    tiers = TierConfig(
        kv_cache_dir=disk, cpu_bytes=4 * slot, disk_bytes=1 << 20, write_policy="write-back",
        flush_timeout_s=5.0, tenant_priorities={"batch": 3},
    )
    manager = TierManager(tiers)
    manager.register_kv_cache(kv_cache, bytes(32), bs)

    def save(salt, *block_ids):
        manager.save_blocks(
            [SavedBlock(bytes([b + 1]) * 32, None, (b,) * bs, b, True, salt) for b in block_ids]
        )

    save(None, 0, 1)
    assert manager.flush(5)  # written: clean, and they matter more than the tenant's
    time.sleep(3 * pool_writer.IDLE_WAIT_S)  # the writer is back to writing under pressure only
    return manager, save


def test_a_flush_or_close_writes_back_the_blocks_a_waiting_save_needs(disk):
    """A tenant's save waits for a slot that only its own tenant's blocks, pending for a
    write-back disk, can free (the other slots hold clean blocks of a tenant that matters
    more). A flush and a close write them back and store the save, instead of waiting until
    their timeout and dropping it."""
    manager, save = _tenant_write_back(disk)
    save("batch", 2, 3)  # pending, in the other two slots
    save("batch", 4)  # waits for one of them
    started = time.monotonic()
    assert manager.flush(5) and time.monotonic() - started < 2
    time.sleep(3 * pool_writer.IDLE_WAIT_S)
    save("batch", 5, 6)
    save("batch", 7)
    started = time.monotonic()
    manager.close()
    assert time.monotonic() - started < 2
    assert sorted(manager.poll().saved) == list(range(8))
    assert manager.stats()["cpu"]["dropped"] == 0
    with LmdbStore(disk) as store:
        assert store.stats().entries == 8


def test_a_refused_save_has_the_write_back_writer_make_room(disk):
    """As above, with the engine stepping and no flush: the refused reservation is pressure
    for the writer, which writes the tenant's pending blocks back so that the save can evict
    one of them (it waited SAVE_WAIT_S and was dropped while the clean blocks of the tenant
    that matters more kept the pool's evictable count up)."""
    manager, save = _tenant_write_back(disk)
    with contextlib.closing(manager):
        save("batch", 2, 3)  # pending, in the other two slots
        save("batch", 4, 5)  # wait for those
        saved: list[int] = []
        deadline = time.monotonic() + 3
        while len(saved) < 6 and time.monotonic() < deadline:  # the engine's steps
            saved += manager.poll().saved
            time.sleep(0.01)
        assert sorted(saved) == list(range(6)) and manager.stats()["cpu"]["dropped"] == 0


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


# ---------------------------------------------------------------- lossy codecs


def _divergence(ref, got) -> tuple[int, float]:
    """First differing token position (len if none) and the largest |logprob| error over
    the whole vocabulary at the steps before it."""
    first = next((i for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)) if a != b),
                 len(ref.token_ids))
    err = 0.0
    for step in range(first + 1 if first < len(ref.token_ids) else first):
        a, b = ref.top_logprobs[step], got.top_logprobs[step]
        err = max(err, max(abs(a[t] - b[t]) for t in a))
    return first, err


@pytest.mark.parametrize("codec", ["kivi4", "kivi2"])
def test_lossy_codec_divergence_is_measured(disk, codec):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1000)
    with LLM(max_model_len=256, enable_prefix_caching=False, device="cpu") as llm:
        refs = llm.generate(PROMPTS, params)
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=0, disk_bytes=64 << 20, codec=codec)
    with make_llm(tiers, blocks=64) as llm:
        llm.generate(PROMPTS, params)
    with make_llm(tiers, blocks=64) as llm:
        outs = [llm.generate(p, params)[0] for p in PROMPTS]
        hits = llm.engine.connector.stats()["disk"]["hit_blocks"]
    assert hits == sum(hit_tokens(p) for p in PROMPTS) // BLOCK
    firsts, errors = zip(*(_divergence(r, o) for r, o in zip(refs, outs)))
    print(f"\n{codec}: first differing token per prompt {list(firsts)} of 16; "
          f"max |logprob error| before it {[round(e, 4) for e in errors]}")
    assert all(math.isfinite(e) and e < 5.0 for e in errors)
    # Lossy records live in their own namespace: a lossless configuration never sees them.
    with make_llm(dataclasses.replace(tiers, codec="raw")) as llm:
        assert llm.generate(PROMPTS[0], params)[0].num_cached_tokens == 0


@pytest.mark.parametrize("codec", ["kivi4", "kivi2+zstd"])
def test_a_lossy_codec_quantizes_blocks_before_the_cpu_tier(disk, codec):
    """With kivi4 the pool holds KIVI payloads, quantized before the copy: more blocks fit
    in the same bytes, and a CPU hit restores exactly what a disk hit after a restart does
    (the disk's records are the pool's payloads, sealed)."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=20)
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=4 << 20, disk_bytes=64 << 20, codec=codec)
    with make_llm(tiers) as llm:
        llm.generate(PROMPTS[0], params)
        llm.generate(FLUSH, params)  # the engine's blocks now hold another request
        cpu_hit = llm.generate(PROMPTS[0], params)[0]
        manager = llm.engine.connector
        kv_cache = llm.engine.model_runner.kv_cache
        block = tuple(kv_cache.shape[1:])
        slot_nbytes = manager.stores()["cpu"].slot_nbytes
        assert manager.stats()["cpu"]["hit_blocks"] == 8
    assert slot_nbytes == get_codec(codec).stage.payload_size(kv_cache.dtype, block)
    assert slot_nbytes * 2 < math.prod(block) * kv_cache.element_size()
    with make_llm(tiers) as llm:
        disk_hit = llm.generate(PROMPTS[0], params)[0]
        assert llm.engine.connector.stats()["disk"]["hit_blocks"] == 8
    assert cpu_hit.num_cached_tokens == disk_hit.num_cached_tokens == hit_tokens(PROMPTS[0])
    assert cpu_hit.token_ids == disk_hit.token_ids
    assert cpu_hit.top_logprobs == disk_hit.top_logprobs


def test_a_failing_offload_drops_its_blocks_and_the_engine_serves_on(reference, monkeypatch):
    """A KIVI offload runs on the mover's thread; if it fails, its blocks are dropped
    (counted, slots given back, GPU blocks released) and requests are unaffected."""

    def broken(self, blocks, out):
        raise RuntimeError("device error")

    monkeypatch.setattr(KiviCodec, "encode_blocks", broken)
    with make_llm(TierConfig(cpu_bytes=4 << 20, codec="kivi4")) as llm:
        out = llm.generate(PROMPTS[0], GREEDY)[0]
        assert out.token_ids == reference[0]
        assert_all_dropped(llm.engine.connector, 8)
        assert llm.generate(PROMPTS[1], GREEDY)[0].token_ids == reference[1]


def test_blocks_the_disk_refuses_are_logged_and_make_the_flush_false(disk, caplog):
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=4 << 20, disk_bytes=10_000)  # < one record
    with make_llm(tiers) as llm:
        llm.generate(PROMPTS[0], GREEDY)
        manager = llm.engine.connector
        assert not manager.flush(30)
        assert manager.stats()["disk"]["dropped"] == 8
        assert manager.flush(30)  # nothing lost since
    refused = [r.getMessage() for r in caplog.records if "the disk tier did not take" in r.getMessage()]
    assert refused and sum(int(m.split()[6]) for m in refused) == 8  # said, even if held back
    assert all("--kv-disk-size" in m for m in refused)


def test_a_drop_warning_held_back_is_logged_at_close(caplog):
    import logging

    from tiered_kv.drop_warning import DropWarning

    log = logging.getLogger("tiered_kv.test")
    warning = DropWarning(log, "dropped %d blocks; raise %s")
    warning.add(3, "--a")
    warning.add(4, "--a")  # within the interval: held back
    warning.add(1, "--b")
    assert [r.getMessage() for r in caplog.records] == ["dropped 3 blocks; raise --a"]
    warning.close()
    warning.close()
    assert [r.getMessage() for r in caplog.records][1:] == ["dropped 5 blocks; raise --b"]


def assert_all_dropped(manager, blocks: int) -> None:
    """After a flush: ``blocks`` saves dropped, nothing in the pool, every slot free."""
    assert not manager.flush(30)  # it says blocks were lost since the last flush
    assert manager.flush(30)  # and none since
    stats = manager.stats()["cpu"]
    assert stats["dropped"] == blocks and stats["entries"] == 0
    assert manager.stores()["cpu"].num_evictable() == manager.stores()["cpu"].num_slots


# ---------------------------------------------------------------- a save that fails part way


def _fail(*args, **kwargs):
    raise RuntimeError("injected")


def test_a_save_that_fails_part_way_releases_each_hold_once(monkeypatch):
    """The engine holds each offered block until the manager reports it, and lets go of a
    whole batch whose save raises. A batch whose first block is reported at once (a
    generated one, with ``offload="prompt"``) and whose next step fails must not raise:
    else the block's report would later drop a newer save's hold on the reused block, or
    release it twice (ValueError)."""
    bs = 4
    manager = TierManager(TierConfig(cpu_bytes=1 << 16))
    manager.register_kv_cache(torch.zeros(4, 1, 2, bs, 1, 2), bytes(32), bs)  # [N, L, 2, T, H, D]
    pool = manager.stores()["cpu"]
    config = EngineConfig(device="cpu", block_size=bs, max_model_len=64).resolve(4096)
    blocks = BlockManager(4, bs)
    s = Scheduler(config, blocks, StatsCollector(), manager)
    s.add(a := make_seq([1, 2, 3, 4, 5], "a", block_size=bs))
    while a.num_computed_tokens < 2 * bs - 1:
        scheduler_step(s)
    s.add(b := make_seq([11, 12, 13, 14, 15], "b", block_size=bs))
    with monkeypatch.context() as m:
        m.setattr(pool, "reserve_many", _fail)
        scheduler_step(s)  # saves a's block 1 (generated: reported) and b's block 0 (fails)
    assert blocks.num_held_blocks == 2  # both held until reported
    failed = b.block_table[0]
    s.finish(a, "abort")
    s.finish(b, "abort")
    monkeypatch.setattr(pool, "reserve_many", lambda priorities: [])  # no room: c's saves wait
    s.add(c := make_seq(range(21, 34), "c", block_size=bs))
    scheduler_step(s)  # the reports come in; c reuses every block and its 3 full ones wait
    assert failed in c.block_table[:3] and blocks.num_held_blocks == 3
    scheduler_step(s)
    assert blocks.num_held_blocks == 3  # no stale report dropped a newer hold
    monkeypatch.undo()
    manager.flush(30)  # c's saves go in
    s.apply_transfers(manager.poll())
    assert blocks.num_held_blocks == 0
    assert manager.stats()["cpu"]["dropped"] == 1  # b's block 0
    manager.close()


def test_a_save_that_fails_part_way_leaves_the_engine_serving(monkeypatch):
    """The same fault in a running engine: a request decoding into its second block and
    another's prefill save together; both finish, and every hold goes."""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with make_llm(TierConfig(cpu_bytes=4 << 20)) as llm:
        engine, manager = llm.engine, llm.engine.connector
        engine.add_request(PROMPTS[0][: BLOCK + 1], params)
        while not engine.scheduler.running or (
            engine.scheduler.running[0].num_computed_tokens < 2 * BLOCK - 1
        ):
            engine.step()
        engine.add_request(PROMPTS[1][: BLOCK + 1], params)
        with monkeypatch.context() as m:
            m.setattr(manager.stores()["cpu"], "reserve_many", _fail)
            engine.step()
        done = []
        while engine.has_unfinished_requests():
            done += [out for out in engine.step() if out.finished]
        assert [len(out.token_ids) for out in done] == [20, 20]
        manager.flush(30)
        engine.scheduler.apply_transfers(manager.poll())
        assert engine.block_manager.num_held_blocks == 0
        assert manager.stats()["cpu"]["dropped"] == 1


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


# ---------------------------------------------------------------- on CUDA

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def cuda_llm(tiers: TierConfig | None, **engine) -> LLM:
    """:func:`make_llm` on the GPU (``None``: no tiers)."""
    kwargs = dict(device="cuda", max_model_len=256, num_gpu_blocks_override=16, **engine)
    return LLM("tiny", **kwargs) if tiers is None else build_llm("tiny", tiers, **kwargs)


@pytest.mark.cuda
@needs_cuda
def test_cuda_restores_generate_what_the_engines_own_prefix_hit_does(disk):
    """Blocks offloaded by DMA on the side stream come back from the CPU pool, and from disk
    in a new engine, as the KV the engine computed: a hit generates the tokens of the
    engine's own prefix-cache hit (the same computation on the same KV)."""
    with cuda_llm(None) as llm:
        cold = llm.generate(PROMPTS[0], GREEDY)[0]
        gpu_hit = llm.generate(PROMPTS[0], GREEDY)[0]
    assert gpu_hit.num_cached_tokens == hit_tokens(PROMPTS[0])
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=4 << 20, disk_bytes=64 << 20)
    with cuda_llm(tiers) as llm:
        first = llm.generate(PROMPTS[0], GREEDY)[0]
        llm.generate(FLUSH, GREEDY)  # takes every block of the engine's pool
        cpu_hit = llm.generate(PROMPTS[0], GREEDY)[0]
        assert llm.engine.connector.stats()["cpu"]["hit_blocks"] == 8
    with cuda_llm(tiers) as llm:
        disk_hit = llm.generate(PROMPTS[0], GREEDY)[0]
        stats = llm.engine.connector.stats()["disk"]
    assert first.token_ids == cold.token_ids
    assert cpu_hit.token_ids == disk_hit.token_ids == gpu_hit.token_ids
    assert cpu_hit.num_cached_tokens == disk_hit.num_cached_tokens == hit_tokens(PROMPTS[0])
    assert stats["hit_blocks"] == 8 and stats["corrupt"] == stats["load_failures"] == 0


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("codec", ["kivi4", "kivi2"])
def test_cuda_kivi_blocks_are_quantized_on_the_gpu_and_restored(codec):
    with cuda_llm(TierConfig(cpu_bytes=4 << 20, codec=codec)) as llm:
        llm.generate(PROMPTS[0], GREEDY)
        llm.generate(FLUSH, GREEDY)
        cpu_hit = llm.generate(PROMPTS[0], GREEDY)[0]
        stats = llm.engine.connector.stats()["cpu"]
    assert cpu_hit.num_cached_tokens == hit_tokens(PROMPTS[0])
    assert stats["hit_blocks"] == 8 and stats["load_failures"] == 0


@pytest.mark.cuda
@needs_cuda
def test_cuda_an_offload_that_fails_when_queued_drops_its_blocks(monkeypatch):
    """On CUDA a KIVI offload is queued by the engine thread, so a failing kernel raises
    there, not on a thread: its blocks are dropped all the same (slots given back, GPU blocks
    released once) and the engine serves on."""
    with cuda_llm(None) as llm:
        expected = [llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS[:2]]

    def broken(self, blocks, out):
        raise RuntimeError("device error")

    with cuda_llm(TierConfig(cpu_bytes=4 << 20, codec="kivi4")) as llm:
        # broken after start-up, whose warm-up ran the kernels once
        monkeypatch.setattr(KiviCodec, "encode_blocks", broken)
        out = llm.generate(PROMPTS[0], GREEDY)[0]
        assert_all_dropped(llm.engine.connector, 8)
        assert [out.token_ids, llm.generate(PROMPTS[1], GREEDY)[0].token_ids] == expected


@pytest.mark.cuda
@needs_cuda
def test_cuda_a_pool_larger_than_the_host_can_pin_is_refused_naming_its_setting():
    manager = TierManager(TierConfig(cpu_bytes=1 << 50))
    kv_cache = torch.zeros(4, 1, 2, BLOCK, 1, 8, device="cuda")  # [blocks, L, 2, T, H, D]
    with pytest.raises(ValueError, match=r"cpu_bytes=\d+: cannot pin .*; lower it"):
        manager.register_kv_cache(kv_cache, bytes(32), BLOCK)
    manager.close()


@pytest.mark.parametrize("codec", ["raw", "kivi4"])
def test_closing_gives_back_the_kv_cache_and_the_pool_while_the_llm_lives_on(disk, codec):
    """The KV cache and the CPU pool's slab (pinned memory on a GPU host) are freed by close,
    not only when the last reference to the LLM goes."""
    import gc
    import weakref

    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=4 << 20, disk_bytes=64 << 20, codec=codec)
    llm = make_llm(tiers)
    llm.generate(PROMPTS[:1], GREEDY)
    cache = weakref.ref(llm.engine.model_runner.kv_cache)
    slab = weakref.ref(llm.engine.connector._stores.pool.slab)
    llm.close()
    gc.collect()
    assert cache() is None and slab() is None
    assert llm.engine.connector.stats() is not None  # still answers after close
