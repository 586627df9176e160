"""The engine thread's cost of a tier lookup, first and repeated, for a long prompt.

A request that waits (for free blocks, or behind a busy engine) is looked up again at every
step. This builds a :class:`~tiered_kv.TierManager` on the CPU (a small KV cache, blocks
saved through ``save_blocks``), then times ``get_num_matched_blocks`` for a chain of
``--blocks`` blocks (2,048: a 32K-token prompt) that is

- ``cold``: in no tier;
- ``cpu hit``: all in the CPU pool;
- ``cpu hit, cold tail``: its first half in the pool, the rest in no tier;
- ``disk hit``: all on disk, none in the pool (a second manager over the same directory).

``first``: a new request's lookup; ``repeated``: the same request asked again. Each is the
fastest of ``--repeats`` calls, in µs.

    python benchmarks/repeated_lookup.py [--blocks 2048] [--repeats 200]
        [--out benchmarks/results/repeated_lookup.json]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_common import BLOCK, machine, write_json
from engine.connector import SavedBlock
from engine.hashing import hash_blocks, root_hash
from tiered_kv.config import TierConfig
from tiered_kv.tier_manager import TierManager

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = bytes(range(32))
KV_SHAPE = (1, 2, BLOCK, 1, 4)  # [L, 2, T, H, D]: the bookkeeping is timed, not the bytes
CASES = ("cold", "cpu hit", "cpu hit, cold tail", "disk hit")


def chain(blocks: int, seed: int) -> tuple[list[bytes], list[tuple[int, ...]]]:
    """A prompt's block hashes and token ids (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32000, (blocks * BLOCK,), generator=gen).tolist()
    ids = [tuple(tokens[i : i + BLOCK]) for i in range(0, len(tokens), BLOCK)]
    return hash_blocks(root_hash(NAMESPACE), tokens, BLOCK), ids


def manager(config: TierConfig, blocks: int) -> TierManager:
    tiers = TierManager(config)
    kv_cache = torch.zeros((blocks, *KV_SHAPE))  # [num_blocks, L, 2, T, H, D]
    tiers.register_kv_cache(kv_cache, NAMESPACE, BLOCK)
    return tiers


def save(tiers: TierManager, hashes: list[bytes], ids: list[tuple[int, ...]]) -> None:
    """Save the chain's blocks and wait until every tier has them."""
    parents = [None, *hashes[:-1]]
    tiers.save_blocks([
        SavedBlock(h, p, t, block_id=i, is_prompt=True)
        for i, (h, p, t) in enumerate(zip(hashes, parents, ids))
    ])
    saved = 0
    while saved < len(hashes):
        saved += len(tiers.poll(timeout=1.0).saved)
    if not tiers.flush(60):
        raise RuntimeError("the tiers did not take every block")


def fastest_us(lookup, request_ids) -> float:
    best = float("inf")
    for request_id in request_ids:
        start = time.perf_counter()
        lookup(request_id)
        best = min(best, time.perf_counter() - start)
    return 1e6 * best


def time_case(case: str, blocks: int, repeats: int, workdir: Path) -> dict:
    hashes, ids = chain(blocks, seed=0)
    block_bytes = 4 * torch.Size(KV_SHAPE).numel()
    cpu_bytes = 2 * blocks * block_bytes
    disk = dict(kv_cache_dir=workdir / case.replace(" ", "_").replace(",", ""), sync=False)
    if case == "disk hit":
        with_disk = manager(TierConfig(cpu_bytes=cpu_bytes, **disk), blocks)
        save(with_disk, hashes, ids)
        with_disk.close()
        tiers = manager(TierConfig(cpu_bytes=cpu_bytes, **disk), blocks)  # the pool is empty
    else:
        tiers = manager(TierConfig(cpu_bytes=cpu_bytes), blocks)
        held = {"cold": 0, "cpu hit": blocks, "cpu hit, cold tail": blocks // 2}[case]
        if held:
            save(tiers, hashes[:held], ids[:held])

    def lookup(request_id: str) -> int:
        return tiers.get_num_matched_blocks(request_id, hashes, 0)

    try:
        matched = lookup("warm-up")
        first = fastest_us(lookup, [f"new-{i}" for i in range(repeats)])
        for i in range(repeats):
            tiers.request_finished(f"new-{i}")
        repeated = fastest_us(lookup, ["warm-up"] * repeats)
    finally:
        tiers.close()
    return {"case": case, "matched": matched, "first_us": first, "repeated_us": repeated}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=2048, help="blocks of the prompt's chain")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/repeated_lookup.json")
    args = ap.parse_args()
    if args.blocks < 2 or args.repeats < 1:
        sys.exit("--blocks >= 2, --repeats >= 1")
    print(f"tier lookup of a {args.blocks}-block chain, fastest of {args.repeats} (µs)")
    print("| chain | matched | first | repeated |")
    print("|---|---|---|---|")
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for case in CASES:
            row = time_case(case, args.blocks, args.repeats, Path(workdir))
            rows.append(row)
            print(f"| {case} | {row['matched']} | {row['first_us']:.1f} | "
                  f"{row['repeated_us']:.1f} |", flush=True)
    write_json(args.out, {"command": "python benchmarks/repeated_lookup.py " + " ".join(sys.argv[1:]),
                          "machine": machine(), "blocks": args.blocks, "repeats": args.repeats,
                          "rows": rows})


if __name__ == "__main__":
    main()
