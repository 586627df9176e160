"""Whether the disk tier keeps up with a long prefill: one prompt's blocks saved through a
:class:`TierManager` with the default settings (1 GiB CPU pool, write-through to disk) at
the pace a GPU computes them, then flushed; how many reached disk, at what rate, and what
the writers cost.

The blocks are saved a chunk (``--chunk`` tokens, as one prefill step) at a time, each
chunk ``chunk / --prefill-tok-s`` seconds after the one before; the default pace is the 8B
shape's 32K prefill on an H100 (1.9 s). Once the pool is full of blocks not yet on disk, a
save waits for a slot for ``SAVE_WAIT_S`` and is then dropped (counted): a disk slower than
the pace drops blocks, which is what ``on disk`` shows ("prefix on disk": the blocks a
restarted server restores, up to the first missing one). Without a model, any host runs it.

Each run has a fresh store, and the figures are medians over ``--rounds`` runs: "CPU s" is
the process's user + system time (the writer threads', the copies into the pool), "faults"
its minor page faults.

    .venv/bin/python benchmarks/disk_write.py [--shape 8b] [--tokens 32768]
        [--prefill-tok-s 17000] [--dir DIR] [--rounds 3] [--out ...]
"""
from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_common import BLOCK, SHAPES, machine, write_json
from disk_restore import NAMESPACE, saved_chain
from engine.config import DTYPES
from tiered_kv.config import TierConfig
from tiered_kv.tier_manager import TierManager

REPO = Path(__file__).resolve().parents[1]
RING_CHUNKS = 4  # the KV cache holds this many chunks; their blocks are reused in turn


def one_run(shape_name: str, tokens: int, chunk_tokens: int, rate: float, folder: Path) -> dict:
    """Save ``tokens`` tokens' blocks at ``rate`` tokens/s, flush, and count them on disk."""
    shape = SHAPES[shape_name]
    blocks, chunk = tokens // BLOCK, max(1, chunk_tokens // BLOCK)
    kv = torch.empty((chunk * RING_CHUNKS, *shape.block_shape), dtype=DTYPES[shape.dtype])
    kv.view(torch.uint8).random_(generator=torch.Generator().manual_seed(0))
    chain = saved_chain(blocks)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    manager = TierManager(TierConfig(kv_cache_dir=folder))
    try:
        manager.register_kv_cache(kv, NAMESPACE, BLOCK)
        start = time.perf_counter()
        for n, first in enumerate(range(0, blocks, chunk)):
            ring = (n % RING_CHUNKS) * chunk
            manager.save_blocks([dataclasses.replace(b, block_id=ring + i)
                                 for i, b in enumerate(chain[first : first + chunk])])
            due = start + (n + 1) * chunk * BLOCK / rate
            while (left := due - time.perf_counter()) > 0:
                manager.poll(min(left, 0.005))  # as the engine polls each step
        saved_s = time.perf_counter() - start
        manager.flush(600)
        flushed_s = time.perf_counter() - start
        stats = manager.stats()
        on_disk = stats["disk"]["entries"]
    finally:
        manager.close()
    after = resource.getrusage(resource.RUSAGE_SELF)
    check = TierManager(TierConfig(kv_cache_dir=folder, cpu_bytes=0))
    try:
        check.register_kv_cache(kv, NAMESPACE, BLOCK)
        prefix = check.get_num_matched_blocks("check", [b.block_hash for b in chain], 0)
    finally:
        check.close()
    return dict(blocks=blocks, block_nbytes=shape.block_nbytes, saved_s=saved_s,
                flushed_s=flushed_s, on_disk=on_disk, prefix=prefix,
                dropped=sum(s.get("dropped", 0) for s in stats.values()),
                write_Bps=stats["disk"]["stored_bytes"] / flushed_s,
                cpu_s=(after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime),
                faults=after.ru_minflt - usage.ru_minflt)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=tuple(SHAPES), default="8b")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=2048, help="tokens saved per prefill step")
    parser.add_argument("--prefill-tok-s", type=float, default=17000.0)
    parser.add_argument("--dir", default=None, help="where the disk tier lives (default: the temp dir)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/disk_write.json")
    args = parser.parse_args(argv)
    if args.tokens < BLOCK or args.chunk < BLOCK or args.prefill_tok_s <= 0 or args.rounds < 1:
        parser.error(f"--tokens and --chunk at least {BLOCK}, a positive pace and --rounds")
    runs = []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="disk-write-", dir=args.dir) as tmp:
            runs.append(one_run(args.shape, args.tokens, args.chunk, args.prefill_tok_s, Path(tmp)))
    median = {k: statistics.median(r[k] for r in runs)
              for k in ("saved_s", "flushed_s", "on_disk", "prefix", "dropped", "write_Bps", "cpu_s",
                        "faults")}
    blocks = runs[0]["blocks"]
    gb = blocks * SHAPES[args.shape].block_nbytes / 1e9
    print(f"{args.shape}: {args.tokens} tokens = {blocks} blocks ({gb:.2f} GB), saved at "
          f"{args.prefill_tok_s:,.0f} tokens/s in chunks of {args.chunk}, default tier settings, "
          f"medians of {args.rounds}:")
    print("| run | saves issued s | flushed s | disk write GB/s | on disk | prefix on disk | dropped | CPU s | faults |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in [*((str(i + 1), r) for i, r in enumerate(runs)), ("median", median)]:
        print(f"| {name} | {r['saved_s']:.2f} | {r['flushed_s']:.2f} | "
              f"{r['write_Bps'] / 1e9:.2f} | {r['on_disk']:.0f}/{blocks} | {r['prefix']:.0f} | "
              f"{r['dropped']:.0f} | "
              f"{r['cpu_s']:.2f} | {r['faults']:,.0f} |")
    command = "python benchmarks/disk_write.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_json(args.out, {"command": command, "machine": machine(), "shape": args.shape,
                          "tokens": args.tokens, "prefill_tok_s": args.prefill_tok_s,
                          "dir": args.dir or tempfile.gettempdir(), "runs": runs,
                          "median": median})
    return 0


if __name__ == "__main__":
    sys.exit(main())
