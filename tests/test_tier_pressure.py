"""The tier manager under write pressure: saves wait for a slot or drop, never stall the
engine, write-back writes when it must; a failing offload or a save that fails part way
drops its blocks, says so once, and the engine serves on."""
from __future__ import annotations

import contextlib
import time

import pytest
import torch

from engine import SamplingParams
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.connector import SavedBlock
from engine.hashing import hash_blocks, root_hash
from engine.scheduler import Scheduler
from engine.stats import StatsCollector
from engine_testing import NAMESPACE, make_seq, scheduler_step
from engine_testing import one_thread  # noqa: F401  (autouse fixture)
from storage.codecs.kivi import KiviCodec
from storage.cpu_eviction import LOAD_SHARE
from storage.cpu_pool import CpuBlockPool
from storage.lmdb_store import LmdbStore
from tiered_kv import TierConfig, TierManager, block_saver, pool_writer
from tier_testing import (
    BLOCK, GREEDY, PROMPTS, assert_all_dropped, hit_tokens, make_llm, random_prompts, stall_disk,
    tiny_block_nbytes,
)
from tier_testing import disk, reference  # noqa: F401  (fixtures)


# ---------------------------------------------------------------- write policies and pressure


@pytest.mark.parametrize("buffer", ["staging", "cpu"])
def test_write_pressure_drops_stores_and_never_stalls(reference, disk, monkeypatch, buffer):
    """A buffer of two blocks (the staging buffer, or a CPU tier) and a disk that does not
    keep up: the two wait for the disk, every other block is dropped and counted once (in
    the buffer's tier) once it has waited SAVE_WAIT_S, and the engine keeps producing the
    same tokens."""
    release = stall_disk(monkeypatch).release
    monkeypatch.setattr(block_saver, "SAVE_WAIT_S", 0.0)
    block_nbytes = tiny_block_nbytes()
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
        kv_cache_dir=disk, cpu_bytes=0, disk_bytes=64 << 20, staging_bytes=2 * tiny_block_nbytes()
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
    release = stall_disk(monkeypatch).release
    monkeypatch.setattr(block_saver, "SAVE_WAIT_S", 3600.0)
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=2 * tiny_block_nbytes(), disk_bytes=64 << 20)
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
    stalled = stall_disk(monkeypatch)
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=0, disk_bytes=64 << 20, flush_timeout_s=0.1)
    llm = make_llm(tiers, blocks=64)
    manager = llm.engine.connector
    outs = [llm.generate(PROMPTS[0], GREEDY)[0]]
    assert stalled.writing.wait(10)  # the writer holds its first batch: the others' blocks queue
    outs += [llm.generate(p, GREEDY)[0] for p in PROMPTS[1:]]
    assert [o.token_ids for o in outs] == reference
    assert not manager.flush(0.05)
    wait_pending = CpuBlockPool.wait_pending

    def given_up(self, tier, timeout=None):  # the batch being written finishes late
        done = wait_pending(self, tier, timeout)
        stalled.release.set()
        return done

    monkeypatch.setattr(CpuBlockPool, "wait_pending", given_up)
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


