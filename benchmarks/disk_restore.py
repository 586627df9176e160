"""The disk tier's load path alone, without a model: GB/s of restoring one request's blocks
from the LMDB store (fresh manager, page cache warm) into the KV cache, against ``pread`` of
the same bytes into a (pinned on CUDA) host slab, in the same run.

Per block shape (``1b``: 512 KiB, ``8b``: 2 MiB of bf16 KV per 16-token block; ``tiny``:
64 KiB fp32) and codec, ``--blocks`` blocks are saved through a :class:`TierManager`,
flushed, and loaded ``--repeats`` times by a second manager on the same directory with no
CPU pool (a staging buffer that holds the request), the way a restarted server loads them.
The figure is the load job's own time (``BlockLoader.run``), median of the repeats.
"Cores busy" is the process's CPU time over that time (every thread's, BLAKE3's workers
included): near the reader thread count, the load is bound by each core's work (memory
bandwidth, the MAC); near 1, something serializes the readers. ``--read-threads 1,4,8``
loads the same blocks with each reader thread count in turn, to show how the load scales.

    .venv/bin/python benchmarks/disk_restore.py [--shapes 1b,8b] [--codecs raw,zstd]
        [--blocks 256] [--repeats 3] [--read-threads 1,4,8] [--device auto|cuda|cpu] [--out ...]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_common import BLOCK, SHAPES, machine, write_json
from engine import gc_heap
from engine.config import DTYPES
from engine.connector import SavedBlock
from engine.hashing import block_hash, root_hash
from reference_copies import pread_bandwidth
from tiered_kv import block_loader
from tiered_kv.config import TierConfig
from tiered_kv.tier_manager import TierManager

REPO = Path(__file__).resolve().parents[1]
SEED = 0
NAMESPACE = bytes(32)


def saved_chain(blocks: int) -> list[SavedBlock]:
    out, parent = [], root_hash(NAMESPACE, None)
    for i in range(blocks):
        tokens = tuple(range(BLOCK * i, BLOCK * (i + 1)))
        h = block_hash(parent, tokens)
        out.append(SavedBlock(h, None if i == 0 else parent, tokens, i, True))
        parent = h
    return out


def restore(shape_name: str, codec: str, blocks: int, repeats: int, device: str,
            folder: Path, read_threads: list[int]) -> list[dict]:
    """One row per reader thread count: the same saved blocks, loaded by a fresh manager."""
    shape = SHAPES[shape_name]
    nbytes = blocks * shape.block_nbytes
    config = TierConfig(kv_cache_dir=folder, cpu_bytes=0, disk_bytes=4 * nbytes + (64 << 20),
                        codec=codec, staging_bytes=(blocks + 4 * 16 + 8) * shape.block_nbytes)
    g = torch.Generator().manual_seed(SEED)
    kv = torch.randn((blocks, *shape.block_shape), generator=g).to(DTYPES[shape.dtype])
    kv = kv.to(device)
    chain = saved_chain(blocks)
    writer = TierManager(config)
    try:
        writer.register_kv_cache(kv, NAMESPACE, BLOCK)
        writer.save_blocks(chain)
        if not writer.flush(600):
            raise RuntimeError("the store did not take every block")
    finally:
        writer.close()
    pread = pread_bandwidth(folder, shape.block_nbytes, blocks, pin=device == "cuda")
    rows = []
    for threads in read_threads:
        times, busy = load(config, kv, chain, repeats, threads)
        restore_bps = nbytes / statistics.median(times)
        rows.append(dict(shape=shape_name, codec=codec, blocks=blocks, read_threads=threads,
                         block_nbytes=shape.block_nbytes, restore_Bps=restore_bps,
                         pread_Bps=pread, ratio=restore_bps / pread,
                         cores_busy=statistics.median(busy)))
    return rows


def load(config: TierConfig, kv: torch.Tensor, chain: list[SavedBlock], repeats: int,
         threads: int) -> tuple[list[float], list[float]]:
    """``repeats`` loads of ``chain`` by a manager with ``threads`` reader threads: each
    load's seconds, and its CPU seconds (every thread's) per second."""
    block_loader.READ_THREADS = block_loader.READ_AHEAD = threads
    target = torch.zeros_like(kv)
    times, busy = [], []
    reader = TierManager(config)
    try:
        reader.register_kv_cache(target, NAMESPACE, BLOCK)
        hashes = [b.block_hash for b in chain]
        if reader.get_num_matched_blocks("r", hashes, 0) != len(chain):
            raise RuntimeError("the store lost blocks")
        wanted = reader._lookup.wanted("r", hashes, list(range(len(chain))))
        gc_heap.freeze_startup_heap()  # as an engine's process has it (engine/gc_heap.py)
        for _ in range(repeats):
            cpu = time.process_time()
            result = reader._loader.run("r", wanted)
            cpu = time.process_time() - cpu
            if result.loaded != len(chain):
                raise RuntimeError(f"loaded {result.loaded} of {len(chain)} blocks")
            times.append(result.seconds)
            busy.append(cpu / result.seconds)
    finally:
        gc_heap.thaw()
        reader.close()
    if config.codec == "raw" and not torch.equal(target, kv):
        raise RuntimeError("restored KV differs from what was saved")
    return times, busy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="1b,8b")
    parser.add_argument("--codecs", default="raw,zstd")
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--read-threads", default=str(block_loader.READ_THREADS),
                        help="reader thread counts to compare, e.g. 1,2,4,8 (default: the loader's)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/disk_restore.json")
    args = parser.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    try:
        read_threads = [int(n) for n in args.read_threads.split(",")]
    except ValueError:
        read_threads = [0]
    if unknown or args.blocks < 1 or args.repeats < 1 or min(read_threads) < 1:
        parser.error(f"shapes are {', '.join(SHAPES)}; --blocks, --repeats and --read-threads "
                     "positive")
    rows = []
    for shape in args.shapes.split(","):
        for codec in args.codecs.split(","):
            with tempfile.TemporaryDirectory(prefix="disk-restore-") as tmp:
                rows += restore(shape, codec, args.blocks, args.repeats, device, Path(tmp),
                                read_threads)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"Disk restore into the KV cache on {name}, {args.blocks} blocks, page cache warm:")
    print("| shape | block KiB | codec | reader threads | restore GB/s | pread GB/s | ratio | cores busy |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['block_nbytes'] >> 10} | {r['codec']} | {r['read_threads']} | "
              f"{r['restore_Bps'] / 1e9:.2f} | {r['pread_Bps'] / 1e9:.2f} | {r['ratio']:.2f} | "
              f"{r['cores_busy']:.1f} of {os.cpu_count()} |")
    command = "python benchmarks/disk_restore.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_json(args.out, {"command": command, "machine": machine(), "device": name, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
