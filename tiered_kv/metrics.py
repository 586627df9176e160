"""Per-tier counters of one :class:`~tiered_kv.TierManager`, exported as Prometheus metrics.

Each manager owns a :class:`TierMetrics` and with it its own ``CollectorRegistry``: nothing
is registered globally, so several managers (tests, several engines) never share counters.
Serve ``manager.registry`` on ``/metrics`` (``prometheus_client.generate_latest``).

Every metric has a ``tier`` label (``cpu``, ``disk``, ``remote``). See ``docs/tiers.md`` for
the list.
Counters kept here are the manager's view (what it looked up, loaded, stored, dropped);
occupancy and evictions come from the stores' own :class:`~storage.base.StoreStats`, read
at scrape time, and the stores' ``corrupt`` and ``dropped`` counts are added to the
manager's.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from storage.base import StoreStats

LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
)


@dataclasses.dataclass
class TierCounters:
    """What the manager did with one tier. Counters only grow."""

    lookups: int = 0  # blocks looked up (a block is asked of the next tier only if missing)
    hit_blocks: int = 0  # blocks loaded from the tier into the engine
    hit_tokens: int = 0
    loaded_bytes: int = 0  # KV bytes written into engine blocks from the tier
    load_seconds: float = 0.0  # time spent on those loads
    stored_blocks: int = 0  # blocks written into the tier
    stored_bytes: int = 0  # bytes written into the tier (disk: encoded records)
    dropped: int = 0  # stores the manager gave up (write queue full, shutdown deadline)
    corrupt: int = 0  # records that failed the manager's checks (codec, shape, hash chain)
    load_failures: int = 0  # loads that failed in the tier; the engine recomputed


@dataclasses.dataclass(frozen=True)
class QueueStats:
    blocks: int
    bytes: int


class TierMetrics:
    """Thread-safe counters plus the latency histograms, in :attr:`registry`.

    ``store_stats()`` returns the stores' current stats by tier (called at scrape time and by
    :meth:`snapshot`); ``queue_stats()`` the disk writer's queue, or ``None``.
    """

    def __init__(
        self,
        tiers: Sequence[str],
        store_stats: Callable[[], dict[str, StoreStats]],
        queue_stats: Callable[[], QueueStats | None],
    ) -> None:
        self.tiers = tuple(tiers)
        self._store_stats = store_stats
        self._queue_stats = queue_stats
        self._lock = threading.Lock()
        self._counters = {tier: TierCounters() for tier in self.tiers}
        self.registry = CollectorRegistry()
        self._load_seconds = Histogram(
            "tiered_kv_load_seconds",
            "Time to load one request's blocks from a tier into the engine (per load call).",
            ["tier"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._store_seconds = Histogram(
            "tiered_kv_store_seconds",
            "Time to store one batch of blocks into a tier (cpu: one engine step's copies; "
            "disk: encoding and queueing one writer batch).",
            ["tier"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_Collector(self))

    def add(self, tier: str, **deltas: int) -> None:
        with self._lock:
            counters = self._counters[tier]
            for name, delta in deltas.items():
                setattr(counters, name, getattr(counters, name) + delta)

    def observe_load(
        self, tier: str, seconds: float, blocks: int, block_size: int, nbytes: int
    ) -> None:
        self._load_seconds.labels(tier=tier).observe(seconds)
        with self._lock:
            c = self._counters[tier]
            c.hit_blocks += blocks
            c.hit_tokens += blocks * block_size
            c.loaded_bytes += nbytes
            c.load_seconds += seconds

    def observe_store(self, tier: str, seconds: float, blocks: int, nbytes: int) -> None:
        self._store_seconds.labels(tier=tier).observe(seconds)
        self.add(tier, stored_blocks=blocks, stored_bytes=nbytes)

    def counters(self) -> dict[str, TierCounters]:
        with self._lock:
            return {tier: dataclasses.replace(c) for tier, c in self._counters.items()}

    def snapshot(self) -> dict[str, dict[str, int | float]]:
        """Per tier: the manager's counters merged with the store's occupancy and counts."""
        stores = self._store_stats()
        queue = self._queue_stats()
        result: dict[str, dict[str, int | float]] = {}
        for tier, c in self.counters().items():
            row: dict[str, int | float] = dataclasses.asdict(c)
            s = stores.get(tier)
            if s is not None:
                row.update(
                    entries=s.entries,
                    bytes_used=s.bytes_used,
                    capacity_bytes=s.capacity_bytes,
                    evictions=s.evictions,
                    corrupt=c.corrupt + s.corrupt,
                    dropped=c.dropped + s.dropped,
                )
            if tier == "disk" and queue is not None:
                row.update(queued_blocks=queue.blocks, queued_bytes=queue.bytes)
            row["load_bytes_per_s"] = c.loaded_bytes / c.load_seconds if c.load_seconds else 0.0
            result[tier] = row
        return result


_COUNTERS = (
    ("lookups", "tiered_kv_lookups", "Blocks looked up in the tier during prefix lookups."),
    ("hit_blocks", "tiered_kv_hit_blocks", "Blocks loaded from the tier into the engine."),
    ("hit_tokens", "tiered_kv_hit_tokens", "Prompt tokens loaded from the tier into the engine."),
    ("loaded_bytes", "tiered_kv_loaded_bytes", "KV bytes restored from the tier into the engine."),
    ("stored_blocks", "tiered_kv_stored_blocks", "Blocks written into the tier."),
    ("stored_bytes", "tiered_kv_stored_bytes", "Bytes written into the tier (disk: records)."),
    ("evictions", "tiered_kv_evictions", "Blocks the tier evicted to stay within its budget."),
    ("dropped", "tiered_kv_dropped_stores", "Blocks not stored (queue full, no room, shutdown)."),
    ("corrupt", "tiered_kv_corrupt_records", "Records that failed verification; never served."),
    ("load_failures", "tiered_kv_load_failures", "Loads that failed in the tier (recomputed)."),
)
_GAUGES = (
    ("bytes_used", "tiered_kv_used_bytes", "Bytes held by the tier."),
    ("capacity_bytes", "tiered_kv_capacity_bytes", "The tier's byte budget."),
    ("entries", "tiered_kv_entries", "Blocks held by the tier."),
    ("queued_blocks", "tiered_kv_queued_blocks", "Blocks waiting for the disk writer."),
    ("queued_bytes", "tiered_kv_queued_bytes", "Bytes waiting for the disk writer."),
)


class _Collector:
    """Builds the counter and gauge families from a snapshot at scrape time."""

    def __init__(self, metrics: TierMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        snapshot = self._metrics.snapshot()
        for field, name, doc in _COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["tier"])
            for tier, row in snapshot.items():
                if field in row:
                    family.add_metric([tier], row[field])
            yield family
        for field, name, doc in _GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["tier"])
            for tier, row in snapshot.items():
                if field in row:
                    family.add_metric([tier], row[field])
            yield family
