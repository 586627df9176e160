"""Engine counters and latency samples, and a snapshot type to read them."""
from __future__ import annotations

import bisect
import dataclasses
import time
from collections import deque
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from engine.block_manager import BlockManager
    from engine.scheduler import Scheduler

DEFAULT_MAX_SAMPLES = 1000
# Upper bounds of vLLM's ``vllm:iteration_tokens_total`` buckets (tokens per engine step);
# a last, unbounded bucket follows.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class GpuMemory(NamedTuple):
    total_bytes: int
    used_bytes: int  # by every process on the device, as NVML reports it


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A point-in-time copy of the engine's state and counters. Counters only grow."""

    num_blocks: int
    num_used_blocks: int  # referenced by a sequence, or held (a connector's save, a forward launched ahead)
    num_cached_blocks: int  # findable in the prefix cache (referenced or free)
    num_running: int
    num_waiting: int
    num_loading: int  # waiting for the connector to load part of their prefix
    prefix_cache_queries: int  # tokens looked up in the GPU prefix cache
    prefix_cache_hits: int  # of those, tokens found there
    connector_queries: int  # prompt tokens of the requests admitted with a connector
    connector_hits: int  # prompt tokens loaded through the connector
    connector_load_failures: int  # loads that brought fewer blocks than asked (rest recomputed)
    connector_overlapped_loads: int  # hits split: the head recomputed while the tail loads
    connector_overlap_tokens: int  # prompt tokens of those heads, recomputed instead of loaded
    num_preemptions: int
    num_prompt_tokens: int  # prompt tokens computed (not cached)
    num_generated_tokens: int
    num_finished_requests: int
    ttft_s: tuple[float, ...]  # recent time-to-first-token samples
    itl_s: tuple[float, ...]  # recent inter-token latency samples
    gpu_memory: GpuMemory | None  # NVML telemetry; None without CUDA or NVML
    # speculative decoding (vLLM's spec_decode counters; zero without speculative_config)
    spec_num_drafts: int = 0  # verifications of a sequence's draft tokens
    spec_num_draft_tokens: int = 0  # draft tokens verified
    spec_num_accepted_tokens: int = 0  # of those, accepted
    spec_accepted_per_pos: tuple[int, ...] = ()  # [i]: verifications that accepted draft i
    # steps by tokens computed, per ITERATION_TOKEN_BUCKETS (not cumulative; the last is
    # past the largest bound), and the tokens of all steps
    iteration_tokens: tuple[int, ...] = (0,) * (len(ITERATION_TOKEN_BUCKETS) + 1)
    iteration_tokens_sum: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        if not self.spec_num_draft_tokens:
            return 0.0
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens

    @property
    def kv_usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries


class StatsCollector:
    """The engine's mutable counters. Updated only by the engine thread."""

    def __init__(self, max_samples: int = DEFAULT_MAX_SAMPLES) -> None:
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.connector_queries = 0
        self.connector_hits = 0
        self.connector_load_failures = 0
        self.connector_overlapped_loads = 0
        self.connector_overlap_tokens = 0
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.num_finished_requests = 0
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos: list[int] = []  # num_speculative_tokens long when on
        self.ttft_s: deque[float] = deque(maxlen=max_samples)
        self.itl_s: deque[float] = deque(maxlen=max_samples)
        self.iteration_tokens = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self.iteration_tokens_sum = 0

    def snapshot(
        self, bm: BlockManager, scheduler: Scheduler, gpu_memory: GpuMemory | None
    ) -> EngineStats:
        """The counters now, with the pool's and the queues' state."""
        return EngineStats(
            num_blocks=bm.num_blocks,
            num_used_blocks=bm.num_used_blocks,
            num_cached_blocks=bm.num_cached_blocks,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_loading=len(scheduler.loading),
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            connector_queries=self.connector_queries,
            connector_hits=self.connector_hits,
            connector_load_failures=self.connector_load_failures,
            connector_overlapped_loads=self.connector_overlapped_loads,
            connector_overlap_tokens=self.connector_overlap_tokens,
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens,
            num_finished_requests=self.num_finished_requests,
            ttft_s=tuple(self.ttft_s),
            itl_s=tuple(self.itl_s),
            gpu_memory=gpu_memory,
            spec_num_drafts=self.spec_num_drafts,
            spec_num_draft_tokens=self.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.spec_num_accepted_tokens,
            spec_accepted_per_pos=tuple(self.spec_accepted_per_pos),
            iteration_tokens=tuple(self.iteration_tokens),
            iteration_tokens_sum=self.iteration_tokens_sum,
        )

    def observe_iteration(self, num_tokens: int) -> None:
        """A step computed ``num_tokens`` tokens (prompt and generated, drafts included)."""
        self.iteration_tokens[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += 1
        self.iteration_tokens_sum += num_tokens


MEMORY_TTL_S = 0.5


class NvmlTelemetry:
    """Total and used memory of one CUDA device through NVML (package ``nvidia-ml-py``)."""

    def __init__(self, device: torch.device) -> None:
        self._handle = None
        self._nvml = None
        self._memory: GpuMemory | None = None
        self._memory_at = 0.0
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            index = device.index if device.index is not None else torch.cuda.current_device()
            # NVML numbers devices physically; the UUID also holds under CUDA_VISIBLE_DEVICES.
            uuid = f"GPU-{torch.cuda.get_device_properties(index).uuid}"
            try:
                self._handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            except pynvml.NVMLError:
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:  # no NVML library, no driver access: telemetry is optional
            self._handle = None

    def memory(self) -> GpuMemory | None:
        """At most ``MEMORY_TTL_S`` old: the engine thread takes stats after every step, and
        an NVML query is not free."""
        if self._handle is None:
            return None
        now = time.monotonic()
        if self._memory is None or now - self._memory_at >= MEMORY_TTL_S:
            info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
            self._memory, self._memory_at = GpuMemory(int(info.total), int(info.used)), now
        return self._memory

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None
            self._handle = None
