"""The worker side of a load: chunks read ahead on reader threads, restored in order,
stopping at the first block that cannot be served, with every pool slot given back."""
from __future__ import annotations

import dataclasses
import threading
import time

import torch

from engine.hashing import block_hash, root_hash
from storage.base import BlockKey
from storage.codecs import encode_block
from storage.cpu_pool import CpuBlockPool
from storage.lmdb_store import LmdbStore
from tiered_kv import block_loader
from tiered_kv.block_loader import BlockLoader, WantedBlock
from tiered_kv.block_mover import BlockMover
from tiered_kv.metrics import TierMetrics

NS = bytes(32)
SHAPE = (2, 2, 4, 1, 8)  # [L, 2, T, H, D]: 512 bytes of fp32 per block
BLOCKS = 200


def chain(n: int) -> list[tuple[BlockKey, bytes | None, tuple[int, ...]]]:
    out, parent = [], root_hash(NS, None)
    for i in range(n):
        tokens = tuple(range(4 * i, 4 * i + 4))
        h = block_hash(parent, tokens)
        out.append((BlockKey(NS, h), None if i == 0 else parent, tokens))
        parent = h
    return out


def make(tmp_path, bad: int | None = None):
    blocks = chain(BLOCKS)
    source = torch.randn(BLOCKS, *SHAPE)
    store = LmdbStore(tmp_path / "disk", 64 << 20)
    for i, (key, parent, tokens) in enumerate(blocks):
        if i == bad:
            tokens = (9, 9, 9, 9)  # does not hash to its key
        store.put(key, encode_block(key, parent, tokens, source[i], "raw"))
    store.flush()
    pool = CpuBlockPool(400 * 512, block_nbytes=512, keep_clean=False, pin_memory=False)
    cache = torch.zeros(BLOCKS + 8, *SHAPE)
    metrics = TierMetrics(("cpu", "disk"), dict, lambda: None)
    loader = BlockLoader(
        pool, BlockMover(cache, pool.slab), {"disk": store}, metrics,
        block_shape=SHAPE, dtype=torch.float32, promote=lambda tier: (),
    )
    # block i goes to engine block i + 3
    wanted = [WantedBlock(k, i + 3, p, "disk") for i, (k, p, _) in enumerate(blocks)]
    return loader, pool, store, cache, source, wanted


def test_a_long_load_reads_ahead_and_restores_every_block_in_place(tmp_path, monkeypatch):
    loader, pool, store, cache, source, wanted = make(tmp_path)
    reads, active, lock = [], [0, 0], threading.Lock()  # active: now, most at once
    fetch = loader._fetch

    def slow_fetch(chunk):
        with lock:
            active[0] += 1
            active[1] = max(active)
        time.sleep(0.02)  # a slow disk: the next chunks are read meanwhile
        try:
            reads.append(len(chunk))
            return fetch(chunk)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(loader, "_fetch", slow_fetch)
    result = loader.run("r", wanted)
    assert result.loaded == BLOCKS and result.by_tier == {"disk": BLOCKS}
    assert torch.equal(cache[3 : BLOCKS + 3], source)
    assert sum(reads) == BLOCKS
    assert 1 < active[1] <= block_loader.READ_AHEAD
    assert pool.num_evictable() == pool.num_slots  # nothing left held
    loader.close()
    store.close()


def test_a_long_load_in_a_pool_short_of_slots_reads_less_ahead_and_loads_every_block(tmp_path):
    """A pool whose other slots hold blocks the writers have not written leaves a load only
    its reserve (JOB_SLOTS): the job reads one chunk ahead, which fits, not as many as the
    whole pool would allow, which would not (a chunk that finds no slot ends the load)."""
    loader, pool, store, cache, source, wanted = make(tmp_path)
    others = pool.reserve_many([0] * (pool.num_slots - block_loader.JOB_SLOTS))
    result = loader.run("r", wanted)
    assert result.loaded == BLOCKS and torch.equal(cache[3 : BLOCKS + 3], source)
    assert pool.num_evictable() == block_loader.JOB_SLOTS
    for slot in others:
        pool.unreserve(slot)
    loader.close()
    store.close()


def test_a_bad_block_ends_the_load_there_and_chunks_read_past_it_are_let_go(tmp_path):
    loader, pool, store, cache, source, wanted = make(tmp_path, bad=150)
    result = loader.run("r", wanted)
    assert result.loaded == 150
    assert torch.equal(cache[3:153], source[:150])
    assert pool.num_evictable() == pool.num_slots
    loader.close()
    store.close()


