from __future__ import annotations

import hashlib
import threading

import pytest
import torch

from storage.base import BlockKey
from storage.cpu_eviction import LOAD_SHARE, PASSING_SHARE
from storage.cpu_pool import CpuBlockPool
from storage.cpu_slots import HostBlock
from storage.pinned import available_host_bytes
from storage.priority_lru import DEFAULT_PRIORITY

NS = hashlib.sha256(b"ns").digest()


def key(i: int) -> BlockKey:
    return BlockKey(NS, hashlib.sha256(str(i).encode()).digest())


def block(i: int, shape=(2, 2, 4, 2, 8), dtype=torch.bfloat16) -> HostBlock:
    g = torch.Generator().manual_seed(i)
    return HostBlock(torch.randn(shape, generator=g).to(dtype), None, (i,))


BLOCK_BYTES = block(0).kv.numel() * 2


def test_slab_is_sized_from_the_first_block():
    pool = CpuBlockPool(10 * BLOCK_BYTES + 5, pin_memory=False)
    assert pool.num_slots == 0
    pool.put(key(0), block(0))
    assert (pool.num_slots, pool.slot_nbytes) == (10, BLOCK_BYTES)


def test_pinned_only_when_asked_or_cuda_present():
    assert CpuBlockPool(BLOCK_BYTES).pin_memory == torch.cuda.is_available()
    assert not CpuBlockPool(BLOCK_BYTES, pin_memory=False).pin_memory


def test_a_pinned_slab_larger_than_the_host_memory_is_refused_before_it_is_allocated():
    """Pinned pages stay resident: asking for more than the host has fails with a message,
    not in the allocator or in cudaHostRegister (nor by the OOM killer while pinning)."""
    assert 0 < available_host_bytes() <= _mem_total()
    with pytest.raises(ValueError, match=r"cannot pin 1048576\.00 GiB of host memory"):
        CpuBlockPool(1 << 50, block_nbytes=1 << 20, pin_memory=True)


def _mem_total() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))


def test_block_of_another_size_is_refused_and_counted():
    pool = CpuBlockPool(8 * BLOCK_BYTES, block_nbytes=BLOCK_BYTES, pin_memory=False)
    assert not pool.put(key(1), block(1, shape=(1, 2, 4, 2, 8)))
    assert not pool.contains(key(1))
    assert pool.stats().dropped == 1


