"""The engine's gauges and counters under vLLM's names, built at scrape time from
:meth:`engine.AsyncLLM.stats` (and, for the CPU tier's hit rate and usage, from the tier
manager's counters).

Names and meanings follow vLLM's ``vllm/v1/metrics/loggers.py`` (and, for the CPU tier,
the V0 engine's ``vllm/engine/metrics.py``); what is ours alone is named ``tiered_kv_*``.
The ``model_name`` and ``engine`` labels are added on export (:mod:`tiered_kv.metrics_export`).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric,
)

from engine.stats import ITERATION_TOKEN_BUCKETS, EngineStats
from tiered_kv.metrics import TierMetrics

# (name, documentation, value): gauges, then counters (exported with the suffix _total)
_GAUGES: tuple[tuple[str, str, Callable[[EngineStats], float]], ...] = (
    ("vllm:num_requests_running", "Number of requests in model execution batches.",
     lambda s: s.num_running),
    ("vllm:num_requests_waiting",
     "Number of requests waiting to be processed (waiting for KV from the tiers included).",
     lambda s: s.num_waiting + s.num_loading),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
     lambda s: s.kv_usage),
    ("vllm:gpu_cache_usage_perc",
     "GPU KV-cache usage. 1 means 100 percent usage (vLLM's older name of "
     "vllm:kv_cache_usage_perc).",
     lambda s: s.kv_usage),
    ("vllm:gpu_prefix_cache_hit_rate",
     "GPU prefix cache hit rate since start, in tokens (hits / queries).",
     lambda s: s.prefix_cache_hit_rate),
    ("tiered_kv_num_requests_loading", "Requests waiting for their KV to load from the tiers.",
     lambda s: s.num_loading),
    ("tiered_kv_gpu_cache_blocks", "KV blocks in the engine's pool.", lambda s: s.num_blocks),
)
_COUNTERS: tuple[tuple[str, str, Callable[[EngineStats], float]], ...] = (
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
     lambda s: s.prefix_cache_queries),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
     lambda s: s.prefix_cache_hits),
    ("vllm:gpu_prefix_cache_queries",
     "GPU prefix cache queries, in tokens (vLLM's older name of vllm:prefix_cache_queries).",
     lambda s: s.prefix_cache_queries),
    ("vllm:gpu_prefix_cache_hits",
     "GPU prefix cache hits, in tokens (vLLM's older name of vllm:prefix_cache_hits).",
     lambda s: s.prefix_cache_hits),
    ("vllm:external_prefix_cache_queries",
     "Prompt tokens of the requests that asked the KV tiers (CPU, disk, remote) through the "
     "KV connector, in tokens.",
     lambda s: s.connector_queries),
    ("vllm:external_prefix_cache_hits",
     "Prompt tokens loaded from the KV tiers (CPU, disk, remote) through the KV connector.",
     lambda s: s.connector_hits),
    ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
     lambda s: s.num_preemptions),
    ("vllm:prompt_tokens", "Number of prefill tokens processed (computed, not cached).",
     lambda s: s.num_prompt_tokens),
    ("vllm:generation_tokens", "Number of generation tokens processed.",
     lambda s: s.num_generated_tokens),
    ("tiered_kv_connector_load_failures", "Tier loads that failed and were recomputed.",
     lambda s: s.connector_load_failures),
    ("tiered_kv_connector_overlapped_loads",
     "Tier hits split by an idle engine: the head recomputed while the tail loads.",
     lambda s: s.connector_overlapped_loads),
    ("tiered_kv_connector_overlap_tokens",
     "Prompt tokens of split hits recomputed while the rest loaded, in tokens.",
     lambda s: s.connector_overlap_tokens),
    ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
     lambda s: s.spec_num_drafts),
    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
     lambda s: s.spec_num_draft_tokens),
    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
     lambda s: s.spec_num_accepted_tokens),
)
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


class EngineCollector:
    """The families above, ``vllm:spec_decode_num_accepted_tokens_per_pos`` (by ``position``;
    no samples without speculative decoding), ``vllm:iteration_tokens_total``,
    ``tiered_kv_num_requests_inflight`` (the server's count) and,
    with a CPU tier, ``vllm:cpu_prefix_cache_hit_rate`` and ``vllm:cpu_cache_usage_perc``."""

    def __init__(
        self,
        engine_stats: Callable[[], EngineStats],
        inflight: Callable[[], int],
        tiers: TierMetrics | None,
    ) -> None:
        self._engine_stats = engine_stats
        self._inflight = inflight
        self._tiers = tiers if tiers is not None and "cpu" in tiers.tiers else None

    def describe(self) -> Iterator[Metric]:
        return iter(self._families(None))

    def collect(self) -> Iterator[Metric]:
        return iter(self._families(self._engine_stats()))

    def _families(self, s: EngineStats | None) -> list[Metric]:
        families: list[Metric] = []
        for name, doc, value in _GAUGES:
            families.append(GaugeMetricFamily(name, doc, value=None if s is None else value(s)))
        for name, doc, value in _COUNTERS:
            families.append(CounterMetricFamily(name, doc, value=None if s is None else value(s)))
        per_pos = CounterMetricFamily(
            _PER_POS, "Accepted tokens per draft position.", labels=["position"]
        )
        for position, count in enumerate(s.spec_accepted_per_pos if s is not None else ()):
            per_pos.add_metric([str(position)], count)
        families.append(per_pos)
        families.append(_iteration_tokens(s))
        families.append(GaugeMetricFamily(
            "tiered_kv_num_requests_inflight", "Requests the server holds (running or queued).",
            value=None if s is None else self._inflight(),
        ))
        if self._tiers is not None:
            cpu = self._tiers.snapshot()["cpu"] if s is not None else None
            families.append(GaugeMetricFamily(
                "vllm:cpu_prefix_cache_hit_rate",
                "CPU prefix cache block hit rate since start: blocks loaded from the CPU tier "
                "/ blocks looked up in it.",
                value=None if cpu is None else _ratio(cpu["hit_blocks"], cpu["lookups"]),
            ))
            families.append(GaugeMetricFamily(
                "vllm:cpu_cache_usage_perc",
                "CPU KV-cache usage (the CPU tier). 1 means 100 percent usage.",
                value=None if cpu is None else _ratio(cpu.get("bytes_used", 0), cpu.get("capacity_bytes", 0)),
            ))
        return families


def _iteration_tokens(s: EngineStats | None) -> HistogramMetricFamily:
    """vLLM's histogram of the tokens each engine step computed, from the engine's counts."""
    name, doc = "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step."
    if s is None:
        return HistogramMetricFamily(name, doc)
    bounds = [str(float(b)) for b in ITERATION_TOKEN_BUCKETS] + ["+Inf"]
    cumulative = list(itertools.accumulate(s.iteration_tokens))
    return HistogramMetricFamily(
        name, doc, buckets=list(zip(bounds, cumulative)), sum_value=s.iteration_tokens_sum
    )


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0
