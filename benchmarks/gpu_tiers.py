"""The rebuilt tier data path on its real shapes: TTFT per tier, restore bandwidth against a
plain copy, offload overhead and how much of each prompt reaches disk.

Random Llamas written by ``transformers`` (bf16; on CUDA initialized on the GPU):
``1b`` (hidden 2048, 16 layers, 32/8 heads, head_dim 64: 512 KiB of KV per 16-token block)
and ``8b`` (hidden 4096, 32 layers, 32/8 heads, head_dim 128: 2 MiB per block); ``--quick``
uses ``tiny`` (hidden 256, 4 layers, 8/4 heads, head_dim 32, fp32: 64 KiB per block) on the
CPU. Prompts are a ``--prefixes`` prefix plus 16 new tokens, ``max_tokens=1``, greedy,
one at a time. Per shape and prefix, time to first token of:

  recompute       no tiers, nothing cached (median of several fresh prefixes).
  engine hit      the prefix is in the engine's own block pool (prefix caching).
  CPU-pool hit    CPU pool only, the engine's prefix cache off: the prefix comes from the pool;
                  raw, and each KIVI codec asked for (its pool holds payloads quantized on
                  the device, so a restore moves fewer bytes and dequantizes them there).
  tiers-on cold   per codec, default tier settings (1 GiB CPU pool, write-through) plus a
                  disk tier sized to hold every prompt: the request that stores the prefix.
                  After ``flush``, the share of the prompt's full blocks found on disk.
  disk hit        per codec, a fresh process on that cache directory (page cache warm),
                  ``cpu_bytes=0`` and a staging buffer that holds one prompt: the first hit
                  of the process and the median of all hits. On CUDA the engine may
                  recompute the head of a hit while the rest loads (an overlapped load);
                  the hits are then also run loaded whole first ("disk hit, whole load",
                  whose rate the disk restore target is judged on).
  remote hit      per codec, one engine stores the prefix in Valkey/Redis (``--remote-url``,
                  else a ``valkey-server``/``redis-server`` on PATH started on loopback, else
                  skipped), a second one with nothing local loads it.

Restore bandwidth of each tier (KV bytes loaded / the manager's load seconds, the median
over the hits) next to a reference on the same bytes in the same run (a median too): for
the CPU pool, one copy from a host slab (pinned on CUDA) into a block-major tensor on the
device; for disk, ``pread`` of a file of the same size (page cache warm) into a
preallocated (pinned) slab, one call per block. On CUDA the raw CPU-pool hit is measured
twice: one DMA per run of (block, slot) pairs, and through the device staging area
(``block_mover.STAGE_RAW_COPIES``: one DMA per run of slots and a scatter on the device);
the target is judged on the faster.

Offload overhead (``1b`` on CUDA, the first shape elsewhere): N prompts of distinct tokens
generated together by three engines in one process, taking turns: two with tiers off (how
far they differ is the noise floor) and one with tiers on (CPU pool + disk, write-through,
raw). Decode tokens/s once every request has its first token, and the TTFT of a single
cold request.

    .venv/bin/python benchmarks/gpu_tiers.py [--quick] [--device auto|cuda|cpu]
        [--shapes 1b,8b] [--prefixes 2K,8K,32K] [--codecs raw,zstd,kivi4]
        [--remote-url redis://127.0.0.1:6379/0] [--skip cpu,staged,disk,remote,offload]
        [--out benchmarks/results/gpu_tiers.json]

The JSON is rewritten after every case (``"complete": false`` until the end), and a run
stopped by SIGTERM (``timeout``) prints its report of the cases it finished.
"""
from __future__ import annotations

import argparse
import dataclasses
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import torch
import transformers

from storage.codecs import get_codec
from bench_common import BLOCK, DTYPES, SHAPES, machine, write_json, write_random_llama
from gpu_tiers_cases import (
    cpu_hits, disk_child, disk_hits, no_tiers, references, remote_hits, store_pass,
)
from gpu_tiers_offload import offload_overhead
from gpu_tiers_report import print_report, verdicts
from gpu_tiers_run import SEED, SUFFIX_TOKENS, Run, free_device, set_threads
from loopback_server import LoopbackServer

REPO = Path(__file__).resolve().parents[1]
SKIPPABLE = ("cpu", "staged", "disk", "remote", "offload")  # cases --skip can leave out


