from __future__ import annotations

import hashlib
import threading

import pytest
import torch

from storage.base import BlockKey
from storage.cpu_pool import CpuBlockPool, HostBlock

NS = hashlib.sha256(b"ns").digest()


def key(i: int) -> BlockKey:
    return BlockKey(NS, hashlib.sha256(str(i).encode()).digest())


def block(i: int, shape=(2, 2, 4, 2, 8), dtype=torch.bfloat16) -> HostBlock:
    g = torch.Generator().manual_seed(i)
    return HostBlock(torch.randn(shape, generator=g).to(dtype), None, (i,))


BLOCK_BYTES = block(0).kv.numel() * 2


def test_slab_is_sized_from_the_first_block():
    pool = CpuBlockPool(10 * BLOCK_BYTES + 5)
    assert pool.num_slots == 0
    pool.put(key(0), block(0))
    assert (pool.num_slots, pool.slot_nbytes) == (10, BLOCK_BYTES)


def test_pinned_only_when_asked_or_cuda_present():
    assert CpuBlockPool(BLOCK_BYTES).pin_memory == torch.cuda.is_available()
    assert not CpuBlockPool(BLOCK_BYTES, pin_memory=False).pin_memory


def test_block_of_another_size_is_refused_and_counted():
    pool = CpuBlockPool(8 * BLOCK_BYTES, block_nbytes=BLOCK_BYTES)
    assert not pool.put(key(1), block(1, shape=(1, 2, 4, 2, 8)))
    assert not pool.contains(key(1))
    assert pool.stats().dropped == 1


def test_block_larger_than_the_pool_is_refused():
    pool = CpuBlockPool(BLOCK_BYTES // 2)
    assert not pool.put(key(0), block(0))
    assert pool.stats().dropped == 1


def test_dtype_and_shape_are_kept():
    pool = CpuBlockPool(4 * BLOCK_BYTES)
    b = HostBlock(torch.arange(128, dtype=torch.float16).view(2, 2, 4, 2, 4), b"p" * 32, (7, 8))
    pool.put(key(0), b)
    got = pool.get(key(0))
    assert got.kv.dtype == torch.float16 and got.kv.shape == (2, 2, 4, 2, 4)
    assert torch.equal(got.kv, b.kv) and got.parent_hash == b"p" * 32 and got.token_ids == (7, 8)


def test_non_contiguous_input_is_stored_by_value():
    pool = CpuBlockPool(4 * BLOCK_BYTES)
    kv = block(3).kv.transpose(3, 4).contiguous().transpose(3, 4)
    assert not kv.is_contiguous()
    pool.put(key(3), HostBlock(kv, None, (3,)))
    assert torch.equal(pool.get(key(3)).kv, kv)


def test_read_into_copies_into_the_callers_tensor():
    pool = CpuBlockPool(4 * BLOCK_BYTES)
    pool.put(key(0), block(0))
    out = torch.zeros_like(block(0).kv)
    assert pool.read_into(key(0), out)
    assert torch.equal(out, block(0).kv)
    assert not pool.read_into(key(9), out)
    with pytest.raises(ValueError, match="read_into"):
        pool.read_into(key(0), torch.zeros(3, dtype=torch.bfloat16))


def test_eviction_hands_a_copy_to_the_callback():
    evicted = []
    pool = CpuBlockPool(2 * BLOCK_BYTES, on_evict=lambda k, b: evicted.append((k, b)))
    for i in range(3):
        pool.put(key(i), block(i))
    assert [k for k, _ in evicted] == [key(0)]
    pool.put(key(3), block(3))  # reuses block 0's old slot; the copy must be unaffected
    assert torch.equal(evicted[0][1].kv, block(0).kv)
    assert evicted[0][1].token_ids == (0,)


def test_a_block_being_read_is_not_evicted():
    pool = CpuBlockPool(2 * BLOCK_BYTES)
    pool.put(key(0), block(0))
    pool.put(key(1), block(1))
    entered, release = threading.Event(), threading.Event()

    out = torch.zeros_like(block(0).kv)
    original_copy = out.copy_

    def slow_copy(src, non_blocking=False):
        entered.set()
        release.wait(5)
        return original_copy(src, non_blocking=non_blocking)

    out.copy_ = slow_copy
    reader = threading.Thread(target=pool.read_into, args=(key(0), out))
    reader.start()
    assert entered.wait(5)
    pool.put(key(2), block(2))  # key 0 is the LRU one but is being read: key 1 goes
    release.set()
    reader.join()
    assert torch.equal(out, block(0).kv)
    assert pool.contains(key(0)) and not pool.contains(key(1)) and pool.contains(key(2))


def test_invalid_construction():
    with pytest.raises(ValueError):
        CpuBlockPool(0)
    with pytest.raises(ValueError):
        CpuBlockPool(100, block_nbytes=200)
