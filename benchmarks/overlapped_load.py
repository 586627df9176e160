"""An overlapped load against a whole load, on the CPU, with a disk tier made slow on
purpose: TTFT of a hit whose blocks take ``S`` times as long to read as to recompute.

On a GPU host a disk hit can take longer than recomputing (reading and verifying a block
from the page cache costs more than computing it), and an idle engine then recomputes the
head of the hit while the tail loads (docs/engine.md, *Overlapped loads*). A CPU engine
never measures its prefill, so it never splits on its own. Here the script measures the
prefill the way the engine does on CUDA (three timed steps), gives the engine that cost,
and delays every block the disk tier reads by ``S`` times its compute time: the real load
path (lookup, reader threads, verification, restore) on a slow tier.

For each slowdown, one engine on a disk tier (no CPU pool, prefix caching off, so every
request is a disk hit): three untimed whole loads teach the tier manager the tier's rate
(each moves its estimate half the way), then ``--repeats`` hits loaded whole and as many
with the split allowed. Medians; the recompute row
is a miss of the same length.

    python benchmarks/overlapped_load.py [--quick] [--slowdowns 2,4] [--repeats 3]
        [--out benchmarks/results/overlapped_load.json]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench_common import machine, timed, write_json
from engine import LLM, startup_probes
from engine.prefill_cost import PrefillCost
from tiered_kv import TierConfig, block_loader, build_llm

REPO = Path(__file__).resolve().parents[1]
BLOCK = 16
TEACHING_LOADS = 3  # leave an eighth of the prior in the load clock's estimate


def prompt_of(length: int, seed: int) -> list[int]:
    return [(7 * j + 13 * seed) % 250 + 3 for j in range(length)]


def prefill_cost(engine_kwargs: dict) -> PrefillCost:
    """What a step costs (:mod:`engine.prefill_cost`), measured as the engine measures it on
    CUDA, each timing the fastest of three."""
    with LLM(**engine_kwargs) as llm:
        return startup_probes.time_prefill(llm.engine.model_runner, None, repeats=3)


class SlowReads:
    """Every block the loader reads from a store takes ``delay_s`` more, one block at a time
    across the reader threads: a tier that serves ``1 / delay_s`` blocks a second."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self._read = block_loader.BlockLoader._read_chunk
        self._device = threading.Lock()

    def __enter__(self) -> SlowReads:
        delay, read, device = self.delay_s, self._read, self._device

        def slow(loader, chunk, slots, missing, fresh, got):
            with device:
                time.sleep(delay * sum(len(w) for w in missing.values()))
            return read(loader, chunk, slots, missing, fresh, got)

        block_loader.BlockLoader._read_chunk = slow
        return self

    def __exit__(self, *exc) -> None:
        block_loader.BlockLoader._read_chunk = self._read


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    length = args.prefix + BLOCK
    engine_kwargs = dict(device="cpu", max_model_len=length + 64,
                         num_gpu_blocks_override=2 * (length // BLOCK) + 8)
    cost = prefill_cost(engine_kwargs)
    compute_per_block = cost.seconds(0, length, length) / (length // BLOCK)  # the average
    rows = []
    with tempfile.TemporaryDirectory(prefix="overlapped-load-") as tmp:
        tiers = TierConfig(kv_cache_dir=Path(tmp) / "kv", cpu_bytes=0, disk_bytes=256 << 20)
        prompt = prompt_of(length, 0)
        with build_llm("tiny", tiers, **engine_kwargs, enable_prefix_caching=False) as llm:
            recompute = statistics.median(timed(llm, prompt_of(length, 1 + i))[0]
                                          for i in range(args.repeats))
            timed(llm, prompt)
            if not llm.engine.connector.flush(60):
                raise RuntimeError("the disk tier did not take every block")
        for slowdown in args.slowdowns:
            row: dict = {"slowdown": slowdown, "recompute_s": recompute}
            with SlowReads(slowdown * compute_per_block), \
                    build_llm("tiny", tiers, **engine_kwargs, enable_prefix_caching=False) as llm:
                llm.engine.scheduler.prefill_cost = None
                for _ in range(TEACHING_LOADS):
                    timed(llm, prompt)
                for mode, given in (("whole", None), ("overlapped", cost)):
                    llm.engine.scheduler.prefill_cost = given
                    runs = [timed(llm, prompt) for _ in range(args.repeats)]
                    row[f"{mode}_s"] = statistics.median(t for t, _ in runs)
                    row[f"{mode}_cached_tokens"] = min(c for _, c in runs)
            rows.append(row)
    return dict(machine=machine(), prefix_tokens=args.prefix, repeats=args.repeats,
                prefill_fixed_s=cost.fixed_s, prefill_per_token_s=cost.per_token_s,
                prefill_per_token_context_s=cost.per_token_context_s, rows=rows)


def report(result: dict) -> None:
    print(f"prefill step: {result['prefill_fixed_s'] * 1e3:.1f} ms + "
          f"{result['prefill_per_token_s'] * 1e6:.0f} us a token + "
          f"{result['prefill_per_token_context_s'] * 1e9:.1f} ns a token per token before it; prefix "
          f"{result['prefix_tokens']} tokens + {BLOCK}, TTFT ms (medians):")
    print("| disk block read / compute | recompute | whole load | overlapped | overlapped / "
          "recompute | cached tokens, whole / overlapped |")
    print("|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['slowdown']:g}x | {r['recompute_s'] * 1e3:.0f} | {r['whole_s'] * 1e3:.0f} | "
              f"{r['overlapped_s'] * 1e3:.0f} | {r['overlapped_s'] / r['recompute_s']:.2f} | "
              f"{r['whole_cached_tokens']} / {r['overlapped_cached_tokens']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 256-token prefix, one hit each (CI)")
    ap.add_argument("--prefix", type=int, default=1024, help="prefix tokens (a multiple of 16)")
    ap.add_argument("--slowdowns", default="2,4", help="a disk block's read over its compute time")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/overlapped_load.json")
    args = ap.parse_args()
    if args.quick:
        args.prefix, args.repeats = 256, 1
    args.slowdowns = [float(s) for s in args.slowdowns.split(",")]
    result = run(args)
    report(result)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