def run_shape(name: str, args: argparse.Namespace, tmp: Path, url: str | None,
              result: dict, save) -> None:
    """Every case of one shape, ``save()`` after each, so a run cut short keeps its rows."""
    shape = SHAPES[name]
    folder = tmp / name
    model = folder / "model"
    run = Run(name, str(model), args.device, tuple(args.prefixes), args.repeats,
              512 if args.quick else (8192 if args.device == "cuda" else 2048))
    write_random_llama(model, shape.llama_config(run.max_len), SEED, device=args.device,
                       dtype=DTYPES[shape.dtype])
    free_device()
    result["references"] += references(run, folder)
    print(f"{name}: model written; recompute and engine hits", file=sys.stderr)
    result["ttft"] += no_tiers(run)
    free_device()
    save()
    if "cpu" not in args.skip:
        # the pool holds raw blocks for the lossless codecs, the codec's payloads for KIVI
        for codec in ["raw", *(c for c in args.codecs if not get_codec(c).lossless)]:
            result["ttft"] += cpu_hits(run, codec)
            free_device()
            save()
    if args.device == "cuda" and "staged" not in args.skip:
        result["ttft"] += cpu_hits(run, "raw", staged=True)  # the faster way is kept
        free_device()
        save()
    for codec in args.codecs:
        if "disk" in args.skip and ("remote" in args.skip or not url):
            break
        if "disk" not in args.skip:
            print(f"{name}: {codec}: store, disk hits", file=sys.stderr)
            cache = folder / f"kv-{codec}"
            rows, on_disk = store_pass(run, codec, cache)
            free_device()
            result["ttft"] += rows + disk_hits(run, codec, cache)
            result["on_disk"] += on_disk
            shutil.rmtree(cache)
            save()
        if url and "remote" not in args.skip:
            print(f"{name}: {codec}: remote hits", file=sys.stderr)
            result["ttft"] += remote_hits(run, codec, url)
            free_device()
            save()
    if name == result["offload_shape"] and "offload" not in args.skip:
        print(f"{name}: offload overhead", file=sys.stderr)
        cold = min(max(args.prefixes), 8192) + SUFFIX_TOKENS
        quick = dict(prompts=8, prompt_tokens=256, max_tokens=32, rounds=3)
        full = dict(prompts=32, prompt_tokens=1024, max_tokens=128, rounds=6)
        result["offload"] = offload_overhead(run, folder / "kv-offload", cold_tokens=cold,
                                             **(quick if args.quick else full))
        free_device()
        save()
    shutil.rmtree(folder)


def token_count(text: str) -> int:
    return int(text[:-1]) * 1024 if text.upper().endswith("K") else int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="CPU, tiny shape, one 512-token prefix, raw and zstd")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"))
    parser.add_argument("--shapes", help="comma-separated: 1b, 8b, tiny (default 1b,8b)")
    parser.add_argument("--prefixes", help="prefix tokens, e.g. 2K,8K,32K (the default)")
    parser.add_argument("--codecs", help="disk/remote codecs (default raw,zstd,kivi4)")
    parser.add_argument("--remote-url", help="Valkey/Redis for the remote case (default: a "
                        "loopback valkey-server/redis-server if on PATH, else skipped)")
    parser.add_argument("--skip", default="", help="cases left out, comma-separated: "
                        f"{', '.join(SKIPPABLE)} (to split a long run)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--disk-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.disk_child:
        disk_child(args.disk_child)
        return 0
    device = args.device or ("cpu" if args.quick else "auto")
    args.device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available on this machine")
    try:
        args.shapes = (args.shapes or ("tiny" if args.quick else "1b,8b")).split(",")
        args.prefixes = [token_count(p) for p in (args.prefixes or
                                                  ("512" if args.quick else "2K,8K,32K")).split(",")]
        args.codecs = (args.codecs or ("raw,zstd" if args.quick else "raw,zstd,kivi4")).split(",")
        for codec in args.codecs:
            get_codec(codec)
        args.skip = {c for c in args.skip.split(",") if c}
        if args.skip - set(SKIPPABLE):
            raise ValueError(f"--skip takes {', '.join(SKIPPABLE)}")
    except ValueError as e:
        parser.error(str(e))
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown or any(p < BLOCK or p % BLOCK for p in args.prefixes):
        parser.error(f"shapes are {', '.join(SHAPES)}; prefixes positive multiples of {BLOCK}")
    args.repeats = 5 if args.quick else 3  # hits are cheap on the tiny model: more samples
    args.out = args.out or REPO / "benchmarks/results" / (
        "gpu_tiers_quick.json" if args.quick else "gpu_tiers.json")
    set_threads(args.device)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result: dict = dict(device=args.device, device_name=device_name, shapes=args.shapes,
                        prefixes=args.prefixes, codecs=args.codecs, repeats=args.repeats,
                        suffix_tokens=SUFFIX_TOKENS,
                        ttft=[], on_disk=[], references=[], notes=[],
                        offload_shape="1b" if args.device == "cuda" and "1b" in args.shapes
                        else args.shapes[0])
    command = "python benchmarks/gpu_tiers.py " + " ".join(argv if argv is not None else sys.argv[1:])
    header = dict(command=command.strip(),
                  machine=machine(device=device_name, transformers=transformers.__version__),
                  threads=torch.get_num_threads(),
                  shapes={name: dataclasses.asdict(SHAPES[name]) for name in args.shapes})

    def save(complete: bool = False) -> None:
        targets = [v._asdict() for v in verdicts(result)]
        write_json(args.out, {**header, "complete": complete,
                              "result": {**result, "targets": targets}}, quiet=not complete)

    # a run stopped by `timeout` (SIGTERM) still prints and keeps what it measured
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    complete = False
    try:
        with tempfile.TemporaryDirectory(prefix="gpu-tiers-") as tmp:
            server, url = None, args.remote_url
            if url is None and "remote" not in args.skip:
                try:
                    server = LoopbackServer(Path(tmp) / "redis")
                    url = server.url
                except (FileNotFoundError, RuntimeError) as e:
                    result["notes"].append(f"remote case skipped: {e}")
            try:
                for name in args.shapes:
                    run_shape(name, args, Path(tmp), url, result, save)
            finally:
                if server is not None:
                    server.close()
        complete = True
    finally:
        if not complete:
            result["notes"].append("the run stopped early: these are the cases it finished")
        result["targets"] = verdicts(result)
        print_report(result)
        save(complete)
    return 0


if __name__ == "__main__":
    sys.exit(main())
