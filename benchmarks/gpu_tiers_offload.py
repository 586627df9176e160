"""The offload overhead of ``gpu_tiers.py``: N prompts of distinct tokens generated together
by two tiers-off engines and one tiers-on engine in one process, taking turns; and by the
tiers-on engine with its connector taken out for a round ("on, detached"), which compares
tiers on and off on the same engine (the same pool, graphs and memory), without the
variance between two engines (two identical tiers-off engines differed by 23.5 % on an
H200). During each cold request a :class:`~gil_probe.GilProbe` samples how long a thread
waits for the interpreter lock, so that tiers-on and tiers-off runs show whether the tiers'
threads hold it against the engine's."""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from pathlib import Path

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tiered_kv.config import TierConfig
from tiered_kv.tiered_llm import build_llm
from bench_common import BLOCK, timed
from gil_probe import GilProbe
from gpu_tiers_run import FLUSH_TIMEOUT_S, MiB, Run, tokens, warm_up


def generate_steps(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Drive the engine step by step: wall time, and decode tokens/s over the steps after
    every request had its first token."""
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts]
    pending, started = set(ids), set()
    all_started = None
    decode_tokens = total = 0
    start = time.perf_counter()
    try:
        while pending:
            outs = engine.step()
            total += len(outs)
            if all_started is not None:
                decode_tokens += len(outs)
            for o in outs:
                started.add(o.request_id)
                if o.finished:
                    pending.discard(o.request_id)
            if all_started is None and len(started) == len(ids):
                all_started = time.perf_counter()
    finally:
        for request_id in pending:
            engine.abort_request(request_id)
    end = time.perf_counter()
    return dict(wall_s=end - start, output_tok_s=total / (end - start),
                decode_tok_s=decode_tokens / (end - all_started))


@contextlib.contextmanager
def detached(llm: LLM):
    """``llm`` with its connector taken out (every save written first): no lookups, saves
    or polls, as if built without tiers."""
    engine = llm.engine
    connector = engine.connector
    connector.flush(FLUSH_TIMEOUT_S)
    engine.connector = engine.scheduler.connector = None
    try:
        yield llm
    finally:
        engine.connector = engine.scheduler.connector = connector


def offload_overhead(run: Run, cache: Path, prompts: int, prompt_tokens: int, max_tokens: int,
                     cold_tokens: int, rounds: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    per_round = prompts * math.ceil((prompt_tokens + max_tokens) / BLOCK)
    engine = dict(run.engine(), max_model_len=max(prompt_tokens + max_tokens, cold_tokens) + BLOCK,
                  num_gpu_blocks_override=per_round * 5 // 4 + 64)
    disk_bytes = 2 * run.nbytes((rounds + 1) * (per_round + cold_tokens // BLOCK + 1)) + 64 * MiB
    tiers = TierConfig(kv_cache_dir=cache, disk_bytes=disk_bytes, codec="raw")
    runs: dict[str, list[dict]] = {"off": [], "off-2": [], "on": [], "on, detached": []}
    vocab = run.shape.vocab
    with (LLM(run.model, **engine) as off, LLM(run.model, **engine) as off2,
          build_llm(run.model, tiers, **engine) as on):
        engines = [("off", off), ("off-2", off2), ("on", on), ("on, detached", on)]
        for _, llm in engines[:3]:
            warm_up(llm, run)
        seed = 10**8
        for r in range(rounds):
            n = len(engines)
            for name, llm in engines[r % n:] + engines[: r % n]:  # each goes first in turn
                seed += 1000
                batch = [tokens(vocab, prompt_tokens, seed + i) for i in range(prompts)]
                with detached(llm) if name == "on, detached" else contextlib.nullcontext():
                    result = generate_steps(llm, batch, params)
                    with GilProbe() as probe:  # who keeps the engine's thread waiting
                        result["cold_ttft_s"] = timed(llm, tokens(vocab, cold_tokens, seed + 999))[0]
                    gil = probe.summary()
                    result["cold_gil_late_ms"] = gil["late_ms_total"]
                    result["cold_gil_longest_ms"] = gil["longest_late_ms"]
                runs[name].append(result)
                if name == "on":
                    on.engine.connector.flush(FLUSH_TIMEOUT_S)  # nothing spills into "off"
        disk = on.engine.connector.stats()["disk"]
    runs["off, both"] = runs["off"] + runs["off-2"]  # the baseline the overhead is against
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for name, rs in runs.items()}
    on, off = med["on"], med["off, both"]
    return dict(
        shape=run.shape_name, prompts=prompts, prompt_tokens=prompt_tokens,
        max_tokens=max_tokens, cold_tokens=cold_tokens, rounds=rounds, runs=runs, median=med,
        decode_overhead=1 - on["decode_tok_s"] / off["decode_tok_s"],
        decode_noise=1 - med["off-2"]["decode_tok_s"] / med["off"]["decode_tok_s"],
        same_engine_decode_overhead=1 - on["decode_tok_s"] / med["on, detached"]["decode_tok_s"],
        same_engine_cold_ratio=on["cold_ttft_s"] / med["on, detached"]["cold_ttft_s"],
        output_overhead=1 - on["output_tok_s"] / off["output_tok_s"],
        cold_ratio=on["cold_ttft_s"] / off["cold_ttft_s"],
        disk_stored_blocks=disk["stored_blocks"], disk_dropped=disk["dropped"],
    )
