"""Storage I/O: tier throughput against the plain-file baseline on the same disk.

    python benchmarks/storage_io.py [--quick] [--out benchmarks/results/storage_io.json]

LMDB section, in batches of ``--batch`` blocks: the store (``sync=True``, one commit and
so one fsync per batch) against ``write`` of the same encoded bytes to a plain file with
one ``fdatasync`` per batch. Puts are timed two ways: ``put_many`` + ``flush`` for every
batch (nothing overlaps), and ``put_many`` for every batch with one ``flush`` at the end
(how the tier manager writes: encoding overlaps the writer thread's commits). Gets are
``get_many`` of a batch (decoded and checksum-verified) against ``pread`` of each block. Reads run
"cold-ish" (page cache of both files dropped with ``posix_fadvise``, then the store opened
and the file read) and warm (a second pass right after). Both sides hold a batch's buffers
until the next batch, live in the same directory and take turns going first; the table
shows medians over repetitions.

CPU pool section: ``put`` of a block into the pool against ``copy_`` of the same tensor
into a preallocated slab, ``read_into`` a preallocated tensor against ``copy_`` out of the
slab, and ``get`` (a caller-owned copy) against ``clone``. On a machine without CUDA the
pool is not pinned, so this measures the pool's own overhead over a memory copy.

Every section is a function in ``SECTIONS`` returning table rows.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import lmdb
import torch

from bench_common import write_json
from storage.base import BlockKey
from storage.cpu_pool import CpuBlockPool
from storage.cpu_slots import HostBlock
from storage.lmdb_store import LmdbStore
from storage.record import Record, encode_record
from storage.seal import SealKey

TARGET_RATIO = 0.70
SEED = 1234
MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class BlockShape:
    name: str
    shape: tuple[int, ...]  # [L, 2, T, H, D]
    dtype: torch.dtype = torch.bfloat16

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


BLOCKS = (
    # 32 layers, K and V, 16 tokens, 8 KV heads, head dim 128: 2 MiB.
    BlockShape("llama3-8b (2 MiB)", (32, 2, 16, 8, 128)),
    # A small model: 16 layers, 4 KV heads, head dim 64: 256 KiB.
    BlockShape("small 16L 4x64 (256 KiB)", (16, 2, 16, 4, 64)),
)


@dataclasses.dataclass
class Row:
    section: str
    case: str
    op: str
    tier_mb_s: float  # median over repetitions
    baseline_mb_s: float
    baseline: str
    tier_samples: list[float]
    baseline_samples: list[float]

    @property
    def ratio(self) -> float:
        return self.tier_mb_s / self.baseline_mb_s

    @property
    def verdict(self) -> str:
        return "PASS" if self.ratio >= TARGET_RATIO else "MISS"


def make_tensors(block: BlockShape, seed: int) -> list[torch.Tensor]:
    """A few distinct KV blocks; every stored block still has its own key and header."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(block.shape, generator=gen).to(block.dtype) for _ in range(8)]


def make_keys(block: BlockShape, count: int) -> list[BlockKey]:
    namespace = hashlib.sha256(f"bench {block.name}".encode()).digest()
    keys, parent = [], namespace
    for i in range(count):
        parent = hashlib.sha256(parent + i.to_bytes(4, "little")).digest()
        keys.append(BlockKey(namespace, parent))
    return keys


