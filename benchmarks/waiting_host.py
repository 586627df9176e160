"""The engine thread's work per decode step while a long request waits for KV blocks.

A busy engine (B requests decoding, the rest of the pool held by other work) looks the
request at the head of its queue up again at every step: its prefix in the engine's prefix
cache and, through the connector, in the tiers. This prints the host time per decode step
(the model stubbed as in ``engine_host.py --runner``, CPU time, the fastest of 6 chunks)
with nothing waiting, and with one request of ``--waiting`` tokens waiting that is

- ``cold``: in no cache;
- ``gpu hit``: held (but for its last token) by the engine's prefix cache;
- ``cpu hit``: held by the CPU pool (prefix caching off, so the tiers answer).

The cost of a lookup grows with the prompt's blocks: ``--waiting 4000`` is 250 blocks of
the tiny model; a 32K-token prompt is 2,048.

    python benchmarks/waiting_host.py [--batch 16] [--waiting 4000] [--steps 192]
        [--out benchmarks/results/waiting_host.json]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench_common import machine, write_json
from engine import RequestOutputKind, SamplingParams
from engine.sequence import Sequence
from engine_host import CHUNKS, stub_model
from tiered_kv.config import TierConfig
from tiered_kv.tiered_llm import build_llm

REPO = Path(__file__).resolve().parents[1]
BLOCK = 16
PROMPT = 32  # tokens of each decoding request
CASES = ("nothing waits", "cold", "gpu hit", "cpu hit")


def growth(batch: int, steps: int) -> int:
    """Blocks the decoding batch takes while it is timed (and a margin)."""
    return batch * (-(-steps // BLOCK) + 2)


def ms_per_step(case: str, batch: int, waiting: int, steps: int) -> float:
    long_blocks = -(-waiting // BLOCK)
    grows = growth(batch, steps)
    engine = dict(device="cpu", max_model_len=waiting + 64, max_num_seqs=batch + 1,
                  max_num_batched_tokens=max(2048, waiting + 64), async_scheduling=True,
                  num_gpu_blocks_override=batch * (PROMPT // BLOCK + 1) + grows + 2 * long_blocks,
                  enable_prefix_caching=case != "cpu hit")
    long_prompt = [(11 * j) % 200 + 3 for j in range(waiting)]
    with build_llm("tiny", TierConfig(cpu_bytes=64 << 20), **engine) as llm:
        core = llm.engine
        if case in ("gpu hit", "cpu hit"):  # computed once: in the prefix cache and the pool
            llm.generate([long_prompt], SamplingParams(max_tokens=1))
            if not core.connector.flush(60):
                raise RuntimeError("the CPU pool did not take the long prompt's blocks")
        params = SamplingParams(temperature=0.0, max_tokens=steps + 4 * CHUNKS, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        for i in range(batch):
            core.add_request([(7 * i + j) % 200 + 3 for j in range(PROMPT)], params)
        while core.scheduler.waiting or any(s.is_prefilling for s in core.scheduler.running):
            core.step()
        stub_model(core.model_runner)
        # Other work holds the rest of the pool: what is left is the batch's growth, or (gpu
        # hit) the long prompt's cached blocks, which the batch's growth then takes over.
        # Either way the waiting request never fits, and is looked up at every step.
        left = long_blocks if case == "gpu hit" else grows
        others = Sequence("others", [0] * BLOCK * (core.block_manager.num_free_blocks - left),
                          SamplingParams(), block_size=BLOCK, root_hash=bytes(32), generator=None)
        if not core.block_manager.allocate(others, others.num_tokens):
            raise RuntimeError("the pool has fewer free blocks than counted")
        if case != "nothing waits":
            tokens = long_prompt if case != "cold" else [(13 * j) % 200 + 5 for j in range(waiting)]
            core.add_request(tokens + [1] * BLOCK, SamplingParams(max_tokens=1))
        best = float("inf")
        for _ in range(CHUNKS):
            start = time.process_time()
            for _ in range(steps // CHUNKS):
                core.step()
            best = min(best, (time.process_time() - start) / (steps // CHUNKS))
        if case != "nothing waits" and not core.scheduler.waiting:
            raise RuntimeError(f"{case}: the long request was admitted; it must wait")
        if core.stats().num_preemptions:
            raise RuntimeError(f"{case}: the batch was preempted; the pool was sized wrong")
        for request_id in core.outputs.request_ids():
            core.abort_request(request_id)
        core.block_manager.free(others)
    return 1e3 * best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--waiting", type=int, default=4000, help="tokens of the waiting request")
    ap.add_argument("--steps", type=int, default=192)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/waiting_host.json")
    args = ap.parse_args()
    if args.batch < 1 or not BLOCK <= args.waiting <= 4000 or args.steps < CHUNKS:
        sys.exit(f"--batch >= 1, --waiting in [{BLOCK}, 4000] (the tiny model's context), "
                 f"--steps >= {CHUNKS}")
    if growth(args.batch, args.steps) >= args.waiting // BLOCK:
        sys.exit("the batch would take more blocks while timed than the waiting request needs "
                 "(it would fit): lower --batch or --steps, or raise --waiting")
    print(f"engine host work per decode step, batch {args.batch}, a {args.waiting}-token "
          "request waiting for blocks")
    print("| waiting request | ms / step |")
    print("|---|---|")
    rows = []
    for case in CASES:
        ms = ms_per_step(case, args.batch, args.waiting, args.steps)
        rows.append({"case": case, "ms_per_step": ms})
        print(f"| {case} | {ms:.3f} |", flush=True)
    write_json(args.out, {"command": "python benchmarks/waiting_host.py " + " ".join(sys.argv[1:]),
                          "machine": machine(), "batch": args.batch, "waiting": args.waiting,
                          "steps": args.steps, "rows": rows})


if __name__ == "__main__":
    main()
