"""What one server app holds: its settings, the engine, the tiers, the metrics and the count
of requests in flight. Only the event loop's thread changes it."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from engine.async_engine import AsyncLLM
from tiered_kv.serve_config import ServeConfig
from tiered_kv.server_limits import PromptLimit
from tiered_kv.server_metrics import ServerMetrics
from tiered_kv.tier_manager import TierManager


@dataclass
class ServerState:
    config: ServeConfig
    llm: AsyncLLM
    manager: TierManager | None
    registry: CollectorRegistry
    owns_llm: bool  # shut the engine down (and flush the tiers) with the app
    prompt_limit: PromptLimit
    started: int = field(default_factory=lambda: int(time.time()))
    inflight: int = 0
    metrics: ServerMetrics | None = None  # while the app's lifespan runs