def make_records(block: BlockShape, count: int, seed: int) -> list[Record]:
    payloads = [t.view(torch.int16).numpy().tobytes() for t in make_tensors(block, seed)]
    keys = make_keys(block, count)
    return [
        Record(
            key=k,
            parent_hash=keys[i - 1].block_hash if i else None,
            token_ids=tuple(range(16 * i, 16 * i + 16)),
            codec="raw",
            dtype=block.dtype,
            shape=block.shape,
            payload=payloads[i % len(payloads)],
        )
        for i, k in enumerate(keys)
    ]


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def batches(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def lmdb_round(
    workdir: Path, records: list[Record], batch: int, store_first: bool
) -> dict[str, float]:
    """One repetition: write both sides, then read both sides cold-ish and warm (seconds)."""
    store_dir, file_path = workdir / "store", workdir / "blocks.bin"
    seal_key = SealKey.generate()  # the file side seals as the store does
    encoded = [encode_record(r, seal_key) for r in records]
    offsets = [0]
    for data in encoded:
        offsets.append(offsets[-1] + len(data))
    capacity = offsets[-1] * 2
    record_batches = batches(records, batch)
    index_batches = batches(list(range(len(records))), batch)
    times: dict[str, float] = {}

    def open_store() -> LmdbStore:
        # One commit (one fsync) per batch, as the file side does.
        return LmdbStore(store_dir, capacity, sync=True, max_batch_items=batch)

    def put_store(op: str, flush_each: bool) -> None:
        shutil.rmtree(store_dir, ignore_errors=True)
        with open_store() as store:
            t0 = time.perf_counter()
            for chunk in record_batches:
                store.put_many([(r.key, r) for r in chunk])
                if flush_each:
                    store.flush()
            store.flush()
            times[f"{op}/lmdb"] = time.perf_counter() - t0

    def put_file() -> None:
        fd = os.open(file_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        t0 = time.perf_counter()
        for chunk in index_batches:
            for i in chunk:
                os.write(fd, encoded[i])
            os.fdatasync(fd)
        times["put/file"] = time.perf_counter() - t0
        os.close(fd)

    def put_both() -> None:
        put_store("put, flush each batch", flush_each=True)
        put_store("put, streamed", flush_each=False)

    def get_store() -> None:
        with open_store() as store:
            for temperature in ("cold", "warm"):
                t0 = time.perf_counter()
                for chunk in record_batches:
                    got = store.get_many([r.key for r in chunk])
                times[f"get {temperature}/lmdb"] = time.perf_counter() - t0
                assert got[-1].payload == records[-1].payload

    def get_file() -> None:
        fd = os.open(file_path, os.O_RDONLY)
        for temperature in ("cold", "warm"):
            t0 = time.perf_counter()
            for chunk in index_batches:
                got = [os.pread(fd, len(encoded[i]), offsets[i]) for i in chunk]
            times[f"get {temperature}/file"] = time.perf_counter() - t0
            assert got[-1] == encoded[-1]
        os.close(fd)

    order = ((put_both, get_store), (put_file, get_file))
    if not store_first:
        order = order[::-1]
    for put, _ in order:
        put()
    drop_cache(store_dir / "data.mdb")
    drop_cache(file_path)
    for _, get in order:
        get()
    return times


def lmdb_section(args: argparse.Namespace) -> list[Row]:
    rows = []
    for block in BLOCKS:
        count = max(args.batch, (args.mib_per_case * MiB) // block.nbytes)
        records = make_records(block, count, SEED)
        total = sum(r.nbytes for r in records)
        samples: dict[str, list[float]] = {}
        with tempfile.TemporaryDirectory(dir=args.dir) as workdir:
            for rep in range(args.repeats):
                times = lmdb_round(Path(workdir), records, args.batch, store_first=rep % 2 == 0)
                for name, seconds in times.items():
                    samples.setdefault(name, []).append(total / seconds / 1e6)
        for op, baseline in (
            ("put, flush each batch", "put"),
            ("put, streamed", "put"),
            ("get cold", "get cold"),
            ("get warm", "get warm"),
        ):
            tier, base = samples[f"{op}/lmdb"], samples[f"{baseline}/file"]
            rows.append(Row(
                section="lmdb",
                case=f"{block.name} x{count}",
                op=op,
                tier_mb_s=statistics.median(tier),
                baseline_mb_s=statistics.median(base),
                baseline="write + fdatasync per batch" if op.startswith("put") else "pread",
                tier_samples=[round(x) for x in tier],
                baseline_samples=[round(x) for x in base],
            ))
    return rows


def cpu_pool_round(block: BlockShape, count: int, store_first: bool) -> dict[str, float]:
    """One repetition of pool operations and the matching plain tensor copies (seconds)."""
    tensors = make_tensors(block, SEED)
    keys = make_keys(block, count)
    host_blocks = [HostBlock(tensors[i % len(tensors)], None, (i,)) for i in range(count)]
    out = torch.empty(block.shape, dtype=block.dtype)
    times: dict[str, float] = {}

    def pool_side() -> None:
        pool = CpuBlockPool(count * block.nbytes)
        t0 = time.perf_counter()
        for k, b in zip(keys, host_blocks):
            pool.put(k, b)
        times["put/cpu"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for k in keys:
            pool.read_into(k, out)
        times["read_into/cpu"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for k in keys:
            got = pool.get(k)
        times["get/cpu"] = time.perf_counter() - t0
        assert torch.equal(got.kv, host_blocks[-1].kv)
        pool.close()

    def copy_side() -> None:
        slab = torch.empty((count, *block.shape), dtype=block.dtype)  # [N, L, 2, T, H, D]
        t0 = time.perf_counter()
        for i, b in enumerate(host_blocks):
            slab[i].copy_(b.kv)
        times["put/copy"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(count):
            out.copy_(slab[i])
        times["read_into/copy"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(count):
            got = slab[i].clone()
        times["get/copy"] = time.perf_counter() - t0
        assert torch.equal(got, host_blocks[-1].kv)

    for side in (pool_side, copy_side) if store_first else (copy_side, pool_side):
        side()
    return times


def cpu_pool_section(args: argparse.Namespace) -> list[Row]:
    rows = []
    for block in BLOCKS:
        count = max(args.batch, (args.mib_per_case * MiB) // block.nbytes)
        samples: dict[str, list[float]] = {}
        for rep in range(args.repeats):
            for name, seconds in cpu_pool_round(block, count, store_first=rep % 2 == 0).items():
                samples.setdefault(name, []).append(count * block.nbytes / seconds / 1e6)
        for op, baseline in (("put", "copy_ into a slab"), ("read_into", "copy_ out of a slab"),
                             ("get", "clone")):
            tier, base = samples[f"{op}/cpu"], samples[f"{op}/copy"]
            rows.append(Row(
                section="cpu_pool",
                case=f"{block.name} x{count}",
                op=f"pool {op}",
                tier_mb_s=statistics.median(tier),
                baseline_mb_s=statistics.median(base),
                baseline=f"tensor {baseline}",
                tier_samples=[round(x) for x in tier],
                baseline_samples=[round(x) for x in base],
            ))
    return rows


SECTIONS: list[Callable[[argparse.Namespace], list[Row]]] = [lmdb_section, cpu_pool_section]


def print_table(rows: list[Row]) -> None:
    header = (
        f"{'case':<30} {'op':<22} {'tier MB/s':>10} {'base MB/s':>10} {'ratio':>6} "
        f"{'ratio range':>12}  target {TARGET_RATIO:.0%}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        ratios = [t / b for t, b in zip(row.tier_samples, row.baseline_samples)]
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
        print(
            f"{row.case:<30} {row.op:<22} {row.tier_mb_s:>10.0f} {row.baseline_mb_s:>10.0f} "
            f"{row.ratio:>6.2f} {spread:>12}  {row.verdict}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small data set, two repetitions")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/storage_io.json"))
    parser.add_argument("--dir", default=None, help="where to create the store and the file")
    parser.add_argument("--batch", type=int, default=16, help="blocks per commit / fdatasync")
    args = parser.parse_args()
    args.mib_per_case = 96 if args.quick else 384
    args.repeats = 2 if args.quick else 7

    rows = [row for section in SECTIONS for row in section(args)]
    print_table(rows)
    result = {
        "benchmark": "storage_io",
        "seed": SEED,
        "quick": args.quick,
        "batch": args.batch,
        "mib_per_case": args.mib_per_case,
        "repeats": args.repeats,
        "target_ratio": TARGET_RATIO,
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "lmdb": ".".join(map(str, lmdb.version())),
            "py_lmdb": lmdb.__version__,
            "cuda": torch.cuda.is_available(),
        },
        "rows": [
            {**dataclasses.asdict(row), "ratio": round(row.ratio, 3), "verdict": row.verdict}
            for row in rows
        ],
    }
    write_json(args.out, result)


if __name__ == "__main__":
    main()
