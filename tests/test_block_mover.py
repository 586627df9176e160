"""Whole-block copies between a block-major KV cache and the CPU pool's slab."""
from __future__ import annotations

import gc
import threading

import pytest
import torch

from storage.codecs import get_codec
from storage.codecs.kivi import dequantize_block, quantize_block
from storage.cpu_pool import CpuBlockPool
from storage.pinned import PinnedSlab
from tiered_kv import block_mover
from tiered_kv.block_mover import BlockMover, _runs

SHAPE = (12, 3, 2, 4, 2, 8)  # [num_blocks, L, 2, T, H, D]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make(
    device: str = "cpu", num_slots: int = 16, codec: str = "raw", dtype=torch.bfloat16
) -> tuple[torch.Tensor, CpuBlockPool, BlockMover]:
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(SHAPE, generator=g).to(dtype).to(device)
    stage = get_codec(codec).stage
    nbytes = stage.payload_size(cache.dtype, SHAPE[1:])
    pool = CpuBlockPool(num_slots * nbytes, block_nbytes=nbytes, pin_memory=device == "cuda")
    return cache, pool, BlockMover(cache, pool.slab, stage)


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


@pytest.mark.parametrize("bits, dtype", [(2, torch.bfloat16), (4, torch.bfloat16),
                                         (4, torch.float8_e4m3fn)], ids=str)
def test_kivi_slots_hold_payloads_quantized_before_the_copy(monkeypatch, bits, dtype):
    """With a KIVI codec a slot holds the block's KIVI payload (smaller than the block),
    and a restore writes the dequantized block, in chunks of the staging area."""
    block_nbytes = torch.empty(SHAPE[1:], dtype=dtype).nbytes
    monkeypatch.setattr(block_mover, "STAGING_BYTES", 3 * block_nbytes)  # 3 blocks per chunk
    cache, pool, mover = make(codec=f"kivi{bits}", dtype=dtype)
    assert mover.slot_nbytes == pool.slot_nbytes == get_codec(f"kivi{bits}").payload_size(
        dtype, SHAPE[1:]
    )
    if dtype == torch.bfloat16:
        assert mover.slot_nbytes < cache[0].numel() * cache.element_size()
    assert (mover.slot_dtype, mover.slot_shape) == (torch.uint8, (mover.slot_nbytes,))
    pairs = [(0, 5), (1, 6), (7, 0), (3, 9), (4, 10), (11, 11), (2, 1)]  # 3 chunks
    original = cache.clone()
    threads = []
    encode = mover.stage.encode_blocks

    def recording_encode(blocks, out):
        threads.append(threading.current_thread().name)
        encode(blocks, out)

    monkeypatch.setattr(mover.stage, "encode_blocks", recording_encode)
    copy = mover.offload(pairs)
    assert mover.asynchronous  # the engine thread only hands the work over
    copy.wait()
    assert copy.done()
    assert len(threads) == 3 and all(t.startswith("tiered-kv-offload") for t in threads)
    for b, s in pairs:
        assert torch.equal(pool.slab[s], quantize_block(original[b], bits))
    cache.zero_()
    assert mover.restore(pairs).done()
    for b, s in pairs:
        expected = dequantize_block(pool.slab[s].clone(), bits, dtype, SHAPE[1:])
        assert torch.equal(cache[b].view(torch.uint8), expected.view(torch.uint8))
    assert not cache[[5, 6, 8, 9, 10]].view(torch.uint8).any()  # only the restored blocks
    mover.close()


def test_raw_copies_through_the_staging_area_move_the_same_bytes(monkeypatch):
    """The staged raw path (a gather on the device, one copy per run of slots) writes the
    slots and the blocks a direct copy writes, in chunks of the staging area."""
    block_nbytes = torch.empty(SHAPE[1:], dtype=torch.bfloat16).nbytes
    monkeypatch.setattr(block_mover, "STAGING_BYTES", 3 * block_nbytes)  # 3 blocks per chunk
    cache, pool, direct = make()
    staged = BlockMover(cache, pool.slab, staged=True)
    assert staged.staged and not direct.staged
    assert staged._in.payloads.data_ptr() == staged._in.bytes.data_ptr()  # no second buffer
    pairs = [(9, 0), (2, 1), (5, 2), (6, 3), (0, 7), (11, 8), (3, 9)]  # scattered blocks
    staged.offload(pairs).wait()
    for b, s in pairs:
        assert torch.equal(slot(pool, s), cache[b])
    original = cache.clone()
    cache.zero_()
    back = [(b, s) for b, s in reversed(pairs)]
    staged.restore(back).wait()
    for b, _ in pairs:
        assert torch.equal(cache[b], original[b])
    assert not cache[1].any() and not cache[4].any()  # only the restored blocks were written


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
def test_cuda_restore_after_a_fence_waits_for_the_forward_queued_before_it():
    """A block freed while a forward still writes it (a request aborted mid-prefill) and
    handed to a load: the restore starts only after that write."""
    cache, pool, mover = make("cuda")
    mover.offload([(3, 0)]).wait()
    stored = slot(pool, 0).clone()
    torch.cuda._sleep(1_000_000_000)  # the queued forward (~0.5 s) ...
    cache[3].fill_(7)  # ... and its write into block 3
    mover.restore([(3, 0)], mover.fence()).wait()
    assert torch.equal(cache[3].cpu(), stored)


