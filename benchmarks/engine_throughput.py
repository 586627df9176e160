"""Engine benchmark: output throughput against ``transformers`` and TTFT with prefix caching.

Both engines run the same random Llama, written by ``transformers`` itself (hidden 512,
8 layers, 8 heads / 4 KV heads, vocab 32000, fp32) into a temporary folder:

  throughput  16 prompts of random token ids with lengths drawn from 16..512, greedy,
              ``max_tokens`` new tokens each with eos ignored. ``transformers``: one
              ``generate()`` call on the left-padded batch. The engine: one
              ``LLM.generate()`` call. Output tokens per second of wall time, prefill
              included. Target: the engine at 2x transformers or more.
  ttft        Requests that share a 1024-token prefix and differ in a 16-token suffix, one
              at a time (max_tokens=1): time to first token with prefix caching off, and
              on (the first request is cold, the others hit). ``transformers``
              ``generate(max_new_tokens=1)`` on the same prompts for reference.

    .venv/bin/python benchmarks/engine_throughput.py [--quick] [--threads N]
        [--out benchmarks/results/engine_throughput.json]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

from engine.llm import LLM
from engine.sampler import SamplingParams
from bench_common import machine, write_json, write_random_llama

REPO = Path(__file__).resolve().parents[1]
SEED = 0
TARGET_SPEEDUP = 2.0
MODEL = dict(
    vocab_size=32000,
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


def write_model(path: Path) -> transformers.LlamaForCausalLM:
    model = write_random_llama(path, MODEL, SEED)
    model.generation_config.eos_token_id = None  # run to max_new_tokens, like ignore_eos
    return model


def random_prompts(count: int, low: int, high: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=g).tolist()
    return [torch.randint(300, MODEL["vocab_size"], (n,), generator=g).tolist() for n in lengths]


def hf_generate(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as batched generation requires
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
        )
    return out[:, width:].tolist()


def throughput(model, path: Path, prompts: list[list[int]], max_tokens: int) -> dict:
    hf_generate(model, [p[:8] for p in prompts[:2]], 2)  # warm-up
    start = time.perf_counter()
    hf_out = hf_generate(model, prompts, max_tokens)
    hf_s = time.perf_counter() - start

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(str(path), max_model_len=2048) as llm:
        llm.generate([p[:8] for p in prompts[:2]], SamplingParams(temperature=0.0, max_tokens=2))
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        engine_s = time.perf_counter() - start
        stats = llm.engine.stats()
    tokens = len(prompts) * max_tokens
    assert sum(len(o.token_ids) for o in outs) == tokens
    return {
        "prompts": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "padded_prompt_tokens": len(prompts) * max(map(len, prompts)),
        "max_tokens": max_tokens,
        "transformers_s": hf_s,
        "engine_s": engine_s,
        "transformers_tok_s": tokens / hf_s,
        "engine_tok_s": tokens / engine_s,
        "speedup": hf_s / engine_s,
        "target": TARGET_SPEEDUP,
        "pass": hf_s / engine_s >= TARGET_SPEEDUP,
        "identical_outputs": sum(o.token_ids == h for o, h in zip(outs, hf_out)),
        "engine_median_itl_ms": 1e3 * statistics.median(stats.itl_s),
    }


def ttft(model, path: Path, prefix_len: int, suffix_len: int, requests: int) -> dict:
    prefix = random_prompts(1, prefix_len, prefix_len, SEED + 1)[0]
    suffixes = random_prompts(requests, suffix_len, suffix_len, SEED + 2)
    prompts = [prefix + s for s in suffixes]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    result: dict = {"prefix_tokens": prefix_len, "suffix_tokens": suffix_len, "requests": requests}
    for caching in (False, True):
        with LLM(str(path), max_model_len=2048, enable_prefix_caching=caching) as llm:
            llm.generate([[300] * 8], one)  # warm-up, shares nothing with the prompts
            times, cached = [], []
            for prompt in prompts:
                start = time.perf_counter()
                out = llm.generate(prompt, one)[0]
                times.append(time.perf_counter() - start)
                cached.append(out.num_cached_tokens)
        key = "caching_on" if caching else "caching_off"
        result[key] = {
            "first_ms": 1e3 * times[0],
            "median_rest_ms": 1e3 * statistics.median(times[1:]),
            "num_cached_tokens": cached,
        }
    hf_times = []
    for prompt in prompts:
        start = time.perf_counter()
        hf_generate(model, [prompt], 1)
        hf_times.append(time.perf_counter() - start)
    result["transformers_median_ms"] = 1e3 * statistics.median(hf_times)
    off, on = result["caching_off"]["median_rest_ms"], result["caching_on"]["median_rest_ms"]
    result["hit_speedup"] = off / on
    return result


def print_tables(tp: dict, tt: dict) -> None:
    print("| engine | output tok/s | wall s | identical greedy outputs |")
    print("|---|---|---|---|")
    print(f"| transformers generate() | {tp['transformers_tok_s']:.1f} | "
          f"{tp['transformers_s']:.2f} | |")
    print(f"| tiered-kv LLM.generate() | {tp['engine_tok_s']:.1f} | {tp['engine_s']:.2f} | "
          f"{tp['identical_outputs']}/{tp['prompts']} |")
    print()
    print(f"speedup {tp['speedup']:.2f}x, target {tp['target']:.1f}x: "
          f"{'PASS' if tp['pass'] else 'MISS'}")
    print()
    print(f"TTFT, {tt['prefix_tokens']}-token shared prefix + {tt['suffix_tokens']}-token suffix, "
          f"{tt['requests']} requests one at a time:")
    print("| | first request ms | median of the rest ms | cached tokens (rest) |")
    print("|---|---|---|---|")
    for key in ("caching_off", "caching_on"):
        r = tt[key]
        print(f"| engine, prefix caching {key.split('_')[1]} | {r['first_ms']:.1f} | "
              f"{r['median_rest_ms']:.1f} | {statistics.median(r['num_cached_tokens'][1:]):.0f} |")
    print(f"| transformers generate() | | {tt['transformers_median_ms']:.1f} | |")
    print()
    print(f"prefix hit: TTFT {tt['hit_speedup']:.1f}x lower than with caching off")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter prompts and outputs")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch threads for both engines (default 1: on a small shared VM, OpenMP "
        "threads that wait on a busy sibling core make every small op slower)",
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmarks/results/engine_throughput.json"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    max_prompt, max_tokens = (256, 32) if args.quick else (512, 128)
    prefix_len, requests = (512, 4) if args.quick else (1024, 6)
    with tempfile.TemporaryDirectory(prefix="engine-bench-") as tmp:
        path = Path(tmp)
        model = write_model(path)
        tp = throughput(model, path, random_prompts(16, 16, max_prompt, SEED), max_tokens)
        tt = ttft(model, path, prefix_len, 16, requests)
    print_tables(tp, tt)

    result = {
        "command": "python benchmarks/engine_throughput.py" + (" --quick" if args.quick else "")
        + (f" --threads {args.threads}" if args.threads != 1 else ""),
        "machine": machine(transformers=transformers.__version__),
        "threads": torch.get_num_threads(),
        "model": MODEL,
        "throughput": tp,
        "ttft": tt,
    }
    write_json(args.out, result)


if __name__ == "__main__":
    main()
