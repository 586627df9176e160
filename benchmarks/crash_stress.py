"""Crash stress for the disk tier: a writer SIGKILLed at random moments, many times over.

    python benchmarks/crash_stress.py [--rounds 1000] [--seed 0]

Each round forks a writer (see ``benchmarks/crash_writer.py``) that stores deterministic
blocks, deletes some, reads some and flushes now and then, kills it after a seeded random
delay, reopens the store and checks that every key is one of ours and byte-identical,
that everything a returned ``flush()`` covered is there, and that flushed deletions
happened. Prints a summary and writes ``benchmarks/results/crash_stress.json``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from crash_writer import RoundResult, run_rounds


def summarize(results: list[RoundResult], seconds: float) -> dict:
    checks = [r.check_s for r in results]
    return {
        "rounds": len(results),
        "killed": sum(r.killed for r in results),
        "finished_before_kill": sum(not r.killed for r in results),
        "rounds_with_flushes": sum(r.flushed is not None for r in results),
        "blocks_flushed": sum(r.flushed or 0 for r in results),
        "blocks_present_after_kill": sum(r.written for r in results),
        "sync_rounds": sum(r.sync for r in results),
        "reopen_and_check_s_median": round(statistics.median(checks), 4),
        "reopen_and_check_s_max": round(max(checks), 4),
        "failed_rounds": sum(bool(r.problems) for r in results),
        "seconds": round(seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-delay", type=float, default=0.3, help="seconds before the kill")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/crash_stress.json"))
    parser.add_argument("--dir", default=None, help="where to create the stores")
    args = parser.parse_args()

    failures: list[RoundResult] = []

    def progress(result: RoundResult) -> None:
        if result.problems:
            failures.append(result)
            print(f"round {result.round}: {'; '.join(result.problems[:5])}", flush=True)
        elif (result.round + 1) % 100 == 0:
            print(f"{result.round + 1} rounds, {len(failures)} failed", flush=True)

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.dir) as workdir:
        results = run_rounds(
            Path(workdir), args.rounds, seed=args.seed, max_delay_s=args.max_delay,
            on_round=progress,
        )
    summary = summarize(results, time.perf_counter() - t0)

    width = max(map(len, summary))
    for name, value in summary.items():
        print(f"{name:<{width}}  {value}")
    print("PASS" if not failures else f"FAIL: {len(failures)} rounds found problems")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "crash_stress",
        "seed": args.seed,
        "max_delay_s": args.max_delay,
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "summary": summary,
        "failures": [dataclasses.asdict(r) for r in failures],
    }, indent=2) + "\n")
    print(f"wrote {args.out}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