def test_a_failing_read_loads_nothing_and_holds_nothing(tmp_path, monkeypatch):
    loader, pool, store, cache, source, wanted = make(tmp_path)
    calls = []

    def reading(keys):
        calls.append(keys)
        if len(calls) == 3:
            raise OSError("disk gone")
        return LmdbStore.reading(store, keys)

    monkeypatch.setattr(store, "reading", reading)
    assert loader.run("r", wanted).loaded == 0
    assert pool.num_evictable() == pool.num_slots
    loader.close()
    store.close()


def test_the_load_is_reported_once_restored_and_its_last_slots_let_go_after(tmp_path):
    loader, pool, store, cache, source, wanted = make(tmp_path)
    seen = []

    def report(result):  # the engine may run the request from here on
        seen.append((result.loaded, torch.equal(cache[3 : BLOCKS + 3], source),
                     pool.num_evictable()))

    result = loader.run("r", wanted, report)
    (loaded, restored, evictable), = seen
    assert loaded == result.loaded == BLOCKS and restored
    assert evictable < pool.num_slots  # the last chunks' slots were still held ...
    assert pool.num_evictable() == pool.num_slots  # ... and let go after the report
    loader.close()
    store.close()


def test_a_load_from_the_pool_alone_is_one_restore(tmp_path, monkeypatch):
    loader, pool, store, cache, source, wanted = make(tmp_path)
    pool.keep_clean = True  # keep the blocks the first load promotes
    assert loader.run("r", wanted).loaded == BLOCKS
    cache.zero_()
    restores = []
    restore = loader._mover.restore

    def counted(pairs, after=None):
        restores.append(len(pairs))
        return restore(pairs, after)

    monkeypatch.setattr(loader._mover, "restore", counted)
    in_pool = [dataclasses.replace(w, tier="cpu") for w in wanted]
    result = loader.run("r", in_pool)
    assert result.loaded == BLOCKS and result.by_tier == {"cpu": BLOCKS} and restores == [BLOCKS]
    assert torch.equal(cache[3 : BLOCKS + 3], source)
    assert pool.num_evictable() == pool.num_slots
    loader.close()
    store.close()


def test_a_restore_whose_wait_fails_loads_nothing_and_holds_nothing(tmp_path, monkeypatch):
    """A copy that fails when waited for (a device error): the load fails, and the slots of
    the chunk it restored are let go with the rest."""
    loader, pool, store, cache, source, wanted = make(tmp_path)
    restore, copies = loader._mover.restore, []

    class FailingCopy:
        def __init__(self, copy):
            self.copy, self.number = copy, len(copies)

        def wait(self):
            self.copy.wait()
            if self.number == 0:
                raise RuntimeError("device error")

    def failing_restore(pairs, after=None):
        copies.append(FailingCopy(restore(pairs, after)))
        return copies[-1]

    monkeypatch.setattr(loader._mover, "restore", failing_restore)
    assert loader.run("r", wanted).loaded == 0
    assert len(copies) >= 3  # the first copy was waited for while later chunks were held
    assert pool.num_evictable() == pool.num_slots
    loader.close()
    store.close()


def test_a_decode_that_fails_unexpectedly_gives_its_slot_back(tmp_path, monkeypatch):
    loader, pool, store, cache, source, wanted = make(tmp_path)
    decode, calls = loader._decode_into, []

    def failing_decode(record, parent, out):
        calls.append(record.key)
        if len(calls) == 20:
            raise MemoryError("no memory to decode")
        decode(record, parent, out)

    monkeypatch.setattr(loader, "_decode_into", failing_decode)
    assert loader.run("r", wanted).loaded == 0
    assert pool.num_evictable() == pool.num_slots
    loader.close()
    store.close()


def test_a_chunk_read_from_disk_goes_to_ascending_slots(tmp_path):
    """The reader threads take each chunk's slots at once, in ascending order: from a fresh
    pool a chunk of consecutive blocks restores as one copy, not a copy per block (threads
    taking a slot per block interleaved them), and slots given back in any order come out
    ascending again."""
    loader, pool, store, cache, source, wanted = make(tmp_path)
    moves = []
    restore = loader._mover._restore
    loader._mover._restore = lambda pairs: (moves.append([s for _, s in pairs]), restore(pairs))[1]
    loads = []
    for _ in range(2):  # the second load takes the slots the first one gave back
        cache.zero_()
        result = loader.run("r", wanted)
        assert result.loaded == BLOCKS and torch.equal(cache[3 : BLOCKS + 3], source)
        loads.append(moves[:])
        moves.clear()
    for slots in loads[0]:
        assert slots == list(range(slots[0], slots[0] + len(slots)))
    for slots in loads[1]:
        assert slots == sorted(slots)
    assert pool.num_evictable() == pool.num_slots