def test_on_the_cpu_there_is_no_fence_to_wait_for():
    _, _, mover = make()
    assert mover.fence() is None


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("codec", ["kivi4", "kivi2"])
def test_cuda_kivi_round_trip_matches_the_host_and_survives_slot_reuse(codec):
    """Quantized on the GPU before the copy: the slots hold the same bytes the CPU path
    writes, the engine may reuse the blocks after the copy's event, and a restore gives
    the same tensor as decoding on the CPU."""
    cache, pool, mover = make("cuda", codec=codec)
    host_cache, host_pool, host_mover = make("cpu", codec=codec)
    pairs = [(b, 15 - b) for b in range(0, 12, 2)]
    mover.offload(pairs).wait()
    host_mover.offload(pairs).wait()  # on the CPU it runs on the mover's thread
    stored = [pool.slab[s].clone() for _, s in pairs]
    cache.fill_(7)  # reused right after the copy's event
    torch.cuda.synchronize()
    for (_, s), expected in zip(pairs, stored):
        assert torch.equal(pool.slab[s], expected)
        assert torch.equal(pool.slab[s], host_pool.slab[s])
    mover.restore(pairs).wait()
    host_mover.restore(pairs)
    for b, _ in pairs:
        assert torch.equal(cache[b].cpu(), host_cache[b])
    assert torch.all(cache[1] == 7)
    host_mover.close()


@pytest.mark.cuda
@needs_cuda
def test_cuda_kivi_mover_runs_its_kernels_once_when_built():
    """The KIVI kernels compile when the mover is built (at start-up), not in the first
    offload on the engine thread: construction encodes and decodes one block."""
    calls = []

    class Counting(type(get_codec("kivi4").stage)):
        def encode_blocks(self, blocks, out):
            calls.append("encode")
            super().encode_blocks(blocks, out)

        def decode_blocks(self, payloads, out):
            calls.append("decode")
            super().decode_blocks(payloads, out)

    stage = Counting(4)
    cache = torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda")
    nbytes = stage.payload_size(cache.dtype, SHAPE[1:])
    pool = CpuBlockPool(4 * nbytes, block_nbytes=nbytes, pin_memory=True)
    BlockMover(cache, pool.slab, stage)
    assert calls == ["encode", "decode"]


@pytest.mark.cuda
@needs_cuda
def test_cuda_staged_raw_copies_match_direct_ones():
    cache, pool, direct = make("cuda")
    staged = BlockMover(cache, pool.slab, staged=True)
    pairs = [(9, 0), (2, 1), (5, 2), (6, 3), (0, 7), (11, 8), (3, 9)]
    staged.offload(pairs).wait()
    stored = pool.slab.clone()
    direct.offload(pairs).wait()
    assert torch.equal(pool.slab, stored)
    original = cache.clone()
    cache.zero_()
    staged.restore(pairs).wait()
    assert torch.equal(cache[[b for b, _ in pairs]], original[[b for b, _ in pairs]])
    assert not cache[1].any()


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


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("direction", ["offload", "restore"])
def test_cuda_a_batch_that_fails_part_way_waits_for_what_it_queued(monkeypatch, direction):
    """The caller gives the slots and blocks back on the error (the saver unreserves the
    slots, a load lets them go and the engine recomputes into the blocks): nothing the
    batch queued may still be running by then."""
    block_nbytes = torch.empty(SHAPE[1:], dtype=torch.bfloat16).nbytes
    monkeypatch.setattr(block_mover, "STAGING_BYTES", block_nbytes)  # one block per chunk
    cache, pool, _ = make("cuda")
    mover = BlockMover(cache, pool.slab, staged=True)
    move, calls = block_mover._move, []

    def slow_then_failing(dst, src, runs, cuda):
        calls.append(runs)
        if len(calls) == 2:
            raise RuntimeError("CUDA out of memory")
        torch.cuda._sleep(200_000_000)  # on the side stream: the first chunk is still queued
        move(dst, src, runs, cuda)

    monkeypatch.setattr(block_mover, "_move", slow_then_failing)
    stream = mover.offload_stream if direction == "offload" else mover.restore_stream
    with pytest.raises(RuntimeError, match="out of memory"):
        getattr(mover, direction)([(0, 0), (1, 1)])
    assert len(calls) == 2 and stream.query()
