"""Engine benchmark: decode throughput against ``transformers``, and TTFT with prefix caching.

Every engine runs the same random Llama, written by ``transformers`` itself into a temporary
folder (``--shape``: ``bench`` = hidden 512, 8 layers, 8/4 heads, vocab 32000, fp32, the CPU
default; ``1b`` and ``8b`` as in ``gpu_tiers.py``, bf16, the CUDA default).

  throughput  For each workload ``BxPxN`` (``--workloads``): B prompts of P random token ids,
              greedy, N new tokens each with eos ignored, side by side in one run:
              - ``transformers``: one ``generate()`` on the batch (dynamic cache, eager);
              - ``compiled``: the same with a static cache, whose decode ``generate()``
                itself compiles on CUDA (``torch.compile``, mode reduce-overhead: CUDA
                graphs; on a CPU it stays eager), warmed up on the timed call itself
                (it compiles per shape; CUDA only unless ``--engines`` names it);
              - the engine: one ``LLM.generate()`` (CUDA graphs for decode unless
                ``--enforce-eager``, each decode forward launched a step ahead on CUDA:
                ``async_scheduling``);
              - ``engine-sync``: the same engine with ``async_scheduling`` off (CUDA only
                unless ``--engines`` names it).
              Output tokens per second of wall time, prefill included, after a warm-up
              call on the same workload (the engine's own first call is reported apart).
              The engine's timed call is also split in two: the time until every
              request has its first token, then milliseconds per decode step. On CUDA,
              the GPU busy fraction of the engine's decode (kernel time over wall time,
              from the torch profiler), the workload's costliest kernels, and the
              engine's start-up seconds.
  ttft        Requests that share a prefix and differ in a 16-token suffix, one at a time
              (max_tokens=1): time to first token with prefix caching off, and on.

    python benchmarks/engine_throughput.py [--quick] [--device cuda] [--shape 1b]
        [--dtype bfloat16] [--workloads 1x16x256,32x512x128] [--engines ...]
        [--enforce-eager] [--threads N] [--out benchmarks/results/engine_throughput.json]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from bench_common import DTYPES, SHAPES, Shape, machine, write_json, write_random_llama
from engine.llm import LLM
from engine.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]
SEED = 0
BENCH = Shape(512, 8, 8, 4, 64, 1408, 32000, "float32")
ENGINES = ("transformers", "compiled", "engine", "engine-sync")
DEFAULT_WORKLOADS = {
    "cuda": "1x16x256,32x512x128,128x256x128",
    "cpu": "1x16x64,16x256x64",
    "quick": "1x16x16,4x64x16",
}
TARGET_VS_COMPILED = 1.2  # the engine against compiled transformers, on a GPU


def parse_workload(text: str) -> tuple[int, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"a workload is BATCHxPROMPTxNEW, e.g. 32x512x128; got {text!r}")
    return int(parts[0]), int(parts[1]), int(parts[2])


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(300, vocab, (count, length), generator=g).tolist()


def hf_generate(model, prompts: list[list[int]], max_new_tokens: int, static: bool) -> list[list[int]]:
    """Greedy ``generate()`` on equal-length prompts (no padding needed)."""
    ids = torch.tensor(prompts, device=model.device)
    extra = {"cache_implementation": "static"} if static else {}
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **extra,
        )
    return out[:, ids.shape[1]:].tolist()


def timed(fn, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    value = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return value, time.perf_counter() - start


def gpu_busy(fn, device: torch.device, kernels: dict | None = None) -> float | None:
    """The fraction of ``fn``'s wall time during which a CUDA kernel ran (one stream);
    ``kernels``, if given, receives the 10 costliest kernels' milliseconds by name."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _, wall = timed(fn, device)
    by_name: collections.Counter = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name[:80]] += e.time_range.elapsed_us()
    if kernels is not None:
        kernels.update({name: us / 1e3 for name, us in by_name.most_common(10)})
    return sum(by_name.values()) / 1e6 / wall


def phases(outs, start: float, new: int) -> dict:
    """Where a timed ``generate`` went: seconds until every request had its first token
    (the prefills, chunked, with the first decodes mixed in), and then milliseconds per
    decode step until the last token."""
    firsts = [o.times.first_token for o in outs if o.times and o.times.first_token]
    lasts = [o.times.last_token for o in outs if o.times and o.times.last_token]
    if len(firsts) < len(outs) or len(lasts) < len(outs) or new < 2:
        return {}
    return {"prefill_phase_s": max(firsts) - start,
            "decode_step_ms": 1e3 * (max(lasts) - max(firsts)) / (new - 1)}


