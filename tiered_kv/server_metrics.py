"""The server's and the engine's Prometheus metrics, next to the tier metrics.

They are registered in the tier manager's registry (or a new one when the server runs
without tiers), so ``/metrics`` exports everything from one registry. Latencies are
measured by the server, as a client sees them (queueing included); the engine's gauges and
counters are read from :meth:`engine.AsyncLLM.stats` at scrape time.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.stats import EngineStats

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0,
)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class ServerMetrics:
    """Histograms and counters the request handlers update, plus a collector for the engine.

    Call :meth:`close` to take them out of the registry again (an app's shutdown does), so
    that another app may register them on the same registry.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        engine_stats: Callable[[], EngineStats],
        inflight: Callable[[], int],
    ) -> None:
        self.registry = registry
        self.ttft = Histogram(
            "tiered_kv_time_to_first_token_seconds",
            "Time from receiving a request to its first generated token.",
            buckets=TTFT_BUCKETS,
            registry=None,
        )
        self.itl = Histogram(
            "tiered_kv_inter_token_latency_seconds",
            "Time between two outputs of a streaming request, per token.",
            buckets=ITL_BUCKETS,
            registry=None,
        )
        self.e2e = Histogram(
            "tiered_kv_e2e_request_latency_seconds",
            "Time from receiving a request to its last token.",
            buckets=E2E_BUCKETS,
            registry=None,
        )
        self.requests = Counter(
            "tiered_kv_requests",
            "HTTP requests answered, by route and status code.",
            ["route", "status"],
            registry=None,
        )
        self.finished = Counter(
            "tiered_kv_request_finished",
            "Generation requests finished, by finish reason (stop, length, abort).",
            ["finish_reason"],
            registry=None,
        )
        self.cached_prompt_tokens = Counter(
            "tiered_kv_cached_prompt_tokens",
            "Prompt tokens reported as cached to clients (GPU prefix hits plus tier loads).",
            registry=None,
        )
        self._collectors = [
            self.ttft, self.itl, self.e2e, self.requests, self.finished, self.cached_prompt_tokens,
            _EngineCollector(engine_stats, inflight),
        ]
        for collector in self._collectors:
            registry.register(collector)

    def close(self) -> None:
        for collector in self._collectors:
            try:
                self.registry.unregister(collector)
            except KeyError:
                pass


class _EngineCollector:
    """Gauges and counters from the engine's stats snapshot, built at scrape time."""

    def __init__(self, engine_stats: Callable[[], EngineStats], inflight: Callable[[], int]) -> None:
        self._engine_stats = engine_stats
        self._inflight = inflight

    def describe(self) -> Iterator[Metric]:
        return iter(self._families(None))

    def collect(self) -> Iterator[Metric]:
        return iter(self._families(self._engine_stats()))

    def _families(self, s: EngineStats | None) -> list[Metric]:
        def gauge(name: str, doc: str, value: Callable[[EngineStats], float]) -> Metric:
            family = GaugeMetricFamily(name, doc)
            if s is not None:
                family.add_metric([], value(s))
            return family

        def counter(name: str, doc: str, value: Callable[[EngineStats], float]) -> Metric:
            family = CounterMetricFamily(name, doc)
            if s is not None:
                family.add_metric([], value(s))
            return family

        inflight = GaugeMetricFamily(
            "tiered_kv_num_requests_inflight", "Requests the server holds (running or queued)."
        )
        if s is not None:
            inflight.add_metric([], self._inflight())
        return [
            inflight,
            gauge("tiered_kv_num_requests_running", "Sequences the engine is running.", lambda s: s.num_running),
            gauge("tiered_kv_num_requests_waiting", "Sequences waiting in the engine's scheduler.", lambda s: s.num_waiting),
            gauge("tiered_kv_num_requests_loading", "Sequences waiting for their KV to load from the tiers.", lambda s: s.num_loading),
            gauge("tiered_kv_kv_cache_usage_ratio", "Fraction of the engine's KV blocks in use.", lambda s: s.kv_usage),
            gauge("tiered_kv_gpu_cache_blocks", "KV blocks in the engine's pool.", lambda s: s.num_blocks),
            counter("tiered_kv_prefix_cache_queries", "Prompt tokens looked up in the engine's prefix cache.", lambda s: s.prefix_cache_queries),
            counter("tiered_kv_prefix_cache_hits", "Of those, tokens found in the engine's prefix cache.", lambda s: s.prefix_cache_hits),
            counter("tiered_kv_connector_hit_tokens", "Prompt tokens loaded from the tiers below the engine.", lambda s: s.connector_hits),
            counter("tiered_kv_connector_load_failures", "Tier loads that failed and were recomputed.", lambda s: s.connector_load_failures),
            counter("tiered_kv_num_preemptions", "Sequences preempted for lack of KV blocks.", lambda s: s.num_preemptions),
            counter("tiered_kv_prompt_tokens", "Prompt tokens computed by the engine (not cached).", lambda s: s.num_prompt_tokens),
            counter("tiered_kv_generation_tokens", "Tokens generated.", lambda s: s.num_generated_tokens),
        ]
