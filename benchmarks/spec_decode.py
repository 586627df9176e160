"""Speculative decoding benchmark: inter-token latency and tokens per second without
speculation, with ngram prompt lookup, and with a draft model.

The target is a random Llama (``--shape``: ``bench`` = hidden 512, 8 layers, vocab 1024,
fp32); the draft a random Llama a tenth of its size with the same vocabulary, and, as the
upper bound of acceptance, the target itself (every draft accepted, at the cost of a
second target). Random weights have nothing to say: the random draft agrees with the
target on almost nothing, and the target does not copy its prompt as a trained model
editing a text would. What prompt lookup finds here is the loops that greedy decoding of a
random model falls into after a few dozen tokens, in either workload; the acceptance rate
is printed beside every figure:

  repetitive  each prompt is a random 32-token passage said four times (the shape of a
              text to edit or summarise);
  random      prompts of random tokens.

Greedy, eos ignored, ``--batch`` requests at once, each generating ``--new`` tokens. ITL is
per request (last token time - first token time) / (tokens - 1), averaged; tok/s is all
output tokens over the wall time of the run, prefill included, after a warm-up run.

    python benchmarks/spec_decode.py [--quick] [--k 4] [--batch 1] [--new 128]
        [--threads 1] [--out benchmarks/results/spec_decode.json]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_common import Shape, machine, write_json, write_random_llama
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]
SEED = 0
TARGET = Shape(512, 8, 8, 4, 64, 1408, 1024, "float32")
DRAFT = Shape(128, 2, 4, 2, 32, 352, 1024, "float32")
PASSAGE, REPEATS, RANDOM_PROMPT = 32, 4, 128


def workloads(batch: int, rng: random.Random) -> dict[str, list[list[int]]]:
    def tokens(n: int) -> list[int]:
        return [rng.randrange(300, TARGET.vocab) for _ in range(n)]

    return {
        "repetitive": [tokens(PASSAGE) * REPEATS for _ in range(batch)],
        "random": [tokens(RANDOM_PROMPT) for _ in range(batch)],
    }


def run(engine: LLMEngine, prompts: list[list[int]], new: int) -> dict:
    """One batch to completion: ITL and tok/s, and the engine's acceptance counters."""
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    before = engine.stats()
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    last: dict[str, tuple[float, int]] = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            first.setdefault(out.request_id, now)
            last[out.request_id] = (now, len(out.token_ids))
    wall = time.perf_counter() - start
    after = engine.stats()
    itl = [(last[i][0] - first[i]) / (last[i][1] - 1) for i in ids]
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    return {
        "itl_ms": statistics.mean(itl) * 1e3,
        "tok_s": sum(n for _, n in last.values()) / wall,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance": accepted / drafted if drafted else None,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens, under a minute on a CPU")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/spec_decode.json")
    args = parser.parse_args(argv)
    new = 48 if args.quick else args.new
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        target, draft = Path(tmp, "target"), Path(tmp, "draft")
        max_len = PASSAGE * REPEATS + RANDOM_PROMPT + new + args.k + 16
        write_random_llama(target, TARGET.llama_config(max_len), SEED)
        write_random_llama(draft, DRAFT.llama_config(max_len), SEED + 1)
        methods = {
            "none": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": args.k,
                      "prompt_lookup_max": 4, "prompt_lookup_min": 2},
            "draft": {"model": str(draft), "num_speculative_tokens": args.k},
            "draft=target": {"model": str(target), "num_speculative_tokens": args.k},
        }
        rows = []
        for method, spec in methods.items():
            config = EngineConfig(
                model=str(target), device="cpu", max_model_len=512, seed=SEED,
                num_gpu_blocks_override=32 * args.batch + 16, speculative_config=spec,
            )
            engine = LLMEngine(config)
            try:
                rng = random.Random(SEED)
                run(engine, workloads(args.batch, rng)["random"], 8)  # warm-up
                for name, prompts in workloads(args.batch, random.Random(SEED + 1)).items():
                    rows.append({"method": method, "workload": name, **run(engine, prompts, new)})
            finally:
                engine.close()

    print(f"target {TARGET.hidden}x{TARGET.layers} layers, draft {DRAFT.hidden}x{DRAFT.layers}, "
          f"k={args.k}, batch {args.batch}, {new} new tokens, CPU, {args.threads} thread(s)")
    print("| workload | method | ITL ms | tok/s | vs none | acceptance |")
    print("|---|---|---|---|---|---|")
    base = {r["workload"]: r for r in rows if r["method"] == "none"}
    for r in sorted(rows, key=lambda r: r["workload"] != "repetitive"):
        rate = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        speedup = r["tok_s"] / base[r["workload"]]["tok_s"]
        print(f"| {r['workload']} | {r['method']} | {r['itl_ms']:.1f} | {r['tok_s']:.0f} | "
              f"{speedup:.2f}x | {rate} |")
    write_json(args.out, {
        "machine": machine(threads=str(args.threads)),
        "args": {"k": args.k, "batch": args.batch, "new": new, "quick": args.quick},
        "target": TARGET.__dict__, "draft": DRAFT.__dict__,
        "rows": rows,
    })


if __name__ == "__main__":
    sys.exit(main())
