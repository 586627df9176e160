"""The inter-token latency histogram (``TokenLatencies``): what ``/metrics`` shows of it is what
two prometheus_client ``Histogram`` s observed token by token would show."""
from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from tiered_kv.server_metrics import ITL_BUCKETS, TokenLatencies

NAMES = (("vllm:inter_token_latency_seconds", "one"), ("vllm:time_per_output_token_seconds", "two"))


def page(registry: CollectorRegistry) -> list[str]:
    """The exposition without ``_created`` lines (the server's export leaves them out)."""
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_token_latencies_show_as_a_histogram_per_name_observed_token_by_token():
    histograms, ours = CollectorRegistry(), CollectorRegistry()
    both = [Histogram(name, doc, buckets=ITL_BUCKETS, registry=histograms) for name, doc in NAMES]
    latencies = TokenLatencies(ITL_BUCKETS, NAMES)
    ours.register(latencies)
    rng = random.Random(7)
    # on the bounds, between them, below the first and past the last
    values = [0.0, 0.01, 0.025, 0.0250001, 80.0, 80.5, 1e-9] + [rng.expovariate(10) for _ in range(500)]
    for value in values:
        for histogram in both:
            histogram.observe(value)
        latencies.observe(value)
    assert page(ours) == page(histograms)


def test_a_whole_responses_tokens_count_at_once():
    """``observe(value, count)``: ``count`` tokens of that latency (a response not streamed
    brings all its tokens in one output)."""
    one_by_one, at_once = TokenLatencies(ITL_BUCKETS, NAMES), TokenLatencies(ITL_BUCKETS, NAMES)
    for value, count in [(0.02, 7), (0.3, 1), (100.0, 3)]:
        for _ in range(count):
            one_by_one.observe(value)
        at_once.observe(value, count)
    families = [list(one_by_one.collect()), list(at_once.collect())]
    samples = [[(s.name, s.labels, round(s.value, 9)) for f in fs for s in f.samples] for fs in families]
    assert samples[0] == samples[1]
    assert [f.name for f in families[0]] == [name for name, _ in NAMES]
