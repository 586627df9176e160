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
import gc
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from engine.hashing import hash_blocks, root_hash
from engine.llm import LLM
from engine.sampler import SamplingParams
from storage.base import BlockKey
from storage.codecs import get_codec
from tiered_kv import block_mover
from tiered_kv.config import TierConfig
from tiered_kv.tier_manager import build_llm
from bench_common import BLOCK, DTYPES, SHAPES, Shape, machine, write_json, write_random_llama
from gpu_tiers_report import STAGED_CPU_HIT, WHOLE_DISK_HIT, print_report, verdicts
from reference_copies import copy_bandwidth, pread_bandwidth
from ttft_tiers import LoopbackServer, timed

REPO = Path(__file__).resolve().parents[1]
SEED = 0
SUFFIX_TOKENS = 16
FLUSH_TIMEOUT_S = 600.0
MiB = 1 << 20
ONE = SamplingParams(temperature=0.0, max_tokens=1)  # greedy, TTFT only
SKIPPABLE = ("cpu", "staged", "disk", "remote", "offload")  # cases --skip can leave out


@dataclasses.dataclass(frozen=True)
class Run:
    """What every scenario of one shape shares (JSON-able: the disk child gets it)."""

    shape_name: str
    model: str
    device: str
    prefixes: tuple[int, ...]
    repeats: int
    batched_tokens: int

    @property
    def shape(self) -> Shape:
        return SHAPES[self.shape_name]

    @property
    def max_len(self) -> int:
        return max(self.prefixes) + SUFFIX_TOKENS + BLOCK

    def nbytes(self, blocks: int) -> int:
        return blocks * self.shape.block_nbytes

    @property
    def prompt_pool_bytes(self) -> int:
        """Room for one prompt's blocks (a pool or staging buffer that holds a whole hit)."""
        return self.nbytes(math.ceil(self.max_len / BLOCK) * 5 // 4 + 32)

    @property
    def disk_bytes(self) -> int:
        blocks = sum(math.ceil((p + SUFFIX_TOKENS) / BLOCK) + self.repeats for p in self.prefixes)
        return 2 * self.nbytes(blocks + 16) + 64 * MiB

    def engine(self, **extra) -> dict:
        return dict(
            device=self.device, dtype=self.shape.dtype, max_model_len=self.max_len,
            max_num_batched_tokens=self.batched_tokens,
            num_gpu_blocks_override=2 * math.ceil(self.max_len / BLOCK) + 16, **extra,
        )

    def prompt(self, prefix: int, prefix_id: int, suffix_id: int) -> list[int]:
        return (tokens(self.shape.vocab, prefix, 100 * prefix + prefix_id)
                + tokens(self.shape.vocab, SUFFIX_TOKENS, 10**7 + 100 * prefix + suffix_id))


def tokens(vocab: int, count: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(300, vocab, (count,), generator=g).tolist()


def warm_up(llm: LLM, run: Run) -> None:
    """Two short prompts sharing a prefix: compiles kernels, exercises store and hit paths."""
    shared = tokens(run.shape.vocab, 4 * BLOCK, SEED + 7)
    for suffix in (1, 2):
        llm.generate(shared + tokens(run.shape.vocab, SUFFIX_TOKENS, suffix), ONE)
    if llm.engine.connector is not None:
        llm.engine.connector.flush(FLUSH_TIMEOUT_S)


def free_device() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def row(run: Run, prefix: int, case: str, codec: str | None, ttft_s: float,
        cached_tokens: int, **extra) -> dict:
    return dict(shape=run.shape_name, prefix=prefix, case=case, codec=codec, ttft_s=ttft_s,
                cached_tokens=cached_tokens, **extra)


class CopyCounter:
    """Counts the mover's copy calls (one DMA each on CUDA) and the blocks they move, so a
    restore's blocks per copy shows whether its runs were long or block by block."""

    def __init__(self) -> None:
        self.calls = self.rows = 0
        self._move = block_mover._move
        block_mover._move = self

    def __call__(self, dst, src, runs, cuda) -> None:
        self.calls += len(runs)
        self.rows += sum(n for _, _, n in runs)
        self._move(dst, src, runs, cuda)


COPIES = CopyCounter()


def hits(llm: LLM, run: Run, prefix: int, tier: str) -> dict:
    """``run.repeats`` requests on prefix 0 with new suffixes; TTFTs and what ``tier`` loaded."""
    manager = llm.engine.connector
    times, cached, loads = [], [], []
    calls, rows = COPIES.calls, COPIES.rows
    for suffix in range(1, run.repeats + 1):
        before = manager.stats()[tier]
        t, c = timed(llm, run.prompt(prefix, 0, suffix))
        after = manager.stats()[tier]
        times.append(t)
        cached.append(c)
        loads.append((after["loaded_bytes"] - before["loaded_bytes"],
                      after["load_seconds"] - before["load_seconds"]))
    rates = [b / s for b, s in loads if s > 0]
    return dict(first_s=times[0], ttft_s=statistics.median(times), cached_tokens=min(cached),
                restored_bytes=sum(b for b, _ in loads), restore_s=sum(s for _, s in loads),
                restore_Bps=statistics.median(rates) if rates else 0.0,  # 0: no load
                blocks_per_copy=(COPIES.rows - rows) / max(COPIES.calls - calls, 1))


# ---------------------------------------------------------------- TTFT scenarios


def no_tiers(run: Run) -> list[dict]:
    rows = []
    with LLM(run.model, **run.engine()) as llm:
        warm_up(llm, run)
        for p in run.prefixes:
            cold = [timed(llm, run.prompt(p, 0, 0))]
            hit = [timed(llm, run.prompt(p, 0, s)) for s in range(1, run.repeats + 1)]
            cold += [timed(llm, run.prompt(p, i, 0)) for i in range(1, run.repeats)]
            rows.append(row(run, p, "recompute", None, statistics.median(t for t, _ in cold), 0))
            rows.append(row(run, p, "engine hit", None, statistics.median(t for t, _ in hit),
                            min(c for _, c in hit)))
    return rows


def cpu_hits(run: Run, codec: str, staged: bool = False) -> list[dict]:
    """CPU-pool hits; with a KIVI codec the pool holds payloads quantized on the device, and
    a restore moves them up and dequantizes them there. ``staged``: raw copies go through
    the device staging area (``block_mover.STAGE_RAW_COPIES``)."""
    rows = []
    tiers = TierConfig(cpu_bytes=run.prompt_pool_bytes, codec=codec)
    default, block_mover.STAGE_RAW_COPIES = block_mover.STAGE_RAW_COPIES, staged
    try:
        with build_llm(run.model, tiers, **run.engine(enable_prefix_caching=False)) as llm:
            warm_up(llm, run)
            for p in run.prefixes:
                timed(llm, run.prompt(p, 0, 0))
                llm.engine.connector.flush(FLUSH_TIMEOUT_S)
                h = hits(llm, run, p, "cpu")
                rows.append(row(run, p, STAGED_CPU_HIT if staged else "CPU-pool hit", codec, **h))
    finally:
        block_mover.STAGE_RAW_COPIES = default
    return rows


def store_pass(run: Run, codec: str, cache: Path) -> tuple[list[dict], list[dict]]:
    """Default tier settings (a disk tier big enough for every prompt): each prefix's cold
    request, and after ``flush`` how many of its full blocks are on disk."""
    rows, on_disk = [], []
    tiers = TierConfig(kv_cache_dir=cache, disk_bytes=run.disk_bytes, codec=codec)
    with build_llm(run.model, tiers, **run.engine(enable_prefix_caching=False)) as llm:
        manager = llm.engine.connector
        warm_up(llm, run)
        disk, root = manager.stores()["disk"], root_hash(llm.engine.namespace)
        for p in run.prefixes:
            before = manager.stats()
            prompt = run.prompt(p, 0, 0)
            seconds, cached = timed(llm, prompt)
            flushed = manager.flush(FLUSH_TIMEOUT_S)
            after = manager.stats()
            keys = [BlockKey(manager.namespace, h) for h in hash_blocks(root, prompt, BLOCK)]
            dropped = sum(after[t]["dropped"] - before[t]["dropped"] for t in ("cpu", "disk"))
            rows.append(row(run, p, "tiers-on cold (stores)", codec, seconds, cached))
            on_disk.append(dict(shape=run.shape_name, codec=codec, prefix=p, flushed=flushed,
                                full_blocks=len(keys), on_disk=sum(map(disk.contains, keys)),
                                dropped=dropped))
    return rows, on_disk


def disk_hits(run: Run, codec: str, cache: Path) -> list[dict]:
    """Runs :func:`disk_child` in a fresh process on ``cache``."""
    args = cache.parent / f"disk-child-{codec}.json"
    args.write_text(json.dumps({"run": dataclasses.asdict(run), "codec": codec,
                                "cache": str(cache)}))
    proc = subprocess.run(  # its stderr (logs, a traceback) goes to ours
        [sys.executable, __file__, "--disk-child", str(args)], cwd=REPO, stdout=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the disk-hit process failed with exit code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def disk_child(args_path: Path) -> None:
    args = json.loads(args_path.read_text())
    run = Run(**{**args["run"], "prefixes": tuple(args["run"]["prefixes"])})
    set_threads(run.device)
    tiers = TierConfig(kv_cache_dir=args["cache"], cpu_bytes=0, disk_bytes=run.disk_bytes,
                       codec=args["codec"], staging_bytes=run.prompt_pool_bytes)
    with build_llm(run.model, tiers, **run.engine(enable_prefix_caching=False)) as llm:
        warm_up(llm, run)
        scheduler, rows = llm.engine.scheduler, []
        cost, scheduler.prefill_cost = scheduler.prefill_cost, None
        if cost is not None:  # the engine may overlap: first each hit loaded whole
            rows += [row(run, p, WHOLE_DISK_HIT, args["codec"], **hits(llm, run, p, "disk"))
                     for p in run.prefixes]
        scheduler.prefill_cost = cost
        rows += [row(run, p, "disk hit", args["codec"], **hits(llm, run, p, "disk"))
                 for p in run.prefixes]
    print(json.dumps(rows))


def remote_hits(run: Run, codec: str, url: str) -> list[dict]:
    """One engine stores each prefix in the remote tier; a second (nothing local, read-only)
    serves the hits."""
    store = TierConfig(cpu_bytes=0, remote_url=url, remote_timeout_s=5.0, codec=codec,
                       remote_prefix=f"gpu-tiers-{time.time_ns()}:", remote_secret=os.urandom(32).hex(),
                       staging_bytes=run.prompt_pool_bytes)
    engine = run.engine(enable_prefix_caching=False)
    with build_llm(run.model, store, **engine) as llm:
        for p in run.prefixes:
            timed(llm, run.prompt(p, 0, 0))
        llm.engine.connector.flush(FLUSH_TIMEOUT_S)
    read_only = dataclasses.replace(store, remote_write_policy="read-only")
    with build_llm(run.model, read_only, **engine) as llm:
        warm_up(llm, run)
        rows = [row(run, p, "remote hit", codec, **hits(llm, run, p, "remote"))
                for p in run.prefixes]
        remote = llm.engine.connector.stores()["remote"]
        remote.delete_many(list(remote.keys()))
    return rows


# ---------------------------------------------------------------- references


def references(run: Run, folder: Path) -> list[dict]:
    device = torch.device(run.device)
    out = []
    for p in run.prefixes:
        blocks = p // BLOCK
        out.append(dict(shape=run.shape_name, prefix=p, blocks=blocks,
                        copy_Bps=copy_bandwidth(run.shape, blocks, device),
                        pread_Bps=pread_bandwidth(folder, run.shape.block_nbytes, blocks,
                                                  pin=device.type == "cuda")))
        free_device()
    return out


# ---------------------------------------------------------------- offload overhead


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


def offload_overhead(run: Run, cache: Path, prompts: int, prompt_tokens: int, max_tokens: int,
                     cold_tokens: int, rounds: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    per_round = prompts * math.ceil((prompt_tokens + max_tokens) / BLOCK)
    engine = dict(run.engine(), max_model_len=max(prompt_tokens + max_tokens, cold_tokens) + BLOCK,
                  num_gpu_blocks_override=per_round * 5 // 4 + 64)
    disk_bytes = 2 * run.nbytes((rounds + 1) * (per_round + cold_tokens // BLOCK + 1)) + 64 * MiB
    tiers = TierConfig(kv_cache_dir=cache, disk_bytes=disk_bytes, codec="raw")
    runs: dict[str, list[dict]] = {"off": [], "off-2": [], "on": []}
    vocab = run.shape.vocab
    with (LLM(run.model, **engine) as off, LLM(run.model, **engine) as off2,
          build_llm(run.model, tiers, **engine) as on):
        engines = [("off", off), ("off-2", off2), ("on", on)]
        for _, llm in engines:
            warm_up(llm, run)
        seed = 10**8
        for r in range(rounds):
            for name, llm in engines[r % 3:] + engines[: r % 3]:  # each goes first in turn
                seed += 1000
                batch = [tokens(vocab, prompt_tokens, seed + i) for i in range(prompts)]
                result = generate_steps(llm, batch, params)
                result["cold_ttft_s"] = timed(llm, tokens(vocab, cold_tokens, seed + 999))[0]
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
        output_overhead=1 - on["output_tok_s"] / off["output_tok_s"],
        cold_ratio=on["cold_ttft_s"] / off["cold_ttft_s"],
        disk_stored_blocks=disk["stored_blocks"], disk_dropped=disk["dropped"],
    )


# ---------------------------------------------------------------- main


def set_threads(device: str) -> None:
    if device == "cpu":  # one core for torch, the rest for the tier threads
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))


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
