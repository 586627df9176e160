"""Multi-round QA against the HTTP server: TTFT with the KV tiers on vs GPU prefix caching only.

Simulated users chat with ``tiered-kv serve`` over HTTP (streaming chat completions). They
share one system prompt; each user's first message brings a document of its own (the
context the questions are about), and each round a user sends its whole history plus a new
question, so prompts grow. Two servers run in turn on the same random model and the same
small ``--num-gpu-blocks-override``, so the engine's pool cannot keep every user's history:

- ``tiers``: CPU pool and disk tier on (a fresh cache directory);
- ``gpu-only``: ``--kv-offloading-size 0 --kv-disk-size 0`` (vLLM-style prefix caching).

TTFT is the time from sending a request to its first chunk with content. Target: mean TTFT
at least 3x lower with the tiers. Writes JSON (``--out``) and a plot of TTFT per round.

``--shape bench`` (the default) is a small fp32 model whose 1,000-token prefill takes about
a second on one CPU core. ``--shape 1b`` is the GPU workload: the 1B Llama shape of
``gpu_tiers.py`` in bf16 (written on CUDA when there is one), 8,000-character documents
and a pool of 1,104 blocks, again about two users' histories.

    .venv/bin/python benchmarks/multi_round_qa.py            # --quick: fewer users and rounds
    python benchmarks/multi_round_qa.py --shape 1b           # on a GPU
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

import torch

from bench_common import SHAPES, machine, write_random_llama

REPO = Path(__file__).resolve().parents[1]
SEED = 0
TARGET_SPEEDUP = 3.0
MODEL = dict(  # --shape bench: prefill of ~1k tokens takes ~1 s on one CPU core
    vocab_size=512,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    bos_token_id=256,
    eos_token_id=257,
)
# Per shape: the model, the document length, and an engine pool of about two users'
# histories (the two running sequences fit; all six users' need about three times more).
SETUPS = {
    "bench": dict(model=MODEL, dtype=torch.float32, device="cpu", max_model_len=2048,
                  document_chars=1000, gpu_blocks=224, max_num_seqs=2, cpu_gib=2, disk_gib=4),
    "1b": dict(model=SHAPES["1b"].llama_config(12288), dtype=torch.bfloat16,
               device="cuda" if torch.cuda.is_available() else "cpu", max_model_len=12288,
               # 2 x (256 + 8,000 + 5 x (80 + 32)) tokens, in blocks of 16
               document_chars=8000, gpu_blocks=1104, max_num_seqs=2, cpu_gib=4, disk_gib=8),
}
WORDS = (
    "cache block tier disk memory prefix token model request latency server restart hash "
    "record codec batch queue engine layer head attention window history answer question"
).split()


def text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)[:chars]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ADMIN_KEY = "bench-admin"  # the benchmark reads /admin/tiers


def start_server(model: Path, port: int, setup: dict, tiers: bool, cache: Path, log: Path) -> subprocess.Popen:
    args = [
        sys.executable, "-c", "from tiered_kv.cli import main; main()", "serve",
        "--model", str(model), "--port", str(port), "--max-model-len", str(setup["max_model_len"]),
        "--num-gpu-blocks-override", str(setup["gpu_blocks"]),
        "--max-num-seqs", str(setup["max_num_seqs"]),
        "--log-level", "warning", "--admin-api-key", ADMIN_KEY,
    ]
    if tiers:
        args += ["--kv-cache-dir", str(cache), "--kv-offloading-size", str(setup["cpu_gib"]),
                 "--kv-disk-size", str(setup["disk_gib"])]
    else:
        args += ["--kv-offloading-size", "0", "--kv-disk-size", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(args, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)


async def wait_healthy(client: httpx.AsyncClient, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError("server did not become healthy")


async def chat_turn(client: httpx.AsyncClient, messages: list[dict], max_tokens: int) -> tuple[float, str, int]:
    """(TTFT seconds, answer, cached prompt tokens) of one streamed turn."""
    body = {
        "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = None
    pieces: list[str] = []
    cached = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
            for choice in chunk["choices"]:
                content = choice["delta"].get("content")
                if content:
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    pieces.append(content)
    return ttft, "".join(pieces), cached


async def user(
    client, system: str, document: str, questions: list[str], max_tokens: int,
    slots: asyncio.Semaphore, results: list,
) -> None:
    messages = [{"role": "system", "content": system}]
    for round_, question in enumerate(questions):
        content = f"{document}\n\n{question}" if round_ == 0 else question
        messages.append({"role": "user", "content": content})
        async with slots:  # as many requests in flight as the engine runs: TTFT without queueing
            ttft, answer, cached = await chat_turn(client, messages, max_tokens)
        messages.append({"role": "assistant", "content": answer})
        results.append({"round": round_, "ttft_s": ttft, "cached_tokens": cached})


async def run_mode(name: str, model: Path, args, workload, work: Path) -> dict:
    port = free_port()
    log = work / f"{name}.log"
    proc = start_server(model, port, args.setup, name == "tiers", work / "kv_cache", log)
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=600,
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},  # only /admin/tiers checks it
        ) as client:
            await wait_healthy(client, proc, log)
            await chat_turn(client, [{"role": "user", "content": "warm up"}], 2)
            results: list[dict] = []
            slots = asyncio.Semaphore(args.setup["max_num_seqs"])
            start = time.perf_counter()
            await asyncio.gather(
                *(
                    user(client, workload["system"], doc, qs, args.max_tokens, slots, results)
                    for doc, qs in zip(workload["documents"], workload["questions"])
                )
            )
            wall = time.perf_counter() - start
            report = (await client.get("/admin/tiers")).json()
    finally:
        proc.terminate()
        proc.wait(120)
    return summarize(name, results, wall, report)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def summarize(name: str, results: list[dict], wall: float, report: dict) -> dict:
    ttfts = [r["ttft_s"] for r in results]
    rounds = sorted({r["round"] for r in results})
    engine = report["engine"]
    queried = max(engine["prefix_cache_queries"], 1)
    hit_rate = {"gpu": engine["prefix_cache_hits"] / queried}
    for tier, row in report["tiers"].items():
        hit_rate[tier] = row["hit_tokens"] / queried
    return {
        "mode": name,
        "requests": len(results),
        "wall_s": wall,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p90_s": percentile(ttfts, 0.9),
        "ttft_by_round_s": [statistics.fmean(r["ttft_s"] for r in results if r["round"] == k) for k in rounds],
        "cached_tokens_total": sum(r["cached_tokens"] for r in results),
        "prompt_tokens_queried": engine["prefix_cache_queries"],
        "prompt_tokens_computed": engine["num_prompt_tokens"],
        "hit_rate": hit_rate,
        "preemptions": engine["num_preemptions"],
        "tiers": report["tiers"],
    }


def plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    for mode in results["modes"]:
        rounds = range(1, len(mode["ttft_by_round_s"]) + 1)
        ax.plot(rounds, [t * 1000 for t in mode["ttft_by_round_s"]], marker="o", label=mode["mode"])
    ax.set_xlabel("round")
    ax.set_ylabel("mean TTFT (ms)")
    ax.set_title(f"Multi-round QA: {results['users']} users, GPU pool of {results['gpu_blocks']} blocks")
    ax.set_xticks(list(rounds))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 users x 3 rounds instead of 6 x 5")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/multi_round_qa.json")
    parser.add_argument("--plot", type=Path, default=None,
                        help="PNG of TTFT per round (default: docs/multi_round_qa_ttft.png, or "
                             "benchmarks/results/ with --quick, so a smoke run leaves docs alone)")
    parser.add_argument("--shape", choices=tuple(SETUPS), default="bench",
                        help="bench: small fp32 model (CPU); 1b: the 1B shape in bf16 (GPU)")
    args = parser.parse_args(argv)
    if args.plot is None:
        args.plot = REPO / ("benchmarks/results" if args.quick else "docs") / "multi_round_qa_ttft.png"
    args.users, args.rounds = (4, 3) if args.quick else (6, 5)
    args.setup = setup = SETUPS[args.shape]
    args.system_chars, args.question_chars, args.max_tokens = 256, 80, 32
    args.document_chars = setup["document_chars"]

    rng = random.Random(SEED)
    workload = {
        "system": text(rng, args.system_chars),
        "documents": [text(rng, args.document_chars) for _ in range(args.users)],
        "questions": [[text(rng, args.question_chars) for _ in range(args.rounds)] for _ in range(args.users)],
    }
    with tempfile.TemporaryDirectory(prefix="multi_round_qa-") as tmp:
        work = Path(tmp)
        model = work / "model"
        write_random_llama(model, setup["model"], SEED, device=setup["device"],
                           dtype=setup["dtype"])
        modes = [asyncio.run(run_mode(name, model, args, workload, work)) for name in ("tiers", "gpu-only")]
    tiers, gpu = modes
    speedup = gpu["ttft_mean_s"] / tiers["ttft_mean_s"]
    results = {
        "benchmark": "multi_round_qa",
        "seed": SEED,
        "users": args.users,
        "rounds": args.rounds,
        "system_prompt_chars": args.system_chars,
        "document_chars": args.document_chars,
        "question_chars": args.question_chars,
        "max_tokens": args.max_tokens,
        "shape": args.shape,
        "gpu_blocks": setup["gpu_blocks"],
        "max_num_seqs": setup["max_num_seqs"],
        "model": setup["model"],
        "dtype": str(setup["dtype"]).removeprefix("torch."),
        "machine": machine(),
        "modes": modes,
        "mean_ttft_speedup": speedup,
        "target_speedup": TARGET_SPEEDUP,
        "pass": speedup >= TARGET_SPEEDUP,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    plotted = plot(results, args.plot)

    print(f"\nMulti-round QA ({args.shape}): {args.users} users x {args.rounds} rounds, "
          f"GPU pool {setup['gpu_blocks']} blocks")
    print(f"{'mode':<10} {'mean':>9} {'p50':>9} {'p90':>9} {'wall':>8}  hit rate (tokens): gpu / cpu / disk")
    for m in modes:
        rates = " / ".join(f"{m['hit_rate'].get(t, 0.0):.0%}" for t in ("gpu", "cpu", "disk"))
        print(
            f"{m['mode']:<10} {m['ttft_mean_s'] * 1000:>7.0f}ms {m['ttft_p50_s'] * 1000:>7.0f}ms "
            f"{m['ttft_p90_s'] * 1000:>7.0f}ms {m['wall_s']:>7.1f}s  {rates}"
        )
    for m in modes:
        print(f"{m['mode']:<10} TTFT by round (ms): " + ", ".join(f"{t * 1000:.0f}" for t in m["ttft_by_round_s"]))
    verdict = "PASS" if results["pass"] else "MISS"
    print(f"mean TTFT {speedup:.1f}x lower with tiers (target >= {TARGET_SPEEDUP:.0f}x): {verdict}")
    print(f"wrote {args.out}" + (f" and {args.plot}" if plotted else ""))


if __name__ == "__main__":
    main()
