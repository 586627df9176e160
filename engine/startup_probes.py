"""What the engine measures with its model before it serves: the peak memory of a step
(which sizes the KV pool), what a prefill step costs (which sizes an overlapped load's head,
:mod:`engine.prefill_cost`) and an fp8 cache's scales.

Each runs forwards of dummy prompts on a cache of its own, just big enough, through the
runner's model and :meth:`~engine.model_runner.ModelRunner.prepare`; the engine's pool is
not touched (it does not exist yet when the memory is profiled).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engine import prefill_cost
from engine.attention import KVScales
from engine.kv_cache import KVCacheSpec, fp8_scales_from_cache
from engine.prefill_cost import PrefillCost

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner


@torch.inference_mode()
def profile_peak_memory(runner: ModelRunner, kv_scales: list[KVScales] | None) -> int:
    """Peak CUDA bytes of a ``max_num_batched_tokens`` forward plus logits, less its cache."""
    config, device = runner.config, runner.device
    budget = config.max_num_batched_tokens
    num_seqs = min(config.max_num_seqs, budget)
    lengths = [budget // num_seqs + (i < budget % num_seqs) for i in range(num_seqs)]
    lengths = [min(n, config.max_model_len - 1) for n in lengths]
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    cache = _forward_on_fresh_cache(runner, [[0] * n for n in lengths], runner.spec, kv_scales)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - cache.numel() * cache.element_size()


@torch.inference_mode()
def time_prefill(runner: ModelRunner, kv_scales: list[KVScales] | None, repeats: int = 1) -> PrefillCost:
    """What a prefill step costs (:mod:`engine.prefill_cost`), from three steps: ``big``
    tokens (one step's budget, or what fits the model), a sixteenth of that, and that
    sixteenth after the ``big`` ones. Each timing is the fastest of ``repeats`` runs after
    one that compiles the kernels. On any device (the engine measures it on CUDA)."""
    config = runner.config
    big = min(config.max_num_batched_tokens, (config.max_model_len - 1) * 16 // 17)
    small = big // 16
    if small < 1:
        seconds = min(timed_prefill(runner, big, 0, kv_scales)[0] for _ in range(1 + repeats))
        return PrefillCost(0.0, seconds / max(big, 1))
    runs = [
        (timed_prefill(runner, small, 0, kv_scales)[0], *timed_prefill(runner, big, small, kv_scales))
        for _ in range(1 + repeats)
    ]
    small_s, big_s, after_big_s = (min(column) for column in zip(*runs[1:]))
    return prefill_cost.fit(small, big, small_s, big_s, after_big_s)


def timed_prefill(
    runner: ModelRunner, tokens: int, after: int, kv_scales: list[KVScales] | None
) -> tuple[float, float]:
    """Seconds to prefill ``tokens`` tokens into a fresh cache, then (0 if ``after`` is 0)
    seconds to compute ``after`` more over them."""
    total = tokens + after
    table = list(range(-(-total // runner.block_size)))
    cache = runner.spec.allocate(len(table), runner.device)
    prompt = [0] * total
    cuda = runner.device.type == "cuda"
    seconds = []
    for start, count in ((0, tokens), (tokens, after)):
        if not count:
            seconds.append(0.0)
            continue
        if cuda:
            torch.cuda.synchronize(runner.device)
        begin = time.perf_counter()
        _forward(runner, cache, [prompt], [start], [count], [table], kv_scales)
        if cuda:
            torch.cuda.synchronize(runner.device)
        seconds.append(time.perf_counter() - begin)
    return seconds[0], seconds[1]


@torch.inference_mode()
def calibrate_fp8_scales(runner: ModelRunner, token_ids: list[int]) -> list[KVScales]:
    """Per-layer fp8 scales from the K/V the model writes for ``token_ids``."""
    model_dtype = next(runner.model.parameters()).dtype
    cache = _forward_on_fresh_cache(
        runner, [token_ids], dataclasses.replace(runner.spec, dtype=model_dtype), None
    )
    return fp8_scales_from_cache(cache)


def _forward_on_fresh_cache(
    runner: ModelRunner, prompts: list[list[int]], spec: KVCacheSpec, kv_scales: list[KVScales] | None
) -> torch.Tensor:
    """Prefill ``prompts`` into a new cache just big enough for them (and compute logits)."""
    tables, num_blocks = [], 0
    for prompt in prompts:
        count = -(-len(prompt) // runner.block_size)
        tables.append(list(range(num_blocks, num_blocks + count)))
        num_blocks += count
    cache = spec.allocate(num_blocks, runner.device)  # [num_blocks, L, 2, T, H, D]
    lengths = [len(p) for p in prompts]
    _forward(runner, cache, prompts, [0] * len(prompts), lengths, tables, kv_scales)
    return cache


def _forward(
    runner: ModelRunner,
    cache: torch.Tensor,
    prompts: Sequence[Sequence[int]],
    starts: Sequence[int],
    counts: Sequence[int],
    tables: Sequence[Sequence[int]],
    kv_scales: list[KVScales] | None,
) -> None:
    """One step on ``cache``: prompt ``b`` computes ``counts[b]`` tokens from ``starts[b]``,
    and the logits (softmaxed) of each one's last token."""
    batch = runner.prepare(prompts, starts, counts, tables, [1] * len(prompts))
    model = runner.model
    hidden = model(batch.input_ids, batch.positions, cache, batch.meta, kv_scales)
    torch.softmax(model.compute_logits(hidden[batch.logits_indices]), dim=-1)
