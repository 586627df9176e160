"""The server's Prometheus metrics: vLLM's names and buckets for what vLLM also measures,
``tiered_kv_*`` for what is ours, all labelled with the served model's name.

``/metrics`` exports one registry (the app's): the request metrics measured here (latencies
as a client sees them, queueing included), the engine's (:mod:`tiered_kv.engine_metrics`)
and the tier manager's (:mod:`tiered_kv.metrics`), through one
:class:`~tiered_kv.metrics_export.LabelledExport`. docs/operations.md lists them all.
"""
from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from engine.config import DEFAULT_MAX_MODEL_LEN, EngineConfig
from engine.outputs import RequestOutput
from engine.stats import EngineStats
from tiered_kv.engine_metrics import EngineCollector
from tiered_kv.metrics import TierMetrics
from tiered_kv.metrics_export import LabelledExport

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)


REQUEST_LATENCY_BUCKETS = E2E_BUCKETS  # vLLM's, for the phases of a request
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five(limit: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50... up to ``limit``."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(buckets)
            buckets.append(m * scale)
        scale *= 10


class ServerMetrics:
    """The histograms and counters the request handlers update, and the export of everything
    (these, the engine's, the tiers') into ``registry`` under ``model_name``.

    Call :meth:`close` to take the export out of ``registry`` again (an app's shutdown does).
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        engine_stats: Callable[[], EngineStats],
        inflight: Callable[[], int],
        tiers: TierMetrics | None = None,
        engine_config: EngineConfig | None = None,
    ) -> None:
        self.registry = registry
        own = CollectorRegistry()
        engine_config = engine_config or EngineConfig()
        if engine_config.max_model_len is not None:  # resolved: the engine's
            max_model_len = engine_config.max_model_len
        else:
            max_model_len = DEFAULT_MAX_MODEL_LEN
        labels = _cache_info(engine_config, engine_stats())
        info = Gauge(
            "vllm:cache_config_info", "Information of the KV cache's configuration (vLLM's).",
            list(labels), registry=own,
        )
        info.labels(**labels).set(1)
        # a request's phases in the engine, as vLLM splits them
        self.phases = {
            phase: Histogram(
                f"vllm:request_{phase}_time_seconds", f"Histogram of time spent in {text} in seconds.",
                buckets=REQUEST_LATENCY_BUCKETS, registry=own,
            )
            for phase, text in (
                ("queue", "the waiting queue"), ("prefill", "prefill (its KV loaded or computed)"),
                ("decode", "decode"), ("inference", "prefill and decode"),
            )
        }
        tokens = one_two_five(max_model_len)
        self.prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", buckets=tokens, registry=own,
        )
        self.generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", buckets=tokens,
            registry=own,
        )
        self.params_n = Histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", buckets=PARAMS_N_BUCKETS,
            registry=own,
        )
        self.params_max_tokens = Histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            buckets=tokens, registry=own,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds (from receiving the request).",
            buckets=TTFT_BUCKETS,
            registry=own,
        )
        self.itl = TokenLatencies(ITL_BUCKETS, (
            ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
            ("vllm:time_per_output_token_seconds",
             "Histogram of time per output token in seconds (vLLM's older name of "
             "vllm:inter_token_latency_seconds)."),
        ))
        own.register(self.itl)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds (from receiving the request).",
            buckets=E2E_BUCKETS,
            registry=own,
        )
        self.finished = Counter(
            "vllm:request_success",
            "Count of processed requests by finish reason (stop, length, abort, error).",
            ["finished_reason"],
            registry=own,
        )
        self.cached_prompt_tokens = Counter(
            "vllm:prompt_tokens_cached",
            "Prompt tokens reported as cached to clients (GPU prefix hits plus tier loads).",
            registry=own,
        )
        self.requests = Counter(
            "tiered_kv_requests",
            "HTTP requests answered, by route and status code.",
            ["route", "status"],
            registry=own,
        )
        own.register(EngineCollector(engine_stats, inflight, tiers))
        sources = [own] if tiers is None else [own, tiers.registry]
        self._export = LabelledExport(sources, model_name)
        registry.register(self._export)

    def close(self) -> None:
        try:
            self.registry.unregister(self._export)
        except KeyError:
            pass

    def observe_finished(self, out: RequestOutput, num_tokens: int) -> None:
        """A finished generation's phases (from the engine's stamps) and token counts
        (``num_tokens`` generated)."""
        times = out.times
        if times is not None and times.scheduled is not None:
            self.phases["queue"].observe(times.scheduled - times.arrival)
            if times.first_token is not None and times.last_token is not None:
                self.phases["prefill"].observe(times.first_token - times.scheduled)
                self.phases["decode"].observe(times.last_token - times.first_token)
                self.phases["inference"].observe(times.last_token - times.scheduled)
        self.prompt_tokens.observe(len(out.prompt_token_ids))
        self.generation_tokens.observe(num_tokens)


def _cache_info(config: EngineConfig, stats: EngineStats) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info``: vLLM's names for the cache's settings."""
    return {
        "block_size": str(config.block_size),
        "cache_dtype": str(config.kv_cache_dtype),
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "gpu_memory_utilization": str(config.gpu_memory_utilization),
        "num_gpu_blocks": str(stats.num_blocks),
        "num_gpu_blocks_override": str(config.num_gpu_blocks_override),
    }


class TokenLatencies:
    """The inter-token latency histogram, exported under each of ``names`` (``(name, help)``;
    vLLM exports it under two), as a ``Histogram`` of those buckets would be.

    It is observed once per generated token, on the event loop, which shares the interpreter
    lock with the engine's thread: a streamed output at a time, or a whole response's tokens
    in one call. Its counts are plain floats, updated without prometheus_client's lock (the
    event loop is the only writer; ``/metrics`` reads them on the same loop), and one
    observation serves every name: two ``Histogram.observe`` calls per token cost ~2 µs."""

    def __init__(self, buckets: Sequence[float], names: Sequence[tuple[str, str]]) -> None:
        self._bounds = [float(b) for b in buckets] + [math.inf]
        self._names = tuple(names)
        self._counts = [0.0] * len(self._bounds)
        self._sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """``count`` tokens, each ``value`` seconds after the one before."""
        self._counts[bisect.bisect_left(self._bounds, value)] += count
        self._sum += value * count

    def collect(self) -> Iterator[Metric]:
        buckets = [
            (floatToGoString(bound), total) for bound, total in zip(self._bounds, itertools.accumulate(self._counts))
        ]
        for name, documentation in self._names:
            yield HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=self._sum)

    def describe(self) -> Iterator[Metric]:
        for name, documentation in self._names:
            yield HistogramMetricFamily(name, documentation)
