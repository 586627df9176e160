"""What every case of ``gpu_tiers.py`` on one shape shares: its settings (:class:`Run`), its
prompts, the warm-up, and the hits on one tier with what they loaded (:func:`hits`)."""
from __future__ import annotations

import dataclasses
import gc
import math
import os
import statistics

import torch

from engine.llm import LLM
from tiered_kv import block_mover
from bench_common import BLOCK, ONE, SHAPES, Shape, timed

SEED = 0
SUFFIX_TOKENS = 16
FLUSH_TIMEOUT_S = 600.0
MiB = 1 << 20


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


def set_threads(device: str) -> None:
    if device == "cpu":  # one core for torch, the rest for the tier threads
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