def run_transformers(model, prompts, new, static: bool, device) -> dict:
    # Warm-up. A compiled model specializes on the static cache's length and the prompt's
    # shape: it warms up on the timed call itself, or its timed run would compile again.
    if static:
        hf_generate(model, prompts, new, static)
    else:
        hf_generate(model, [p[:8] for p in prompts], 4, static)
    out, seconds = timed(lambda: hf_generate(model, prompts, new, static), device)
    return {"s": seconds, "tok_s": len(prompts) * new / seconds, "tokens": out}


def run_engine(llm: LLM, prompts, new, device, synchronous: bool = False) -> dict:
    if synchronous:
        with synchronous_scheduling(llm):
            return run_engine(llm, prompts, new, device)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    # Warm-up on the workload itself, as the compiled row gets: a kernel variant (or graph)
    # that a shape uses first here compiles, or loads from Triton's disk cache, in this
    # call, not in the timed one. Its time is kept apart as the first call's.
    _, first = timed(lambda: llm.generate(prompts, params), device)
    start = time.perf_counter()
    outs, seconds = timed(lambda: llm.generate(prompts, params), device)
    result = {"s": seconds, "tok_s": len(prompts) * new / seconds,
              "first_call_tok_s": len(prompts) * new / first,
              "tokens": [o.token_ids for o in outs], **phases(outs, start, new)}
    # Busy fraction of a decode-heavy run: short prompts, so decode dominates.
    short = [p[:16] for p in prompts]
    busy = gpu_busy(lambda: llm.generate(short, params), device)
    if busy is not None:
        result["gpu_busy"] = busy
        # and of the workload itself, with where its kernel time goes
        kernels: dict = {}
        result["workload_gpu_busy"] = gpu_busy(lambda: llm.generate(prompts, params), device,
                                                kernels)
        result["top_kernels_ms"] = kernels
    return result


