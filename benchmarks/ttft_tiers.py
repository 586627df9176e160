"""TTFT with tiers, restore bandwidth, and the cost of offloading.

A random Llama written by ``transformers`` (hidden 1024, 8 layers, 16 heads / 8 KV heads,
fp32: 512 KiB of KV per 16-token block) serves prompts made of a ``--prefix-tokens`` prefix
and a 16-token suffix, one at a time, ``max_tokens=1``. Time to first token for:

  recompute     no tiers, nothing cached: the whole prompt is computed.
  engine hit    the prefix is in the engine's own block pool (prefix caching).
  CPU-pool hit  tiers on, the engine's prefix cache off (as if its pool had evicted the
                prefix): the prefix comes from the CPU pool.
  disk hit      a fresh process on the same cache directory, no CPU pool and the engine's
                prefix cache off: the prefix comes from disk (page cache warm, as right
                after a restart on the same machine). The first request of that process
                and the median of the next ones.
  remote hit    an engine with only the remote tier (Valkey/Redis; ``--remote-url``, else
                a ``redis-server``/``valkey-server`` started on loopback, else skipped)
                stores the prefix; a second engine with no CPU pool, no disk and the
                engine's prefix cache off loads it from the server. First request and
                the median of the next ones; restore bandwidth from the manager's loads.

Restore bandwidth: KV bytes restored per second of the manager's load time (its load
latency measurements), against plain reads of the same bytes in the same process, with CPU
caches cold (as for a restore, whose source was written long before): for the CPU pool,
``copy_`` of each block from a preallocated host slab into a contiguous tensor (the target)
and into a tensor with the engine's KV-cache layout; for disk, reads of the same number of
record-sized blocks from a file just written next to the cache directory (in the page
cache, like the store): ``pread`` (a new buffer per block, as the store's reads; the
target, as in ``benchmarks/storage_io.py``) and ``preadv`` into preallocated buffers (no
allocation at all: the fastest plain read, also judged).

Offload overhead: 8 distinct prompts (no reuse) generated together, tiers off and on
(write-through, raw, CPU pool + disk, default queue), alternating, same process; output
tokens per second of wall time, and decode tokens per second from the median inter-token
latency.

    .venv/bin/python benchmarks/ttft_tiers.py [--prefix-tokens 2048] [--quick]
        [--remote-url redis://127.0.0.1:6379/0] [--out benchmarks/results/ttft_tiers.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tiered_kv.config import TierConfig
from tiered_kv.tiered_llm import build_llm
from bench_common import ONE, machine, timed, write_json, write_random_llama
from loopback_server import LoopbackServer
from reference_copies import memcpy_bandwidth, plain_read_bandwidth
from ttft_tiers_report import print_report, verdicts

REPO = Path(__file__).resolve().parents[1]
SEED = 0
SUFFIX_TOKENS = 16
MODEL = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    bos_token_id=256,
    eos_token_id=257,
)
GiB = 1 << 30


def random_tokens(count: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    vocab = MODEL["vocab_size"]
    return [torch.randint(300, vocab, (length,), generator=g).tolist() for _ in range(count)]


def engine_args(prefix_tokens: int, **extra) -> dict:
    return dict(max_model_len=prefix_tokens + SUFFIX_TOKENS + 16, **extra)


# ---------------------------------------------------------------- scenarios


def recompute_and_engine_hit(model: Path, prompts: list[list[int]], prefix_tokens: int) -> dict:
    with LLM(model, **engine_args(prefix_tokens)) as llm:
        llm.generate([[300] * 8], ONE)  # warm-up, shares nothing with the prompts
        cold, _ = timed(llm, prompts[0])
        hits = [timed(llm, p) for p in prompts[1:]]
    return {
        "recompute_s": cold,
        "engine_hit_s": statistics.median(t for t, _ in hits),
        "engine_hit_cached_tokens": hits[0][1],
    }


def cpu_hit(model: Path, prompts: list[list[int]], prefix_tokens: int, cache: Path) -> dict:
    tiers = TierConfig(kv_cache_dir=cache, cpu_bytes=1 * GiB, disk_bytes=4 * GiB)
    with build_llm(model, tiers, **engine_args(prefix_tokens, enable_prefix_caching=False)) as llm:
        manager = llm.engine.connector
        llm.generate([[300] * 8], ONE)
        cold, _ = timed(llm, prompts[0])  # computes the prefix and stores it below
        assert manager.flush(120), "the disk writer did not finish"
        hits = [timed(llm, p) for p in prompts[1:]]
        stats = manager.stats()
        kv = llm.engine.model_runner.kv_cache
        block_nbytes = kv[0].numel() * kv.element_size()
        block_shape = kv[0].shape
    cpu = stats["cpu"]
    blocks = cpu["hit_blocks"]
    return {
        "recompute_with_tiers_s": cold,
        "cpu_hit_s": statistics.median(t for t, _ in hits),
        "cpu_hit_cached_tokens": hits[0][1],
        "cpu_restored_bytes": cpu["loaded_bytes"],
        "cpu_load_s": cpu["load_seconds"],
        "cpu_restore_bytes_per_s": cpu["load_bytes_per_s"],
        "cpu_plain_bytes_per_s": memcpy_bandwidth(block_shape, kv.dtype, blocks // len(hits)),
        "block_nbytes": block_nbytes,
        "disk_entries": stats["disk"]["entries"],
        "disk_bytes_used": stats["disk"]["bytes_used"],
    }


def disk_hit(model: Path, prompts: list[list[int]], prefix_tokens: int, cache: Path) -> dict:
    """Runs :func:`disk_child` in a fresh process on ``cache``."""
    args = {
        "model": str(model), "prompts": prompts, "prefix_tokens": prefix_tokens, "cache": str(cache)
    }
    proc = subprocess.run(
        [sys.executable, __file__, "--disk-child", json.dumps(args)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"disk child failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def disk_child(args: dict) -> None:
    torch.set_num_threads(1)
    prompts, cache = args["prompts"], Path(args["cache"])
    tiers = TierConfig(kv_cache_dir=cache, cpu_bytes=0, disk_bytes=4 * GiB)
    model = Path(args["model"])
    engine = engine_args(args["prefix_tokens"], enable_prefix_caching=False)
    with build_llm(model, tiers, **engine) as llm:
        manager = llm.engine.connector
        llm.generate([[300] * 8], ONE)
        first, cached = timed(llm, prompts[0])
        first_stats = manager.stats()["disk"]
        rest = [timed(llm, p)[0] for p in prompts[1:]]
        stats = manager.stats()["disk"]
    record_nbytes = stats["bytes_used"] // max(stats["entries"], 1)
    result = {
        "disk_first_hit_s": first,
        "disk_hit_s": statistics.median(rest),
        "disk_hit_cached_tokens": cached,
        "disk_first_restore_bytes_per_s": first_stats["load_bytes_per_s"],
        "disk_first_load_s": first_stats["load_seconds"],
        "disk_restored_bytes": stats["loaded_bytes"],
        "disk_load_s": stats["load_seconds"],
        "disk_restore_bytes_per_s": stats["load_bytes_per_s"],
        "disk_plain_bytes_per_s": plain_read_bandwidth(
            cache.parent, record_nbytes, first_stats["hit_blocks"]
        ),
        "disk_corrupt": stats["corrupt"],
    }
    print(json.dumps(result))


def offload_overhead(
    model: Path, cache: Path, prompt_tokens: int, max_tokens: int, rounds: int
) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    args = engine_args(prompt_tokens + max_tokens)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    tiers = TierConfig(kv_cache_dir=cache, cpu_bytes=1 * GiB, disk_bytes=4 * GiB)
    with LLM(model, **args) as off, build_llm(model, tiers, **args) as on:
        for llm in (off, on):
            llm.generate([[300] * 8], ONE)
        seed = 1000
        for _ in range(rounds):
            for name, llm in (("off", off), ("on", on)):
                seed += 1
                prompts = random_tokens(8, prompt_tokens, seed)  # never seen before: no reuse
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                wall = time.perf_counter() - start
                tokens = sum(len(o.token_ids) for o in outs)
                itl = list(llm.engine.stats().itl_s)[-(tokens - len(outs)) :]  # this run's
                runs[name].append({
                    "wall_s": wall,
                    "output_tok_s": tokens / wall,
                    "decode_tok_s": len(prompts) / statistics.median(itl),
                })
        stored = on.engine.connector.stats()
    keys = ("output_tok_s", "decode_tok_s")
    med = {
        name: {key: statistics.median(r[key] for r in rs) for key in keys}
        for name, rs in runs.items()
    }
    return {
        "prompts": 8,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "runs": runs,
        "median": med,
        "output_slowdown": 1 - med["on"]["output_tok_s"] / med["off"]["output_tok_s"],
        "decode_slowdown": 1 - med["on"]["decode_tok_s"] / med["off"]["decode_tok_s"],
        "blocks_stored_disk": stored["disk"]["stored_blocks"],
        "blocks_dropped_disk": stored["disk"]["dropped"],
    }


def remote_hit(model: Path, prompts: list[list[int]], prefix_tokens: int, url: str) -> dict:
    """``prompts[0]`` stores the prefix through one engine; a second engine (nothing local)
    serves the rest from the remote tier."""
    tiers = TierConfig(cpu_bytes=0, remote_url=url, remote_timeout_s=5.0,
                       remote_prefix=f"ttft-{time.time_ns()}:", remote_secret=os.urandom(32).hex())
    engine = engine_args(prefix_tokens, enable_prefix_caching=False)
    with build_llm(model, tiers, **engine) as llm:
        timed(llm, prompts[0])
        assert llm.engine.connector.flush(120), "the remote writer did not finish"
    with build_llm(model, tiers, **engine) as llm:
        manager = llm.engine.connector
        llm.generate([[300] * 8], ONE)
        first, cached = timed(llm, prompts[1])
        first_stats = manager.stats()["remote"]
        rest = [timed(llm, p)[0] for p in prompts[2:]]
        stats = manager.stats()["remote"]
        manager.stores()["remote"].delete_many(list(manager.stores()["remote"].keys()))
    return {
        "remote_first_hit_s": first,
        "remote_hit_s": statistics.median(rest),
        "remote_hit_cached_tokens": cached,
        "remote_first_load_s": first_stats["load_seconds"],
        "remote_first_restore_bytes_per_s": first_stats["load_bytes_per_s"],
        "remote_restored_bytes": stats["loaded_bytes"],
        "remote_load_s": stats["load_seconds"],
        "remote_restore_bytes_per_s": stats["load_bytes_per_s"],
        "remote_corrupt": stats["corrupt"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--quick", action="store_true", help="shorter prompts, fewer repeats")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/ttft_tiers.json")
    parser.add_argument("--remote-url", help="Valkey/Redis for the remote case (default: a "
                        "loopback redis-server/valkey-server, or none)")
    parser.add_argument("--disk-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.disk_child:
        disk_child(json.loads(args.disk_child))
        return
    torch.set_num_threads(1)  # as the engine benchmark: one core for torch, one for the rest
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    prefix_tokens = 512 if args.quick else args.prefix_tokens
    repeats = 2 if args.quick else 5
    prefix = random_tokens(1, prefix_tokens, SEED + 1)[0]
    # One cold request, then repeats; every scenario gets its own suffixes.
    suffixes = random_tokens(1 + 4 * repeats + 2, SUFFIX_TOKENS, SEED + 2)
    prompts = [prefix + s for s in suffixes]
    result: dict = {
        "prefix_tokens": prefix_tokens, "suffix_tokens": SUFFIX_TOKENS, "repeats": repeats
    }
    with tempfile.TemporaryDirectory(prefix="ttft-tiers-") as tmp:
        model, cache = Path(tmp) / "model", Path(tmp) / "kv"
        write_random_llama(model, MODEL, SEED)
        result.update(recompute_and_engine_hit(model, prompts[: 1 + repeats], prefix_tokens))
        cpu_prompts = [prompts[0], *prompts[1 + repeats : 1 + 2 * repeats]]
        result.update(cpu_hit(model, cpu_prompts, prefix_tokens, cache))
        result.update(disk_hit(model, prompts[1 + 2 * repeats : 2 + 3 * repeats], prefix_tokens,
                               cache))
        remote_prompts = [prompts[0], *prompts[2 + 3 * repeats :]]
        if args.remote_url:
            result.update(remote_hit(model, remote_prompts, prefix_tokens, args.remote_url))
        else:
            try:
                server = LoopbackServer(Path(tmp) / "redis")
            except (FileNotFoundError, RuntimeError) as e:
                print(f"remote case skipped: {e}", file=sys.stderr)
            else:
                try:
                    result.update(remote_hit(model, remote_prompts, prefix_tokens, server.url))
                finally:
                    server.close()
        result["offload"] = offload_overhead(
            model, Path(tmp) / "kv-offload",
            prompt_tokens=128 if args.quick else 256, max_tokens=32 if args.quick else 64,
            rounds=2 if args.quick else 4,
        )
    print_report(result)
    result["targets"] = [
        {"target": name, "measured": value, "goal": goal, "pass": ok}
        for name, value, goal, ok in verdicts(result)
    ]
    out = {
        "command": "python benchmarks/ttft_tiers.py" + (" --quick" if args.quick else "")
        + (f" --prefix-tokens {args.prefix_tokens}" if args.prefix_tokens != 2048 else ""),
        "machine": machine(transformers=transformers.__version__),
        "threads": torch.get_num_threads(),
        "model": MODEL,
        "result": result,
    }
    write_json(args.out, out)


if __name__ == "__main__":
    main()
