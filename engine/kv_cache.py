"""The KV cache tensor: its shape, how many blocks fit, and fp8 scales.

One block-major tensor ``[num_blocks, L, 2, block_size, kv_heads, head_dim]`` holds every
layer's keys (index 0) and values (index 1): block ``b`` is ``kv_cache[b]``, one contiguous
``[L, 2, T, H, D]`` region, so a block moves to and from host memory in one copy. Layer
``l`` attends through :func:`layer_view`, a strided ``[2, num_blocks, T, H, D]`` view in
which each block's ``[T, H, D]`` is contiguous.

Sizing. ``num_gpu_blocks_override`` wins everywhere. On the CPU the cache gets
``cpu_kv_cache_bytes``. On CUDA it gets what ``gpu_memory_utilization`` of the device leaves
after the peak of a measured warm-up forward (``max_num_batched_tokens`` dummy tokens) and
after memory that other processes and the CUDA context hold.

fp8. An fp8 (e4m3) cache stores ``x / scale`` with one scale per layer for K and one for V.
The scales are calibrated once at start-up from the model's own K/V on a fixed prompt
(:data:`FP8_CALIBRATION_TEXT`): ``amax * FP8_HEADROOM / 448`` rounded *up to a power of
two*. Rounding makes the scales (which enter the KV namespace) stable against the last-bit
differences between devices and kernels, and scaling by a power of two is exact.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.attention import KVScales

if TYPE_CHECKING:
    from engine.config import EngineConfig

FP8_DTYPE = torch.float8_e4m3fn
FP8_HEADROOM = 2.0  # room for activations up to twice the calibration prompt's maximum
FP8_CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. A paged KV cache splits each sequence "
    "into fixed-size blocks, so that memory is allocated on demand and shared between "
    "requests with a common prefix. 0123456789 — Numbers, punctuation; and CAPITALS too!\n"
    "def add(a, b):\n    return a + b\n"
)


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """The shape and dtype of one engine's KV cache, less the number of blocks."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def allocate(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        # [num_blocks, L, 2, T, H, D]
        return torch.zeros(self.shape(num_blocks), dtype=self.dtype, device=device)


def layer_view(kv_cache: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer ``layer``'s ``[2, num_blocks, T, H, D]`` view of a ``[num_blocks, L, 2, T, H, D]``
    cache: not contiguous (blocks lie ``L * 2 * T * H * D`` elements apart), but each block's
    ``[T, H, D]`` is. Writes through it land in ``kv_cache``."""
    return kv_cache[:, layer].transpose(0, 1)


def kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for an :class:`~engine.config.EngineConfig` ``kv_cache_dtype``."""
    return FP8_DTYPE if kv_cache_dtype == "fp8" else model_dtype


def num_blocks_for_budget(spec: KVCacheSpec, budget_bytes: int) -> int:
    return budget_bytes // spec.bytes_per_block


def cuda_kv_budget(device: torch.device, gpu_memory_utilization: float, peak_bytes: int) -> int:
    """Bytes left for the KV cache on ``device`` after the warm-up peak (``peak_bytes``) and
    what others hold, within ``gpu_memory_utilization`` of the device's memory."""
    free, total = torch.cuda.mem_get_info(device)
    held_by_others = total - free - torch.cuda.memory_reserved(device)
    return int(total * gpu_memory_utilization) - held_by_others - peak_bytes


def num_pool_blocks(
    config: EngineConfig, spec: KVCacheSpec, peak_bytes: Callable[[], int], draft_bytes: int = 0
) -> int:
    """Blocks of the pool (see *Sizing* above; ``peak_bytes`` measures the warm-up forward's
    peak on CUDA). With a draft model each block of the pool has one of the draft's pool
    beside it (``draft_bytes`` each) within the same budget. Raises ``ValueError`` when
    one sequence of ``max_model_len`` would not fit."""
    share = spec.bytes_per_block / (spec.bytes_per_block + draft_bytes)
    device = config.torch_device
    if config.num_gpu_blocks_override is not None:
        num_blocks = config.num_gpu_blocks_override
    elif device.type == "cuda":
        budget = cuda_kv_budget(device, config.gpu_memory_utilization, peak_bytes())
        num_blocks = num_blocks_for_budget(spec, int(max(budget, 0) * share))
    else:
        num_blocks = num_blocks_for_budget(spec, int(config.cpu_kv_cache_bytes * share))
    needed = -(-config.max_model_len // config.block_size)
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache has room for {num_blocks} blocks ({num_blocks * config.block_size} "
            f"tokens), fewer than one sequence of max_model_len={config.max_model_len} needs "
            f"({needed} blocks); lower max_model_len or give the cache more memory "
            "(gpu_memory_utilization, cpu_kv_cache_bytes, num_gpu_blocks_override)"
        )
    return num_blocks


def fp8_scale(amax: float) -> float:
    """The power of two at or above ``amax * FP8_HEADROOM / 448`` (1.0 for an all-zero tensor)."""
    if not math.isfinite(amax) or amax <= 0:
        return 1.0
    limit = torch.finfo(FP8_DTYPE).max
    return 2.0 ** math.ceil(math.log2(amax * FP8_HEADROOM / limit))


def fp8_scales_from_cache(kv_cache: torch.Tensor) -> list[KVScales]:
    """Per-layer scales from a cache filled (in a wider dtype) by a calibration forward."""
    amax = kv_cache.abs().amax(dim=(0, 3, 4, 5)).float().tolist()  # [L, 2]
    return [KVScales(k=fp8_scale(k), v=fp8_scale(v)) for k, v in amax]
