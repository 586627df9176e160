"""What sealing a record costs: keyed BLAKE3 (what records use) against HMAC-SHA256 and the
unkeyed xxh3-64 of record format 1, over record-sized buffers, single-threaded.

    python benchmarks/record_mac.py [--out benchmarks/results/record_mac.json]

Prints GB/s per size and function; a restore verifies every record it reads, so the MAC's
throughput bounds what one loader thread can restore (see docs/record_format.md).
"""
from __future__ import annotations

import argparse
import hmac
import random
import sys
import time
from pathlib import Path

import xxhash
from blake3 import blake3

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine, write_json  # noqa: E402

SIZES = (256 << 10, 1 << 20, 4 << 20)  # a block of a small model, of an 8B one, and more


def gb_per_s(fn, data: bytes, budget_bytes: int = 512 << 20) -> float:
    repeats = max(5, budget_bytes // len(data))
    fn(data)  # warm
    start = time.perf_counter()
    for _ in range(repeats):
        fn(data)
    return len(data) * repeats / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/record_mac.json"))
    args = parser.parse_args()
    rng = random.Random(0)
    key = rng.randbytes(32)
    functions = {
        "blake3-keyed": lambda d: blake3(d, key=key).digest(),
        "hmac-sha256": lambda d: hmac.digest(key, d, "sha256"),
        "xxh3-64 (unkeyed)": xxhash.xxh3_64_intdigest,
    }
    rows = []
    print(f"{'size':>8}  " + "  ".join(f"{name:>18}" for name in functions))
    for size in SIZES:
        data = rng.randbytes(size)
        speeds = {name: gb_per_s(fn, data) for name, fn in functions.items()}
        rows.append({"bytes": size, **{f"{name} GB/s": round(v, 2) for name, v in speeds.items()}})
        print(f"{size >> 10:>5} KiB  " + "  ".join(f"{v:>13.2f} GB/s" for v in speeds.values()))
    write_json(args.out, {"machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