def throughput(path: Path, shape: Shape, args, device: torch.device, rows: list[dict]) -> None:
    """Append to ``rows`` the engine's start-up, then a row per workload as it finishes."""
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=DTYPES[args.dtype]).to(device).eval()
    max_len = max(p + n for _, p, n in args.workloads) + 16
    max_seqs = max(b for b, _, _ in args.workloads)
    engine_kwargs = dict(device=str(device), dtype=args.dtype, max_model_len=max_len,
                         max_num_seqs=max_seqs, enforce_eager=args.enforce_eager)
    # a pool that holds every workload, not 90 % of the card: the transformers runs (and the
    # compiled one's static caches and graph pools) share the device with the engine
    engine_kwargs["num_gpu_blocks_override"] = max_seqs * (-(-max_len // 16)) + 16
    llm, startup_s = timed(lambda: LLM(str(path), **engine_kwargs), device)
    rows.append({"startup_s": startup_s, "enforce_eager": args.enforce_eager})
    runs = {"engine-sync": lambda: run_engine(llm, prompts, n, device, synchronous=True),
            "engine": lambda: run_engine(llm, prompts, n, device),
            "transformers": lambda: run_transformers(hf_model, prompts, n, False, device),
            "compiled": lambda: run_transformers(hf_model, prompts, n, True, device)}
    for b, p, n in args.workloads:
        prompts = random_prompts(b, p, shape.vocab, SEED + b + p)
        row: dict = {"workload": f"{b}x{p}x{n}", "batch": b, "prompt": p, "new": n}
        rows.append(row)  # filled in as it runs: a run cut short still keeps its figures
        tokens = {}
        for key, run in runs.items():  # the engine first, for the same reason
            if key in args.engines:
                row[key] = run()
                tokens[key] = row[key].pop("tokens")
        if "engine" in tokens and "transformers" in tokens:
            row["identical_outputs"] = sum(
                a == r for a, r in zip(tokens["engine"], tokens["transformers"]))
    llm.close()


@contextlib.contextmanager
def synchronous_scheduling(llm: LLM):
    """The same engine (pool, graphs) with ``async_scheduling`` off, for a side-by-side row."""
    config = llm.engine.config
    llm.engine.config = dataclasses.replace(config, async_scheduling=False)
    try:
        yield
    finally:
        llm.engine.config = config


def ttft(path: Path, shape: Shape, args, device: torch.device) -> dict:
    prefix_len, requests = (512, 4) if args.quick else (1024, 6)
    prefix = random_prompts(1, prefix_len, shape.vocab, SEED + 1)[0]
    prompts = [prefix + s for s in random_prompts(requests, 16, shape.vocab, SEED + 2)]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    result: dict = {"prefix_tokens": prefix_len, "suffix_tokens": 16, "requests": requests}
    for caching in (False, True):
        kwargs = dict(device=str(device), dtype=args.dtype, max_model_len=2048,
                      enable_prefix_caching=caching, enforce_eager=args.enforce_eager,
                      num_gpu_blocks_override=256)
        with LLM(str(path), **kwargs) as llm:
            # Warm-up, sharing nothing with the prompts: a 512-token prompt, then it again
            # with 16 more tokens (a hit when caching is on), so that the timed requests
            # launch no kernel variant for the first time (a compile, or a load from
            # Triton's disk cache, would land in median_rest_ms: the first hit is times[1]);
            # 512 tokens: enough context for the hit to take the split-KV prefill kernel
            warm = [300] * 512
            llm.generate(warm, one)
            llm.generate(warm + [301] * 16, one)
            times, cached = [], []
            for prompt in prompts:
                out, seconds = timed(lambda: llm.generate(prompt, one)[0], device)
                times.append(seconds)
                cached.append(out.num_cached_tokens)
        result["caching_on" if caching else "caching_off"] = {
            "first_ms": 1e3 * times[0],
            "median_rest_ms": 1e3 * statistics.median(times[1:]),
            "num_cached_tokens": cached,
            "times_ms": [1e3 * t for t in times],
        }
    off, on = result["caching_off"]["median_rest_ms"], result["caching_on"]["median_rest_ms"]
    result["hit_speedup"] = off / on
    return result


def print_tables(rows: list[dict], tt: dict | None, device: torch.device) -> None:
    if not rows:
        return
    head, *rows = rows
    print(f"engine start-up: {head['startup_s']:.1f} s"
          + (" (eager)" if head["enforce_eager"] else " (CUDA graphs captured)" * (device.type == "cuda")))
    print("| B x prompt -> new | transformers tok/s | compiled tok/s | engine tok/s "
          "| engine / compiled | engine / transformers | GPU busy | engine, async off tok/s "
          "| GPU busy, async off | identical greedy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        def tok_s(key: str) -> str:
            return f"{r[key]['tok_s']:,.0f}" if key in r else "–"

        def ratio(key: str) -> str:
            return f"{r['engine']['tok_s'] / r[key]['tok_s']:.2f}×" if key in r and "engine" in r else "–"

        def busy(key: str) -> str:
            value = r.get(key, {}).get("gpu_busy")
            return "–" if value is None else f"{value:.0%}"

        same = f"{r['identical_outputs']}/{r['batch']}" if "identical_outputs" in r else "–"
        print(f"| {r['batch']} x {r['prompt']} -> {r['new']} | {tok_s('transformers')} | "
              f"{tok_s('compiled')} | {tok_s('engine')} | {ratio('compiled')} | "
              f"{ratio('transformers')} | {busy('engine')} | {tok_s('engine-sync')} | "
              f"{busy('engine-sync')} | {same} |")
    split = [f"{r['batch']} x {r['prompt']} -> {r['new']}: {r['engine']['prefill_phase_s'] * 1e3:.1f} ms "
             f"to every first token, then {r['engine']['decode_step_ms']:.2f} ms a decode step"
             for r in rows if "decode_step_ms" in r.get("engine", {})]
    if split:
        print("engine, timed call: " + "; ".join(split))
    firsts = [f"{r['batch']} x {r['prompt']} -> {r['new']}: {r['engine']['first_call_tok_s']:,.0f}"
              for r in rows if "first_call_tok_s" in r.get("engine", {})]
    if firsts:
        print("engine tok/s of its first call on each workload (the warm-up: first-use "
              "compiles included): " + "; ".join(firsts))
    for r in rows:
        kernels = r.get("engine", {}).get("top_kernels_ms")
        if kernels:
            print(f"\nengine, {r['batch']} x {r['prompt']} -> {r['new']}: GPU busy "
                  f"{r['engine']['workload_gpu_busy']:.0%} over the workload; costliest kernels:")
            for name, ms in kernels.items():
                print(f"  {ms:9.2f} ms  {name}")
    if tt is None:
        return
    print(f"\nTTFT, {tt['prefix_tokens']}-token shared prefix + {tt['suffix_tokens']}-token "
          f"suffix, {tt['requests']} requests one at a time:")
    print("| prefix caching | first request ms | median of the rest ms |")
    print("|---|---|---|")
    for key in ("caching_off", "caching_on"):
        print(f"| {key.split('_')[1]} | {tt[key]['first_ms']:.1f} | {tt[key]['median_rest_ms']:.1f} |")
    print(f"prefix hit: TTFT {tt['hit_speedup']:.1f}x lower than with caching off")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small workloads (CI)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--shape", choices=("bench", *SHAPES), default=None,
                        help="model shape (default: 1b on CUDA, bench on CPU)")
    parser.add_argument("--dtype", default=None, help="weights dtype (default: the shape's)")
    parser.add_argument("--workloads", default=None, help="comma-separated BATCHxPROMPTxNEW")
    parser.add_argument("--engines", default=None,
                        help="comma-separated: transformers, compiled, engine "
                        "(default: all on CUDA; transformers,engine on CPU)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--no-ttft", action="store_true", help="skip the TTFT part")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: on a small shared VM, OpenMP "
                        "threads that wait on a busy sibling core slow every small op)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/engine_throughput.json")
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    shape_name = args.shape or ("1b" if device.type == "cuda" else "bench")
    shape = BENCH if shape_name == "bench" else SHAPES[shape_name]
    args.dtype = args.dtype or shape.dtype
    if args.dtype not in DTYPES:
        parser.error(f"--dtype must be one of {', '.join(DTYPES)}")
    default = "quick" if args.quick else device.type
    try:
        args.workloads = [parse_workload(w) for w in (args.workloads or DEFAULT_WORKLOADS[default]).split(",")]
    except ValueError as e:
        parser.error(str(e))
    args.engines = (args.engines or ("transformers,compiled,engine,engine-sync" if device.type == "cuda"
                                     else "transformers,engine")).split(",")
    if unknown := set(args.engines) - set(ENGINES):
        parser.error(f"unknown engines {sorted(unknown)}; known: {', '.join(ENGINES)}")
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    # a run stopped by `timeout` (SIGTERM) still prints and keeps the workloads it finished
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    rows: list[dict] = []
    tt = None
    complete = False
    try:
        with tempfile.TemporaryDirectory(prefix="engine-bench-") as tmp:
            path = Path(tmp)
            max_len = max(p + n for _, p, n in args.workloads) + 2048
            write_random_llama(path, shape.llama_config(max_len), SEED, device=args.device,
                               dtype=DTYPES[args.dtype])
            throughput(path, shape, args, device, rows)
            tt = None if args.no_ttft else ttft(path, shape, args, device)
        complete = True
    finally:
        report(rows, tt, device, args, argv, shape_name, complete)


def report(rows: list[dict], tt: dict | None, device: torch.device, args, argv: list[str],
           shape_name: str, complete: bool) -> None:
    print_tables(rows, tt, device)
    if not complete:
        print("note: the run stopped early: these are the workloads it finished")
    engine_rows = [r for r in rows[1:] if "compiled" in r and "engine" in r]
    if device.type == "cuda" and engine_rows:
        worst = min(r["engine"]["tok_s"] / r["compiled"]["tok_s"] for r in engine_rows)
        print(f"\nengine / compiled transformers, worst workload: {worst:.2f}x "
              f"(target >= {TARGET_VS_COMPILED}x): {'PASS' if worst >= TARGET_VS_COMPILED else 'MISS'}")
    write_json(args.out, {
        "command": " ".join(["python benchmarks/engine_throughput.py", *argv]),
        "machine": machine(transformers=transformers.__version__,
                           gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else ""),
        "shape": shape_name, "dtype": args.dtype, "threads": torch.get_num_threads(),
        "complete": complete, "throughput": rows, "ttft": tt,
    })


if __name__ == "__main__":
    main()
