"""What the tiers' write-behind threads cost per block, and how much of it holds Python's
interpreter lock.

A saved block is committed to the CPU pool, taken by the disk writer
(``tiered-kv-disk-writer``: packs, seals and hands it to the store; a byte stage such as
zstd runs on its ``tiered-kv-disk-pack`` threads) and committed by the store's
``lmdb-writer`` thread. On a GPU host these threads share the interpreter lock with the
engine's thread, so the Python they run is time the engine may wait for.

Each run saves ``--blocks`` blocks of the tiny shape (64 KiB) through a
:class:`TierManager` into a fresh store (``sync=False``: no fsync per commit), with the
start-up heap frozen as in an engine's process (``engine/gc_heap.py``), and flushes.
Per thread group it reports CPU µs per block (the threads' CPU clocks; the ``engine`` row is
the thread that calls ``save_blocks`` and ``poll``: the host copy into the pool, which a GPU
does by DMA, and the commit to the pool, which a GPU host's save watcher does), medians over
``--rounds``. With ``--callgrind`` each run is counted by callgrind instead, which other
jobs on the machine do not disturb: thousands of instructions per block, split into the
work that runs without the lock (BLAKE3, zstd, LMDB's own code, numpy's copies, torch's
operators, and the memcpy and memset they call) and the rest, the interpreter and the glue
around those calls, which holds it.

    .venv/bin/python benchmarks/writer_cost.py [--blocks 4096] [--codecs raw,zstd]
        [--rounds 3] [--callgrind] [--out ...]
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench_common import BLOCK, SHAPES, machine, write_json
from disk_restore import NAMESPACE, saved_chain
from engine import gc_heap
from engine.config import DTYPES
from tiered_kv.config import TierConfig
from tiered_kv.tier_manager import TierManager

REPO = Path(__file__).resolve().parents[1]
CHUNK = 128  # blocks per save_blocks call: a 2,048-token prefill step
RING_CHUNKS = 4  # the KV cache holds this many chunks; their blocks are reused in turn
THREADS = {"tiered-kv-disk-writer": "writer", "tiered-kv-disk-pack": "packers",
           "lmdb-writer": "committer"}
# Code that runs with the interpreter lock released: BLAKE3, zstd, LMDB's own functions,
# numpy's copy loops and torch's operators (callgrind's function and object names), and the
# memcpy/memset they call.
LOCK_FREE = re.compile(
    r"blake3|zstandard|\b_?mdb_|mdb09_|_(aligned_)?(contig|strided)\w*_to_|libtorch_cpu|libc10"
)
MEMORY = re.compile(r"^_*mem(move|cpy|set)")


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds of the live write-behind threads, by group."""
    spent: dict[str, float] = collections.defaultdict(float)
    for thread in threading.enumerate():
        group = next((g for prefix, g in THREADS.items() if thread.name.startswith(prefix)), None)
        if group is not None and thread.ident is not None:
            try:
                spent[group] += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            except OSError:  # it has just ended
                pass
    return spent


def one_run(codec: str, blocks: int, folder: Path) -> dict[str, float]:
    """Save and flush ``blocks`` blocks; CPU µs per block by thread group."""
    shape = SHAPES["tiny"]
    kv = torch.empty((CHUNK * RING_CHUNKS, *shape.block_shape), dtype=DTYPES[shape.dtype])
    kv.view(torch.uint8).random_(generator=torch.Generator().manual_seed(0))
    chain = saved_chain(blocks)
    steps = [[dataclasses.replace(b, block_id=(n % RING_CHUNKS) * CHUNK + i)
              for i, b in enumerate(chain[first : first + CHUNK])]
             for n, first in enumerate(range(0, blocks, CHUNK))]
    manager = TierManager(TierConfig(kv_cache_dir=folder, codec=codec, sync=False))
    engine_s, saved, measured = [], threading.Event(), threading.Event()

    def engine() -> None:  # the engine thread's part: the saves, and a poll after each step
        try:
            start = time.thread_time()
            for step in steps:
                manager.save_blocks(step)
                manager.poll(0)
            engine_s.append(time.thread_time() - start)
        finally:
            saved.set()
        measured.wait()  # alive to the end: callgrind would give a later thread its number

    saver = threading.Thread(target=engine, name="engine")
    try:
        manager.register_kv_cache(kv, NAMESPACE, BLOCK)
        gc_heap.freeze_startup_heap()  # as an engine's process has it (engine/gc_heap.py)
        before = thread_cpu_s()
        saver.start()
        saved.wait()
        if not engine_s or not manager.flush(600):
            raise RuntimeError("the saves failed or the flush lost blocks")
        after = thread_cpu_s()
        on_disk = manager.stats()["disk"]["entries"]
    finally:
        measured.set()
        if saver.ident is not None:
            saver.join()
        manager.close()
        gc_heap.thaw()
    if on_disk != blocks:
        raise RuntimeError(f"{on_disk} of {blocks} blocks reached disk")
    spent = {g: after[g] - before.get(g, 0.0) for g in after}
    return {"engine": 1e6 * engine_s[0] / blocks,
            **{g: 1e6 * s / blocks for g, s in spent.items()}}


