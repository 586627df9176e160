"""Whole-block copies between a block-major KV cache and the CPU pool's slab."""
from __future__ import annotations

import gc

import pytest
import torch

from storage.cpu_pool import CpuBlockPool
from storage.pinned import PinnedSlab
from tiered_kv.block_mover import BlockMover, _runs

SHAPE = (12, 3, 2, 4, 2, 8)  # [num_blocks, L, 2, T, H, D]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make(device: str = "cpu", num_slots: int = 16) -> tuple[torch.Tensor, CpuBlockPool, BlockMover]:
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(SHAPE, generator=g).to(torch.bfloat16).to(device)
    nbytes = cache[0].numel() * cache.element_size()
    pool = CpuBlockPool(num_slots * nbytes, block_nbytes=nbytes, pin_memory=device == "cuda")
    return cache, pool, BlockMover(cache, pool.slab)


def slot(pool: CpuBlockPool, s: int) -> torch.Tensor:
    return pool.slot_view(s, torch.bfloat16, SHAPE[1:])


def test_runs_join_blocks_and_slots_that_both_go_up_by_one():
    assert _runs([(3, 0), (4, 1), (5, 2), (9, 3), (10, 7), (11, 8)]) == [
        (3, 0, 3), (9, 3, 1), (10, 7, 2)
    ]
    assert _runs([]) == []


def test_offload_then_restore_round_trips_the_bytes():
    cache, pool, mover = make()
    pairs = [(0, 5), (1, 6), (7, 0), (3, 9)]
    assert mover.offload(pairs).done()
    for b, s in pairs:
        assert torch.equal(slot(pool, s), cache[b].cpu())
    original = cache.clone()
    cache.zero_()
    assert mover.restore(pairs).done()
    for b, _ in pairs:
        assert torch.equal(cache[b], original[b])
    assert not cache[2].any()  # only the restored blocks were written


def test_a_cache_that_is_not_block_major_is_refused():
    cache, pool, _ = make()
    with pytest.raises(ValueError, match="block-major"):
        BlockMover(cache.transpose(0, 1), pool.slab)
    with pytest.raises(ValueError, match="slab"):
        BlockMover(cache, pool.slab[:, :-1])


@pytest.mark.cuda
@needs_cuda
def test_cuda_round_trip_and_slot_reuse_after_offload():
    cache, pool, mover = make("cuda")
    assert pool.pin_memory
    pairs = [(b, b + 2) for b in range(8)]
    copy = mover.offload(pairs)
    copy.wait()
    stored = [slot(pool, s).clone() for _, s in pairs]
    cache[:8].fill_(7)  # the engine reuses the blocks right after the copy's event
    torch.cuda.synchronize()
    for (b, s), expected in zip(pairs, stored):
        assert torch.equal(slot(pool, s), expected)
    mover.restore(pairs).wait()
    for (b, _), expected in zip(pairs, stored):
        assert torch.equal(cache[b].cpu(), expected)


@pytest.mark.cuda
@needs_cuda
def test_cuda_offload_reads_the_block_after_the_compute_stream_wrote_it():
    cache, pool, mover = make("cuda")
    torch.cuda._sleep(50_000_000)  # keep the compute stream busy, then write the block
    cache[3].fill_(1.5)
    copy = mover.offload([(3, 0)])
    copy.wait()
    assert torch.all(slot(pool, 0) == 1.5)


@pytest.mark.cuda
@needs_cuda
def test_a_slab_dropped_without_close_unpins_its_memory():
    slab = PinnedSlab(4, 1 << 20)
    memory = slab.tensor  # outlives the slab
    del slab
    gc.collect()
    cudart = torch.cuda.cudart()
    # still registered, CUDA would refuse the range (error 712) and a later slab placed at
    # this address by the allocator could not be pinned
    assert int(cudart.cudaHostRegister(memory.data_ptr(), memory.numel(), 0)) == 0
    assert int(cudart.cudaHostUnregister(memory.data_ptr())) == 0