def test_block_larger_than_the_pool_is_refused():
    pool = CpuBlockPool(BLOCK_BYTES // 2, pin_memory=False)
    assert not pool.put(key(0), block(0))
    assert pool.stats().dropped == 1


def test_dtype_and_shape_are_kept():
    pool = CpuBlockPool(4 * BLOCK_BYTES, pin_memory=False)
    b = HostBlock(torch.arange(128, dtype=torch.float16).view(2, 2, 4, 2, 4), b"p" * 32, (7, 8))
    pool.put(key(0), b)
    got = pool.get(key(0))
    assert got.kv.dtype == torch.float16 and got.kv.shape == (2, 2, 4, 2, 4)
    assert torch.equal(got.kv, b.kv) and got.parent_hash == b"p" * 32 and got.token_ids == (7, 8)


def test_non_contiguous_input_is_stored_by_value():
    pool = CpuBlockPool(4 * BLOCK_BYTES, pin_memory=False)
    kv = block(3).kv.transpose(3, 4).contiguous().transpose(3, 4)
    assert not kv.is_contiguous()
    pool.put(key(3), HostBlock(kv, None, (3,)))
    assert torch.equal(pool.get(key(3)).kv, kv)


def test_acquire_gives_a_view_of_the_slot_until_release():
    pool = CpuBlockPool(4 * BLOCK_BYTES, pin_memory=False)
    pool.put(key(0), block(0))
    held = pool.acquire(key(0))
    assert held.key == key(0) and torch.equal(held.kv, block(0).kv)
    assert held.kv.data_ptr() == pool.slab[held.slot].data_ptr()
    pool.release(key(0))
    assert pool.acquire(key(9)) is None
    assert pool.stats().misses == 1


def test_a_block_being_read_is_not_evicted():
    pool = CpuBlockPool(2 * BLOCK_BYTES, pin_memory=False)
    pool.put(key(0), block(0))
    pool.put(key(1), block(1))
    held = pool.acquire(key(0))
    pool.put(key(2), block(2))  # key 0 is the LRU one but is being read: key 1 goes
    assert torch.equal(held.kv, block(0).kv)
    pool.release(key(0))
    assert pool.contains(key(0)) and not pool.contains(key(1)) and pool.contains(key(2))


def reserve_and_commit(pool: CpuBlockPool, i: int, pending=("disk",)) -> bool:
    slot = pool.reserve()
    if slot is None:
        return False
    b = block(i)
    pool.slot_view(slot, b.kv.dtype, tuple(b.kv.shape)).copy_(b.kv)
    return pool.commit(key(i), slot, b.kv.dtype, tuple(b.kv.shape), None, b.token_ids, pending)


def test_pending_blocks_are_never_evicted_and_the_pool_says_when_it_is_full():
    pool = CpuBlockPool(2 * BLOCK_BYTES, block_nbytes=BLOCK_BYTES, pin_memory=False)
    assert reserve_and_commit(pool, 0) and reserve_and_commit(pool, 1)
    assert pool.num_pending("disk") == 2 and pool.num_evictable() == 0
    assert pool.reserve() is None  # every slot holds a block not yet written
    taken = pool.take_pending("disk", 8, timeout=0)
    assert [b.key for b in taken] == [key(0), key(1)]  # oldest first
    assert torch.equal(taken[0].kv, block(0).kv)
    assert pool.take_pending("disk", 8, timeout=0) == []  # taken blocks are not handed out twice
    pool.done_pending("disk", [key(0)])
    assert pool.num_pending("disk") == 1 and pool.wait_pending("disk", 0) is False
    assert pool.reserve() is not None  # block 0 is written: its slot may be reused
    assert not pool.contains(key(0)) and pool.contains(key(1))


def test_take_pending_without_views_gives_the_slots():
    pool = CpuBlockPool(2 * BLOCK_BYTES, block_nbytes=BLOCK_BYTES, pin_memory=False)
    assert reserve_and_commit(pool, 0)
    (taken,) = pool.take_pending("disk", 8, timeout=0, views=False)
    assert taken.key == key(0) and taken.kv is None
    assert torch.equal(pool.slab[taken.slot], block(0).kv.reshape(-1).view(torch.uint8))


def test_take_pending_waits_for_a_commit():
    pool = CpuBlockPool(4 * BLOCK_BYTES, block_nbytes=BLOCK_BYTES, pin_memory=False)
    threading.Timer(0.05, reserve_and_commit, args=(pool, 3)).start()
    taken = pool.take_pending("disk", 8, timeout=5)
    assert [b.key for b in taken] == [key(3)]


def test_a_block_pending_for_two_tiers_stays_until_both_are_done():
    pool = CpuBlockPool(BLOCK_BYTES, block_nbytes=BLOCK_BYTES, pin_memory=False)
    assert reserve_and_commit(pool, 0, pending=("disk", "remote"))
    pool.done_pending("disk", [b.key for b in pool.take_pending("disk", 1, timeout=0)])
    assert pool.reserve() is None and pool.num_pending("remote") == 1
    assert pool.drop_pending("remote") == 1
    assert pool.wait_pending("remote", 0) and pool.reserve() is not None


def test_blocks_done_together_are_evicted_in_the_order_they_were_done():
    """A writer reports a batch done at once: the blocks become evictable in the order it
    names them (the least recently written first), one still pending elsewhere stays, and a
    block the writer did not take is not touched."""
    pool = CpuBlockPool(4 * BLOCK_BYTES, block_nbytes=BLOCK_BYTES, pin_memory=False)
    for i in (0, 1, 2):
        assert reserve_and_commit(pool, i, pending=("disk", "remote") if i == 1 else ("disk",))
    taken = [b.key for b in pool.take_pending("disk", 3, timeout=0)]
    assert reserve_and_commit(pool, 3)  # pending, not taken
    pool.done_pending("disk", [key(2), key(1), key(0), key(3), key(9)])
    assert pool.num_pending("disk") == 1 and pool.num_pending("remote") == 1
    assert taken == [key(0), key(1), key(2)] and pool.num_evictable() == 2
    assert pool.reserve() is not None and not pool.contains(key(2))  # evicted first
    assert pool.reserve() is not None and not pool.contains(key(0))
    assert pool.reserve() is None  # block 1 waits for the remote tier, block 3 for the disk


def test_a_staging_pool_lets_a_block_go_once_written():
    pool = CpuBlockPool(2 * BLOCK_BYTES, block_nbytes=BLOCK_BYTES, keep_clean=False, pin_memory=False)
    assert reserve_and_commit(pool, 0)
    assert pool.contains(key(0))  # findable while it waits for the disk
    pool.done_pending("disk", [b.key for b in pool.take_pending("disk", 1, timeout=0)])
    assert not pool.contains(key(0)) and pool.num_evictable() == 2


def commit_slots(pool: CpuBlockPool, first: int, slots: list[int], pending=("disk",), **kw):
    kv = block(0).kv
    for i, slot in enumerate(slots, first):
        assert pool.commit(key(i), slot, kv.dtype, tuple(kv.shape), None, (i,), pending, **kw)


def test_saves_leave_the_reserve_for_loads_in_a_pool_full_of_pending_blocks():
    """A disk that does not keep up: saves fill the pool with blocks not yet written up to
    ``load_reserve`` slots and are then refused (a refusal, for a write-back writer, and
    no room to retry), while a load's reservation still gets the reserved slots, and again
    once they hold its clean blocks. A written block makes room for one more save."""
    slots = 2 * LOAD_SHARE
    pool = CpuBlockPool(slots * BLOCK_BYTES, block_nbytes=BLOCK_BYTES, pin_memory=False,
                        pass_through=True, load_reserve=2)
    saved = pool.reserve_many([0] * slots, save=True)
    assert len(saved) == slots - 2 and pool.refused() == 1
    commit_slots(pool, 0, saved)
    assert pool.num_pending("disk") == slots - 2
    assert pool.num_savable() == 0 and pool.num_evictable() == 2
    assert pool.reserve_many([0], save=True) == [] and pool.refused() == 2  # a save waits
    loaded = pool.reserve_many([0, 0])  # a disk hit: decoded into the reserve, held
    assert len(loaded) == 2
    commit_slots(pool, 100, loaded, pending=(), hold=True)
    assert pool.reserve_many([0]) == []  # both held while they are restored
    pool.release_many([key(100), key(101)])  # clean now: the reserve holds hits
    assert pool.num_savable() == 0 and pool.reserve_many([0], save=True) == []
    again = pool.reserve_many([0, 0])  # the next hit evicts them
    assert len(again) == 2 and not pool.contains(key(100))
    for slot in again:
        pool.unreserve(slot)
    (taken,) = pool.take_pending("disk", 1, timeout=0)
    pool.done_pending("disk", [taken.key])
    assert pool.num_savable() == 1 and len(pool.reserve_many([0, 0], save=True)) == 1


def test_the_reserve_for_loads_is_a_bounded_share_and_only_of_a_pool_that_keeps_blocks():
    """At most one slot in LOAD_SHARE: a pool too small to spare one keeps none, so saves
    can always fill it; a staging buffer keeps none (it holds no clean block); without a
    reserve, saves may take every slot."""
    def pool_of(slots: int, **kw) -> CpuBlockPool:
        return CpuBlockPool(slots * BLOCK_BYTES, block_nbytes=BLOCK_BYTES, pin_memory=False,
                            load_reserve=100, **kw)

    assert pool_of(4 * LOAD_SHARE).load_reserve == 4
    tiny = pool_of(LOAD_SHARE - 1)
    assert tiny.load_reserve == 0 and len(tiny.reserve_many([0] * 8, save=True)) == LOAD_SHARE - 1
    staging = pool_of(4 * LOAD_SHARE, keep_clean=False)
    assert staging.load_reserve == 0 and staging.num_savable() == 4 * LOAD_SHARE
    plain = CpuBlockPool(4 * BLOCK_BYTES, block_nbytes=BLOCK_BYTES, pin_memory=False)
    assert len(plain.reserve_many([0] * 4, save=True)) == 4
    lazy = CpuBlockPool(4 * LOAD_SHARE * BLOCK_BYTES, pin_memory=False, load_reserve=1)
    assert lazy.load_reserve == 0
    lazy.put(key(0), block(0))  # the slab comes with the first block
    assert lazy.load_reserve == 1
    with pytest.raises(ValueError, match="load_reserve"):
        CpuBlockPool(BLOCK_BYTES, load_reserve=-1)


def test_commit_of_a_key_already_there_frees_the_slot():
    pool = CpuBlockPool(2 * BLOCK_BYTES, block_nbytes=BLOCK_BYTES, pin_memory=False)
    assert reserve_and_commit(pool, 0, pending=())
    assert not reserve_and_commit(pool, 0, pending=())
    assert pool.num_evictable() == 2 and pool.stats().entries == 1


def test_the_slab_is_one_allocation_of_whole_slots():
    pool = CpuBlockPool(10 * BLOCK_BYTES + 5, block_nbytes=BLOCK_BYTES, pin_memory=False)
    assert tuple(pool.slab.shape) == (10, BLOCK_BYTES) and pool.slab.is_contiguous()


def test_invalid_construction():
    with pytest.raises(ValueError):
        CpuBlockPool(0)
    with pytest.raises(ValueError):
        CpuBlockPool(100, block_nbytes=200)


# ---------------------------------------------------------------- eviction by priority


def test_eviction_takes_the_highest_priority_value_first_then_the_least_recent():
    pool = CpuBlockPool(4 * BLOCK_BYTES, pin_memory=False)
    for i, priority in enumerate([5, 0, -1, 5]):
        assert pool.put(key(i), block(i), priority=priority)
    pool.get(key(0))  # 0 is now the more recent of the two at 5
    for i in (4, 5, 6):
        assert pool.put(key(i), block(i))  # priority 0
    assert sorted(k for k in pool.keys()) == sorted(key(i) for i in (2, 4, 5, 6))
    assert pool.stats().evictions == 3


def test_a_newcomer_never_evicts_a_block_that_matters_more():
    pool = CpuBlockPool(2 * BLOCK_BYTES, pin_memory=False)
    pool.put(key(0), block(0), priority=-1)
    pool.put(key(1), block(1), priority=0)
    assert not pool.put(key(2), block(2), priority=1)  # only more important blocks to evict
    assert pool.stats().dropped == 1
    assert pool.reserve(priority=1) is None
    slot = pool.reserve(priority=0)  # evicts 1, its equal
    assert slot is not None and not pool.contains(key(1)) and pool.contains(key(0))
    pool.unreserve(slot)


def test_a_newcomer_is_outranked_only_when_every_slot_holds_a_block_that_matters_more():
    """Written or not, read or not, a block that matters more never makes room for it."""
    kv = block(0).kv

    def commit(pool, i, slot, pending, priority):
        shape = tuple(kv.shape)
        assert pool.commit(key(i), slot, kv.dtype, shape, None, (i,), pending, priority=priority)

    pool = CpuBlockPool(2 * BLOCK_BYTES, block_nbytes=BLOCK_BYTES, pin_memory=False)
    commit(pool, 0, pool.reserve(), (), 0)
    assert pool.outranked([1]) == [False]  # a free slot
    slot = pool.reserve()
    assert pool.outranked([1]) == [False]  # a reserved slot may be given back
    commit(pool, 1, slot, ("disk",), 0)
    assert pool.outranked([1, 0, -1]) == [True, False, False]
    pool.delete(key(1))
    commit(pool, 1, pool.reserve(), ("disk",), 1)  # evictable by a 1 once written
    assert pool.outranked([1, 2]) == [False, True]
    staging = CpuBlockPool(
        BLOCK_BYTES, block_nbytes=BLOCK_BYTES, pin_memory=False, keep_clean=False
    )
    commit(staging, 0, staging.reserve(), ("disk",), 0)
    assert staging.outranked([1]) == [False]  # it leaves once written


def test_a_block_every_evictable_block_outranks_passes_through_a_bounded_share_of_slots():
    """With ``pass_through``, a newcomer that matters less than every block in a full pool
    takes the slot of the one evicted first, one slot in PASSING_SHARE at most, and leaves
    once written (counted as evicted); a load promoted into the pool (``put``) never passes,
    and neither does anything without ``pass_through``."""
    kv = block(0).kv
    slots = PASSING_SHARE + 2  # room for one passing block

    def full_of_gold(pass_through: bool) -> CpuBlockPool:
        pool = CpuBlockPool(slots * BLOCK_BYTES, block_nbytes=BLOCK_BYTES, pin_memory=False,
                            pass_through=pass_through)
        for i in range(slots):
            assert pool.put(key(i), block(i), priority=-10)
        return pool

    pool = full_of_gold(pass_through=False)
    assert pool.reserve(priority=0) is None and pool.outranked([0]) == [True]
    pool = full_of_gold(pass_through=True)
    assert not pool.put(key(100), block(100), priority=0)  # a promotion never passes
    assert pool.outranked([0]) == [False]
    slot = pool.reserve(priority=0)
    assert slot is not None and not pool.contains(key(0))  # the gold block evicted first
    assert pool.reserve(priority=0) is None  # the share is taken
    assert pool.commit(key(100), slot, kv.dtype, tuple(kv.shape), None, (100,), ("disk",),
                       priority=0)
    assert pool.contains(key(100))  # served while it waits for the disk
    (taken,) = pool.take_pending("disk", 8, timeout=0, views=False)
    assert taken.key == key(100)
    pool.done_pending("disk", [key(100)])
    assert not pool.contains(key(100)) and pool.stats().evictions == 2
    assert pool.stats().entries == slots - 1 == pool.stats().puts - pool.stats().evictions
    assert not pool.put(key(102), block(102), priority=0)  # its slot is not for the outranked
    assert pool.reserve(priority=-10) == slot  # but for a block that matters as much as any
    passing = pool.reserve(priority=0)  # another gold block evicted for a passing one
    assert passing is not None and pool.reserve(priority=0) is None
    assert pool.commit(key(101), passing, kv.dtype, tuple(kv.shape), None, (101,), (),
                       priority=0)
    assert not pool.contains(key(101))  # nothing to write: it passed at once
    assert pool.reserve(priority=-10) == passing and pool.reserve(priority=0) is not None


def test_chains_are_evicted_from_their_end():
    """A chain's first block is its least recently used: evicting it first (plain LRU)
    left the rest in the pool with no lookup able to reach it. The ends of chains go first,
    and when an end goes the block before it is the chain's end, the least recently used."""
    kv = block(0).kv
    pool = CpuBlockPool(6 * BLOCK_BYTES, block_nbytes=BLOCK_BYTES, pin_memory=False)

    def save_chain(first: int, length: int) -> None:
        slots = pool.reserve_many([0] * length)
        parents = [None] + [key(i).block_hash for i in range(first, first + length - 1)]
        for i, slot, parent in zip(range(first, first + length), slots, parents):
            assert pool.commit(key(i), slot, kv.dtype, tuple(kv.shape), parent, (i,))

    save_chain(0, 3)  # a: 0 ─ 1 ─ 2
    save_chain(10, 3)  # b: 10 ─ 11 ─ 12, used later
    save_chain(20, 2)  # evicts a's end, then the block before it
    assert [pool.contains(key(i)) for i in (0, 1, 2, 10, 11, 12)] == [1, 0, 0, 1, 1, 1]
    pool.get(key(10))  # b's first block read: b is no colder than a's rest
    save_chain(30, 1)  # a's first block now ends its chain, the least recently used
    assert not pool.contains(key(0)) and all(pool.contains(key(i)) for i in (10, 11, 12, 20, 21))
    save_chain(40, 1)  # the least recently used end is b's (its start was read, not its end)
    assert not pool.contains(key(12)) and pool.contains(key(11))
    assert pool.reserve() is not None and not pool.contains(key(11))  # the end now
    assert all(pool.contains(key(i)) for i in (10, 20, 21, 30, 40))


def test_a_save_of_a_block_that_came_in_meanwhile_is_still_written_below():
    """A load promoted the block (pending for no tier) between a save's look into the pool
    and its commit: the commit is refused, but the block is now pending for the tiers the
    save was for (they were lost, and a flush said True without the remote tier having it)."""
    kv = block(0).kv
    pool = CpuBlockPool(4 * BLOCK_BYTES, block_nbytes=BLOCK_BYTES, pin_memory=False)
    promoted, saved = pool.reserve_many([0, 0])
    assert pool.commit(key(1), promoted, kv.dtype, tuple(kv.shape), None, (1,), ("disk",))
    pool.done_pending("disk", [b.key for b in pool.take_pending("disk", 8, timeout=0)])
    assert not pool.commit(key(1), saved, kv.dtype, tuple(kv.shape), None, (1,),
                           ("disk", "remote"))
    assert [b.key for b in pool.take_pending("remote", 8, timeout=0)] == [key(1)]
    assert [b.key for b in pool.take_pending("disk", 8, timeout=0)] == [key(1)]
    assert pool.num_evictable() == 4 - 1  # the refused save's slot is free; the block is not


def test_pending_and_read_blocks_stay_whatever_their_priority():
    pool = CpuBlockPool(3 * BLOCK_BYTES, block_nbytes=BLOCK_BYTES, pin_memory=False)
    kv = block(0).kv
    for i, pending in enumerate([("disk",), (), ()]):
        slot = pool.reserve()
        pool.slot_view(slot, kv.dtype, tuple(kv.shape)).copy_(block(i).kv)
        pool.commit(key(i), slot, kv.dtype, tuple(kv.shape), None, (i,), pending, priority=9)
    held = pool.acquire(key(1))
    assert pool.num_evictable() == 1  # only block 2: 0 is pending, 1 is read
    assert pool.reserve(priority=0) is not None and not pool.contains(key(2))
    assert pool.reserve(priority=0) is None
    (taken,) = pool.take_pending("disk", 8)
    assert taken.key == key(0) and taken.priority == 9  # the writers pass it down
    pool.done_pending("disk", [key(0)])
    pool.release(held.key)
    assert pool.num_evictable() == 2
    assert pool.reserve(priority=9) is not None and not pool.contains(key(0))  # clean first


def test_batched_acquire_and_release_keep_the_counts_and_the_eviction_order():
    pool = CpuBlockPool(4 * BLOCK_BYTES, block_nbytes=BLOCK_BYTES, pin_memory=False)
    for i in range(3):
        assert reserve_and_commit(pool, i, pending=("disk",) if i == 2 else ())
    slots = pool.acquire_slots([key(1), key(9), key(0), key(2), key(1)])
    assert slots[1] is None and None not in slots[:1] + slots[2:] and slots[0] == slots[4]
    stats = pool.stats()
    assert (stats.hits, stats.misses, stats.bytes_read) == (4, 1, 4 * BLOCK_BYTES)
    assert pool.num_evictable() == 1  # the free slot: 0 and 1 are read, 2 is pending
    pool.release_many([key(0), key(1), key(9), key(2)])  # key 1 is still held once
    assert pool.num_evictable() == 2
    pool.release_many([key(1)])
    assert pool.num_evictable() == 3
    # read last, key 1 is the most recent: key 0 is evicted first
    pool.reserve()
    assert pool.reserve() is not None and not pool.contains(key(0)) and pool.contains(key(1))


def test_a_staging_pool_frees_a_read_block_when_its_last_reader_lets_go():
    pool = CpuBlockPool(2 * BLOCK_BYTES, block_nbytes=BLOCK_BYTES, keep_clean=False, pin_memory=False)
    slot = pool.reserve()
    kv = block(0).kv
    assert pool.commit(key(0), slot, kv.dtype, tuple(kv.shape), None, (0,), hold=True)
    assert pool.contains(key(0)) and pool.num_evictable() == 1
    pool.release_many([key(0)])
    assert not pool.contains(key(0)) and pool.num_evictable() == 2


def test_batched_reserve_stops_at_the_first_block_without_a_slot_and_commit_files_each():
    from storage.cpu_slots import Commit

    pool = CpuBlockPool(3 * BLOCK_BYTES, block_nbytes=BLOCK_BYTES, pin_memory=False)
    assert reserve_and_commit(pool, 0, pending=()) and pool.num_evictable() == 3
    slots = pool.reserve_many([0, 0, -1, 0])  # the free two, then block 0 matters no more
    assert len(slots) == 3 and not pool.contains(key(0))
    assert pool.reserve_many([0]) == []
    kv = block(1).kv
    done = pool.commit_many(
        [Commit(key(1), slots[0], None, (1,), ("disk",)),
         Commit(key(2), slots[1], key(1).block_hash, (2,), (), priority=7),
         Commit(key(1), slots[2], None, (1,))],  # already there: its slot goes back
        kv.dtype, tuple(kv.shape),
    )
    assert done == [True, True, False]
    assert pool.num_pending("disk") == 1 and pool.num_evictable() == 2  # key 2 and the freed slot
    (taken,) = pool.take_pending("disk", 8, timeout=0)
    assert taken.key == key(1) and taken.kv.shape == kv.shape
    held = pool.acquire(key(2))
    assert held.parent_hash == key(1).block_hash and held.token_ids == (2,) and held.priority == 7
    assert pool.stats().puts == 3


def test_a_commit_with_an_invalid_key_raises_before_taking_any_slot():
    from storage.cpu_slots import Commit

    pool = CpuBlockPool(2 * BLOCK_BYTES, block_nbytes=BLOCK_BYTES, pin_memory=False)
    slots = pool.reserve_many([0, 0])
    kv = block(1).kv
    bad = BlockKey(b"short", key(2).block_hash)
    with pytest.raises(ValueError, match="two"):
        pool.commit_many([Commit(key(1), slots[0], None, (1,), ("disk",)),
                          Commit(bad, slots[1], None, (2,), ("disk",))], kv.dtype, tuple(kv.shape))
    assert not pool.contains(key(1)) and pool.num_evictable() == 0  # both still the caller's
    for slot in slots:
        pool.unreserve(slot)
    assert pool.num_evictable() == 2


def test_slots_reserved_together_come_in_ascending_order_after_being_given_back():
    """Slots given back one by one return to the free list in the order they left it; taken
    again together they come ascending, so consecutive blocks meet consecutive slots."""
    pool = CpuBlockPool(8 * BLOCK_BYTES, block_nbytes=BLOCK_BYTES, pin_memory=False)
    first = pool.reserve_many([0] * 6)
    assert first == [0, 1, 2, 3, 4, 5]
    for slot in first:
        pool.unreserve(slot)
    assert pool.reserve_many([0] * 6) == [0, 1, 2, 3, 4, 5]  # the free list pops 5, 4, ... 0


def test_removals_count_every_block_that_left_the_pool():
    """An eviction, a delete, a staging pool's block once written and close count; storing,
    reading and writing blocks out do not (a lookup's run is still held while it holds)."""
    pool = CpuBlockPool(2 * BLOCK_BYTES, block_nbytes=BLOCK_BYTES, pin_memory=False)
    pool.put(key(0), block(0))
    pool.put(key(1), block(1))
    pool.get(key(0))
    pool.acquire(key(1))
    pool.release(key(1))
    pool.add_pending("disk", [key(1)])
    pool.done_pending("disk", [b.key for b in pool.take_pending("disk", 1)])
    assert pool.removals == 0
    pool.put(key(2), block(2))  # evicts key(0), used longest ago
    assert pool.removals == 1 and not pool.contains(key(0))
    assert pool.delete(key(1)) and pool.removals == 2
    assert not pool.delete(key(1)) and pool.removals == 2
    pool.close()
    assert pool.removals == 3
    staging = CpuBlockPool(2 * BLOCK_BYTES, block_nbytes=BLOCK_BYTES, pin_memory=False,
                           keep_clean=False)
    assert reserve_and_commit(staging, 1) and staging._priorities == {DEFAULT_PRIORITY: 1}
    staging.take_pending("disk", 8, timeout=0)
    staging.done_pending("disk", [key(1)])  # written: a staging pool lets it go
    assert not staging.contains(key(1)) and not staging._priorities
