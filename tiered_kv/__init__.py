"""tiered-kv: the tier manager that gives the engine a CPU and a disk tier under its KV pool.

>>> from tiered_kv import TierConfig, build_llm
>>> llm = build_llm("tiny", TierConfig(kv_cache_dir="./kv_cache"), max_model_len=1024)
>>> manager = llm.engine.connector            # stats(), registry, flush()
"""
from __future__ import annotations

from tiered_kv.config import TierConfig
from tiered_kv.tier_manager import TierManager, build_llm

__all__ = ["TierConfig", "TierManager", "build_llm"]
