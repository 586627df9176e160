"""Reference copies for the tier benchmarks: how fast the plain copy of the same bytes runs
on this machine, measured in the same run as the restore it is compared with.

- :func:`copy_bandwidth`: one copy from a host slab (pinned on CUDA) into a block-major
  tensor on the device, what a CPU-pool restore is judged against;
- :func:`pread_bandwidth`: ``preadv`` of a file in the page cache into a (pinned) slab, one
  call per block, what a disk restore is judged against.

``ttft_tiers.py`` judges its restores on the CPU against :func:`memcpy_bandwidth` (``copy_``
per block) and :func:`plain_read_bandwidth` (``pread`` per block, and ``preadv`` into
preallocated buffers).
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

from storage.pinned import PinnedSlab
from bench_common import DTYPES, Shape

REFERENCE_REPEATS = 5


def evict_cpu_caches() -> None:
    """Stream through more memory than any CPU cache holds, so that the next copy reads from
    DRAM, as a restore does (its source was written long before, by another request)."""
    torch.ones(64 << 20, dtype=torch.float32).sum()


def write_plain_file(folder: Path, block_nbytes: int, blocks: int) -> Path:
    """``folder/plain-read.bin``: ``blocks`` random blocks, written and synced (so they are
    in the page cache), what the plain reads read."""
    path = folder / "plain-read.bin"
    piece = os.urandom(block_nbytes)
    with open(path, "wb") as f:
        for _ in range(blocks):
            f.write(piece)
        f.flush()
        os.fsync(f.fileno())
    return path


def copy_bandwidth(shape: Shape, blocks: int, device: torch.device) -> float:
    """Bytes/s of one copy of ``blocks`` blocks from a host slab (pinned on CUDA) into a
    block-major tensor on ``device`` (CPU caches cold; median of REFERENCE_REPEATS)."""
    cuda = device.type == "cuda"
    slab = PinnedSlab(blocks, shape.block_nbytes, pin=cuda)
    try:
        src = slab.tensor  # [N, block bytes]
        src.fill_(1)
        kv = torch.zeros((blocks, *shape.block_shape), dtype=DTYPES[shape.dtype], device=device)
        dst = kv.view(blocks, -1).view(torch.uint8)  # [N, block bytes] of [N, L, 2, T, H, D]
        times = []
        for _ in range(REFERENCE_REPEATS + 1):  # the first one warms up
            evict_cpu_caches()
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        del kv, dst
    finally:
        slab.close()
    return blocks * shape.block_nbytes / statistics.median(times[1:])


def pread_bandwidth(folder: Path, block_nbytes: int, blocks: int, pin: bool) -> float:
    """Bytes/s of ``preadv`` of a file just written (page cache warm), one call per block,
    into a preallocated host slab (pinned on CUDA), CPU caches cold."""
    path = write_plain_file(folder, block_nbytes, blocks)
    slab = PinnedSlab(blocks, block_nbytes, pin=pin)
    rows = slab.tensor.numpy()  # [N, block bytes]
    rows.fill(0)  # fault the pages in outside the timing
    fd = os.open(path, os.O_RDONLY)
    try:
        times = []
        for _ in range(REFERENCE_REPEATS):
            evict_cpu_caches()
            start = time.perf_counter()
            done = sum(os.preadv(fd, [rows[i]], i * block_nbytes) for i in range(blocks))
            times.append(time.perf_counter() - start)
            if done != blocks * block_nbytes:
                raise RuntimeError(f"short read of {path}")
    finally:
        os.close(fd)
        del rows
        slab.close()
        path.unlink()
    return blocks * block_nbytes / statistics.median(times)


def memcpy_bandwidth(
    block_shape: torch.Size, dtype: torch.dtype, blocks: int, repeats: int = 5
) -> dict:
    """Bytes per second (median of ``repeats``, caches cold) of ``copy_`` of ``blocks``
    blocks from a preallocated host slab into a preallocated block-major tensor, the
    engine's KV-cache layout (where a restore has to put them)."""
    src = torch.randn((blocks, *block_shape)).to(dtype)  # [N, L, 2, T, H, D]
    contiguous = torch.empty_like(src)
    times: list[float] = []
    for _ in range(repeats):
        evict_cpu_caches()
        start = time.perf_counter()
        for i in range(blocks):
            contiguous[i].copy_(src[i])
        times.append(time.perf_counter() - start)
    nbytes = src.numel() * src.element_size()
    return {"contiguous": nbytes / statistics.median(times)}


def plain_read_bandwidth(folder: Path, block_nbytes: int, blocks: int, repeats: int = 5) -> dict:
    """Bytes per second (median of ``repeats``, CPU caches cold) of reading ``blocks``
    record-sized blocks of a freshly written file (in the page cache): ``pread`` (a new
    buffer per block, as the store's reads) and ``preadv`` into one preallocated buffer
    per block (no allocation: the fastest plain read)."""
    path = write_plain_file(folder, block_nbytes, blocks)
    into = [bytearray(block_nbytes) for _ in range(blocks)]
    for buf in into:
        buf[::4096] = bytes(len(buf[::4096]))  # fault the pages in once, outside the timing
    times: dict[str, list[float]] = {"pread": [], "preadv_into": []}
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(repeats):
            evict_cpu_caches()
            start = time.perf_counter()
            got = [os.pread(fd, block_nbytes, i * block_nbytes) for i in range(blocks)]
            times["pread"].append(time.perf_counter() - start)
            assert sum(map(len, got)) == blocks * block_nbytes
            del got
            evict_cpu_caches()
            start = time.perf_counter()
            done = sum(os.preadv(fd, [into[i]], i * block_nbytes) for i in range(blocks))
            times["preadv_into"].append(time.perf_counter() - start)
            assert done == blocks * block_nbytes
    finally:
        os.close(fd)
        path.unlink()
    return {name: blocks * block_nbytes / statistics.median(t) for name, t in times.items()}
