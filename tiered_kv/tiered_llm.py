"""An engine with the tiers under its KV pool: :func:`build_llm`."""
from __future__ import annotations

import os
from typing import Any

from engine.llm import LLM
from tiered_kv.config import TierConfig
from tiered_kv.tier_manager import TierManager


def build_llm(
    model: str | os.PathLike[str] = "tiny",
    tier_config: TierConfig | None = None,
    **engine_config: Any,
) -> LLM:
    """An :class:`engine.LLM` whose KV connector is a new :class:`TierManager`.

    The manager is ``llm.engine.connector``; closing the LLM closes it (and flushes it).
    """
    manager = TierManager(tier_config)
    try:
        return LLM(model, kv_connector=manager, **engine_config)
    except BaseException:
        manager.close()
        raise