def thread_instructions(path: Path) -> tuple[str, dict[str, int]]:
    """One callgrind thread file: its role (by the code it ran) and its instructions, split
    into ``lock_free`` (:data:`LOCK_FREE` code and the memcpy/memset it calls) and
    ``interpreter`` (the rest, which holds the lock)."""
    names: dict[str, str] = {}  # callgrind's compressed "(id) name" references, by kind

    def name(spec: str, kind: str) -> str:
        found = re.match(r"\((\d+)\)(?: (.*))?", spec)
        if found is None:
            return spec
        if found[2]:
            names[kind + found[1]] = found[2]
        return names[kind + found[1]]

    own: collections.Counter[str] = collections.Counter()  # "function @object" -> its own
    lock_free_calls = 0  # memcpy/memset instructions called from lock-free code
    ob = fn = callee = ""
    in_call = False
    with open(path) as lines:
        for line in lines:
            if line.startswith("ob="):
                ob = name(line[3:].strip(), "ob")
            elif line.startswith("fn="):
                fn = f"{name(line[3:].strip(), 'fn')} @{ob}"
            elif line.startswith("cob="):
                name(line[4:].strip(), "ob")  # may define a name
            elif line.startswith("cfn="):
                callee = name(line[4:].strip(), "fn")
            elif line.startswith("calls="):
                in_call = True
            elif line[:1].isdigit() or line[:1] in "+-*":
                cost = int(line.split()[1])
                if in_call:
                    if MEMORY.search(callee) and LOCK_FREE.search(fn):
                        lock_free_calls += cost
                    in_call = False
                else:
                    own[fn] += cost
    lock_free = lock_free_calls + sum(c for f, c in own.items() if LOCK_FREE.search(f))
    counts = {"interpreter": sum(own.values()) - lock_free, "lock_free": lock_free}
    return thread_role(path.name.endswith("-01"), "\n".join(own)), counts


def thread_role(is_main: bool, names: str) -> str:
    """Which thread a callgrind thread file is, from the functions it ran: callgrind numbers
    threads, it does not name them."""
    if is_main:
        return "main"
    if "mdb_txn_commit" in names:
        return "committer"
    if "ZSTD_compress" in names:
        return "packers"
    if "blake3" in names:
        return "writer"
    if "libtorch_cpu" in names:
        return "engine"
    return "other"


def callgrind_run(codec: str, blocks: int, folder: Path) -> dict[str, dict[str, float]]:
    """One run under callgrind; thousands of instructions per block by thread group (the
    main thread, which imported everything and waits, is left out)."""
    out = folder / "callgrind"
    out.mkdir()
    command = ["valgrind", "--tool=callgrind", "--separate-threads=yes",
               f"--callgrind-out-file={out}/cg.%p", sys.executable, __file__, "--one", codec,
               "--blocks", str(blocks), "--dir", str(folder)]
    subprocess.run(command, check=True, capture_output=True)
    groups: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for path in sorted(out.glob("cg.*-*")):
        role, counts = thread_instructions(path)
        groups[role].update(counts)
    return {role: {k: c[k] / blocks / 1e3 for k in ("interpreter", "lock_free")}
            for role, c in groups.items() if role not in ("main", "other")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=4096)
    parser.add_argument("--codecs", default="raw,zstd")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--callgrind", action="store_true",
                        help="count instructions with valgrind's callgrind instead of CPU time")
    parser.add_argument("--dir", default=None, help="where the stores live (default: the temp dir)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a callgrind run's child: one run
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/writer_cost.json")
    args = parser.parse_args(argv)
    if args.one:
        one_run(args.one, args.blocks, Path(args.dir) / "store")
        return 0
    if args.blocks < 1 or args.rounds < 1:
        parser.error("--blocks and --rounds must be positive")
    if args.callgrind and shutil.which("valgrind") is None:
        parser.error("--callgrind needs valgrind")
    rows = []
    for codec in args.codecs.split(","):
        runs = []
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory(prefix="writer-cost-", dir=args.dir) as tmp:
                if args.callgrind:
                    runs.append(callgrind_run(codec, args.blocks, Path(tmp)))
                else:
                    runs.append(one_run(codec, args.blocks, Path(tmp) / "store"))
        for group in runs[0]:
            if args.callgrind:
                row = {k: statistics.median(r[group][k] for r in runs)
                       for k in ("interpreter", "lock_free")}
            else:
                row = {"cpu_us": statistics.median(r[group] for r in runs),
                       "cpu_us_runs": [r[group] for r in runs]}
            rows.append({"codec": codec, "thread": group, **row})
    unit = "k instructions per block" if args.callgrind else "CPU µs per block"
    print(f"{args.blocks} tiny-shape blocks (64 KiB) a run, {unit}, medians of {args.rounds}:")
    if args.callgrind:
        print("| codec | thread | interpreter (holds the GIL) | lock-free (BLAKE3, zstd, LMDB, copies) |")
        print("|---|---|---|---|")
        for r in rows:
            print(f"| {r['codec']} | {r['thread']} | {r['interpreter']:.1f} | {r['lock_free']:.1f} |")
    else:
        print("| codec | thread | CPU µs per block | runs |")
        print("|---|---|---|---|")
        for r in rows:
            runs = " / ".join(f"{v:.1f}" for v in r["cpu_us_runs"])
            print(f"| {r['codec']} | {r['thread']} | {r['cpu_us']:.1f} | {runs} |")
    command = "python benchmarks/writer_cost.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_json(args.out, {"command": command, "machine": machine(), "blocks": args.blocks,
                          "unit": unit, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
