"""The server's Prometheus metrics: vLLM's names and buckets for what vLLM also measures,
``tiered_kv_*`` for what is ours, all labelled with the served model's name.

``/metrics`` exports one registry (the app's): the request metrics measured here (latencies
as a client sees them, queueing included), the engine's (:mod:`tiered_kv.engine_metrics`)
and the tier manager's (:mod:`tiered_kv.metrics`), through one
:class:`~tiered_kv.metrics_export.LabelledExport`. docs/operations.md lists them all.
"""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram

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
    ) -> None:
        self.registry = registry
        own = CollectorRegistry()
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds (from receiving the request).",
            buckets=TTFT_BUCKETS,
            registry=own,
        )
        itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            buckets=ITL_BUCKETS,
            registry=own,
        )
        tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (vLLM's older name of "
            "vllm:inter_token_latency_seconds).",
            buckets=ITL_BUCKETS,
            registry=own,
        )
        self.itl = _Both(itl, tpot)
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


class _Both:
    """Observes into two histograms: vLLM exports inter-token latency under both names."""

    def __init__(self, first: Histogram, second: Histogram) -> None:
        self._histograms = (first, second)

    def observe(self, value: float) -> None:
        for histogram in self._histograms:
            histogram.observe(value)