def test_write_back_writes_to_disk_only_under_pressure_and_at_close(reference, disk):
    tiers = TierConfig(
        kv_cache_dir=disk, cpu_bytes=10 * tiny_block_nbytes(), disk_bytes=64 << 20,
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


def test_disk_hits_are_served_while_the_pool_is_full_of_blocks_the_disk_has_not_written(
    disk, monkeypatch, caplog
):
    """A long prompt saved behind a disk that does not keep up fills the CPU pool with blocks
    not yet written, and the rest of its saves wait. A request whose prefix the disk has
    from before still loads it from disk, into the slots the pool keeps for loads, instead
    of recomputing it; once the disk goes on, every saved block reaches it."""
    bs, slots = 4, 8 * LOAD_SHARE
    source = torch.randn(160, 1, 2, bs, 1, 2)  # [N, L, 2, T, H, D]
    slot = source[0].numel() * source.element_size()
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=slots * slot, disk_bytes=1 << 20)
    tokens = random_prompts(2, 80 * bs, seed=3)
    prefix = hash_blocks(root_hash(NAMESPACE), tokens[0][: 8 * bs], bs)  # blocks 0-7
    long = hash_blocks(root_hash(NAMESPACE), tokens[1], bs)  # 80 blocks, more than the pool

    def save(manager, hashes, token_ids, first_id):
        manager.save_blocks([
            SavedBlock(h, hashes[i - 1] if i else None, tuple(token_ids[i * bs : (i + 1) * bs]),
                       first_id + i, True)
            for i, h in enumerate(hashes)
        ])

    with contextlib.closing(TierManager(tiers)) as manager:
        manager.register_kv_cache(source.clone(), NAMESPACE, bs)
        save(manager, prefix, tokens[0], 0)
        assert manager.flush(10)
    stalled = stall_disk(monkeypatch)
    kv_cache = source.clone()
    kv_cache[100:108] = 0  # where the hit is loaded to
    manager = TierManager(tiers)
    try:
        manager.register_kv_cache(kv_cache, NAMESPACE, bs)
        pool = manager.stores()["cpu"]
        save(manager, long, tokens[1], 8)
        assert stalled.writing.wait(10)  # the writer holds its first batch
        saved = manager.poll().saved  # the rest of the saves wait for a slot
        assert len(saved) == pool.num_pending("disk") == slots - pool.load_reserve > 0
        assert pool.num_savable() == 0
        assert manager.get_num_matched_blocks("hit", prefix, 0) == 8
        manager.start_load("hit", prefix, list(range(100, 108)))
        loaded: dict[str, int] = {}
        deadline = time.monotonic() + 10
        while "hit" not in loaded and time.monotonic() < deadline:
            done = manager.poll(0.01)
            loaded.update(done.loaded)
            saved += done.saved
        stats = manager.stats()
        assert loaded == {"hit": 8} and torch.equal(kv_cache[100:108], source[:8])
        assert stats["disk"]["hit_blocks"] == 8 and stats["disk"]["load_failures"] == 0
        assert not [r for r in caplog.records if "no free slot" in r.getMessage()]
        stalled.release.set()
        assert manager.flush(10)
        saved += manager.poll().saved
        assert sorted(saved) == list(range(8, 88))
        stats = manager.stats()
        assert stats["cpu"]["dropped"] == stats["disk"]["dropped"] == 0
        assert stats["disk"]["entries"] == 8 + 80
    finally:
        stalled.release.set()
        manager.close()


def test_write_back_writes_while_saves_wait_for_the_slots_kept_for_loads(disk):
    """A write-back pool full of its own pending blocks but for the slots kept for loads:
    those are no room for saves, so the writer writes until the waiting saves find slots,
    with the engine stepping and no flush. (The reserve keeps the pool's evictable count at
    the low watermark: going by that count, the writer would leave the saves to drop.)"""
    bs, slots = 4, 8 * LOAD_SHARE
    kv_cache = torch.randn(2 * slots, 1, 2, bs, 1, 2)  # [N, L, 2, T, H, D]
    slot = kv_cache[0].numel() * kv_cache.element_size()
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=slots * slot, disk_bytes=1 << 20,
                       write_policy="write-back")
    with contextlib.closing(TierManager(tiers)) as manager:
        manager.register_kv_cache(kv_cache, NAMESPACE, bs)
        manager.save_blocks([  # more than a writer's batch waits for a slot
            SavedBlock((b + 1).to_bytes(32, "big"), None, (b,) * bs, b, True)
            for b in range(2 * slots)
        ])
        saved: list[int] = []
        deadline = time.monotonic() + 5
        while len(saved) < 2 * slots and time.monotonic() < deadline:  # the engine's steps
            saved += manager.poll().saved
            time.sleep(0.01)
        assert sorted(saved) == list(range(2 * slots))
        assert manager.stats()["cpu"]["dropped"] == 0


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
    monkeypatch.setattr(pool, "reserve_many", lambda priorities, save=False: [])  # no room: c's saves wait
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
