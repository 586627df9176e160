"""tiered-kv: the tier manager that gives the engine a CPU and a disk tier under its KV pool.

>>> from tiered_kv import TierConfig, build_llm
>>> llm = build_llm("tiny", TierConfig(kv_cache_dir="./kv_cache"), max_model_len=1024)
>>> manager = llm.engine.connector            # stats(), registry, flush()
"""
from __future__ import annotations

from importlib import metadata

from tiered_kv.config import TierConfig
from tiered_kv.tier_manager import TierManager
from tiered_kv.tiered_llm import build_llm

try:
    __version__ = metadata.version("tiered-kv")
except metadata.PackageNotFoundError:  # run from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = ["TierConfig", "TierManager", "__version__", "build_llm"]
