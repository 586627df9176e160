"""Reading a ``/metrics`` page in tests: its families by name, and its samples."""
from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

_TYPE_LINE = re.compile(r"^# TYPE (\S+) (\S+)$", re.M)

# vLLM's histogram buckets (vllm/v1/metrics/loggers.py), copied here so that a change on our
# side shows up as a test failure, not as a silent drift.
VLLM_BUCKETS = {
    "vllm:time_to_first_token_seconds": (
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
    ),
    "vllm:inter_token_latency_seconds": (
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0,
    ),
    "vllm:e2e_request_latency_seconds": (
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
        240.0, 480.0, 960.0, 1920.0, 7680.0,
    ),
}
VLLM_BUCKETS["vllm:iteration_tokens_total"] = (
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
)
VLLM_BUCKETS["vllm:time_per_output_token_seconds"] = VLLM_BUCKETS["vllm:inter_token_latency_seconds"]


def families(text: str) -> dict[str, str]:
    """``# TYPE`` name → type: the names as a query uses them (counters with ``_total``)."""
    return dict(_TYPE_LINE.findall(text))


def sample_names(text: str) -> set[str]:
    """Every sample name on the page (``x_bucket``, ``x_sum``, ``y_total``, ``z``...)."""
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples called ``name``: (labels, value) pairs."""
    return [
        (s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]


def value(text: str, name: str, **labels: str) -> float:
    """The one sample called ``name`` whose labels include ``labels``."""
    (found,) = [v for ls, v in samples(text, name) if labels.items() <= ls.items()]
    return found
