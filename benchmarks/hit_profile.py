"""Where a prefix hit's time goes: host launches, syncs and kernels of a hit against a miss.

The TTFT case of ``engine_throughput.py`` (a shared prefix + 16 new tokens, ``max_tokens=1``),
profiled. For a steady miss (prefix caching off: the whole prompt computed) and a steady hit
(caching on), it prints the wall time, the host's launch span (from ``generate()`` to its
last kernel launch), the time the host spent blocked in CUDA syncs, the GPU kernel time and
the costliest kernels. A hit whose wall time is its launch span plus a short tail is bound
by the host; one with a long tail after its last launch is bound by its kernels.

    python benchmarks/hit_profile.py --device cuda --shape 1b --prefix 1024,8192
    python benchmarks/hit_profile.py --quick          # CPU, tiny shape: a smoke run
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench_common import DTYPES, SHAPES, machine, write_json, write_random_llama
from engine import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[1]
SUFFIX = 16
SYNCS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy ")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def random_ids(count: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(300, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def breakdown(prof, wall: float) -> dict:
    events = list(prof.events())
    start = min(e.time_range.start for e in events)
    launches = [e for e in events if e.name.startswith(LAUNCHES)]
    syncs = [e for e in events if e.name.startswith(SYNCS)]
    kernels = collections.Counter()
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name[:80]] += e.time_range.elapsed_us()
    return {
        "wall_ms": 1e3 * wall,
        "launch_span_ms": (max((e.time_range.end for e in launches), default=start) - start) / 1e3,
        "launches": len(launches),
        "sync_ms": sum(e.time_range.elapsed_us() for e in syncs) / 1e3,
        "syncs": len(syncs),
        "kernel_ms": sum(kernels.values()) / 1e3,
        "top_kernels_ms": {name: us / 1e3 for name, us in kernels.most_common(8)},
    }


def measure(path: Path, prefix_len: int, caching: bool, args) -> dict:
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    prefix = random_ids(prefix_len, 1, args.vocab)
    prompts = [prefix + random_ids(SUFFIX, 10 + i, args.vocab) for i in range(7)]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    config = dict(device=args.device, dtype=args.dtype, max_model_len=prefix_len + 2 * SUFFIX + 16,
                  enable_prefix_caching=caching,
                  num_gpu_blocks_override=2 * (prefix_len + 2 * SUFFIX) // 16 + 16)
    with LLM(str(path), **config) as llm:
        warm = [300] * prefix_len  # every kernel variant the timed requests launch
        llm.generate(warm, one)
        llm.generate(warm + [301] * SUFFIX, one)
        walls = []
        for prompt in prompts[:5]:  # the first fills the cache; the rest hit (caching on)
            sync()
            began = time.perf_counter()
            out = llm.generate(prompt, one)[0]
            sync()
            walls.append(time.perf_counter() - began)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        profiled = []
        for prompt in prompts[5:]:
            sync()
            with profile(activities=activities) as prof:
                began = time.perf_counter()
                llm.generate(prompt, one)
                sync()
                wall = time.perf_counter() - began
            profiled.append(breakdown(prof, wall))
    return {"prefix": prefix_len, "caching": caching, "cached_tokens": out.num_cached_tokens,
            "wall_ms": [1e3 * w for w in walls], "median_ms": 1e3 * statistics.median(walls[1:]),
            "profiled": profiled}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CPU, tiny shape, a 256-token prefix")
    parser.add_argument("--device", choices=("cpu", "cuda"))
    parser.add_argument("--shape", choices=tuple(SHAPES))
    parser.add_argument("--prefix", help="comma-separated prefix lengths (default 1024,8192)")
    parser.add_argument("--out", type=Path)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.device = args.device or ("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    args.shape = args.shape or ("tiny" if args.device == "cpu" else "1b")
    shape = SHAPES[args.shape]
    args.dtype, args.vocab = shape.dtype, shape.vocab
    try:
        prefixes = [int(p) for p in (args.prefix or ("256" if args.quick else "1024,8192")).split(",")]
    except ValueError:
        parser.error("--prefix takes comma-separated token counts")
    if any(p < 16 for p in prefixes):
        parser.error("--prefix: each prefix is at least one block (16 tokens)")
    out = args.out or REPO / "benchmarks/results" / f"hit_profile{'_quick' * args.quick}.json"
    rows = []
    with tempfile.TemporaryDirectory(prefix="hit-profile-") as tmp:
        path = Path(tmp)
        write_random_llama(path, shape.llama_config(max(prefixes) + 64), 0, device=args.device,
                           dtype=DTYPES[shape.dtype])
        for prefix_len in prefixes:
            for caching in (False, True):
                rows.append(row := measure(path, prefix_len, caching, args))
                last = row["profiled"][-1]
                print(f"prefix {prefix_len:>6} {'hit ' if caching else 'miss'}: median "
                      f"{row['median_ms']:.2f} ms | profiled: wall {last['wall_ms']:.2f} ms, "
                      f"launch span {last['launch_span_ms']:.2f} ms ({last['launches']} launches), "
                      f"syncs {last['sync_ms']:.2f} ms ({last['syncs']}), kernels "
                      f"{last['kernel_ms']:.2f} ms")
                for name, ms in last["top_kernels_ms"].items():
                    print(f"        {ms:8.3f} ms  {name}")
    write_json(out, {"command": "python benchmarks/hit_profile.py " + " ".join(argv),
                     "machine": machine(), "shape": dict(name=args.shape, dtype=args.dtype),
                     "rows": rows})


if __name__ == "__main__":
    main()
