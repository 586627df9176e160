"""KIVI decode speed of the CPU (torch) path, the one the disk and remote tiers use when
blocks come back to a host slot: GB/s of decoded KV for one block of each benchmark shape,
one thread, best of N passes.

    .venv/bin/python benchmarks/kivi_decode.py [--repeats 50] [--out benchmarks/results/kivi_decode.json]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench_common import BLOCK, DTYPES, SHAPES, machine, write_json
from storage.codecs.kivi import dequantize_block, quantize_block

REPO = Path(__file__).resolve().parents[1]
SEED = 0


def best_seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/kivi_decode.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    print("| shape | dtype | codec | block KiB | decode ms | GB/s |")
    print("|---|---|---|---|---|---|")
    for name in ("1b", "8b"):
        shape = SHAPES[name]
        dims = (shape.layers, 2, BLOCK, shape.kv_heads, shape.head_dim)  # [L, 2, T, H, D]
        dtype = DTYPES[shape.dtype]
        kv = torch.randn(dims, generator=torch.Generator().manual_seed(SEED)).to(dtype)
        for bits in (4, 2):
            payload = quantize_block(kv, bits, backend="torch")
            seconds = best_seconds(
                lambda: dequantize_block(payload, bits, dtype, dims, backend="torch"), args.repeats
            )
            nbytes = kv.numel() * kv.element_size()
            rows.append({"shape": name, "dtype": shape.dtype, "codec": f"kivi{bits}",
                         "block_bytes": nbytes, "decode_s": seconds, "gb_s": nbytes / seconds / 1e9})
            print(f"| {name} | {shape.dtype} | kivi{bits} | {nbytes >> 10} | {seconds * 1e3:.2f} | "
                  f"{nbytes / seconds / 1e9:.2f} |")
    write_json(args.out, {"command": "python benchmarks/kivi_decode.py", "machine": machine(),
                          "threads": 1, "rows": rows})


if __name__ == "__main__":
    main()
