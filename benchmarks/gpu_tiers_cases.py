"""The TTFT cases of ``gpu_tiers.py`` on one shape, a function each (the rows they return
are the JSON's ``ttft``), and the reference copies their restores are judged against."""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from engine.hashing import hash_blocks, root_hash
from engine.llm import LLM
from storage.base import BlockKey
from tiered_kv import block_mover
from tiered_kv.config import TierConfig
from tiered_kv.tiered_llm import build_llm
from bench_common import BLOCK, timed
from gpu_tiers_report import STAGED_CPU_HIT, WHOLE_DISK_HIT
from gpu_tiers_run import FLUSH_TIMEOUT_S, Run, free_device, hits, row, set_threads, warm_up
from reference_copies import copy_bandwidth, pread_bandwidth

REPO = Path(__file__).resolve().parents[1]
GPU_TIERS = Path(__file__).with_name("gpu_tiers.py")  # runs disk_child (--disk-child)


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
        [sys.executable, str(GPU_TIERS), "--disk-child", str(args)], cwd=REPO,
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
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
    for r in rows:  # what sized the overlapped heads (engine/prefill_cost.py)
        r["prefill_cost"] = None if cost is None else cost._asdict()
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
