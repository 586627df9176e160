"""What the admin routes do: report the tiers, and delete a namespace's blocks from them.

They run on a worker thread (the stores block); the engine's own block pool is not touched.
"""
from __future__ import annotations

from typing import Any

from storage.base import BlockKey
from storage.remote_store import redact_url
from tiered_kv.server_state import ServerState


def namespace_hex(state: ServerState, namespace: str | None) -> str | None:
    if namespace is not None:
        return namespace.lower()
    return state.manager.namespace.hex() if state.manager is not None else None


def evict(state: ServerState, tiers: tuple[str, ...], namespace: str | None) -> dict[str, int]:
    """Delete ``namespace``'s blocks (default: the server's own) from ``tiers``.

    The engine's own prefix cache is not touched. A block being loaded concurrently simply
    misses (the engine recomputes it)."""
    manager = state.manager
    if manager is None:
        return {}
    target = bytes.fromhex(namespace) if namespace is not None else manager.namespace
    stores = manager.stores()
    evicted: dict[str, int] = {}
    for tier in tiers:
        store = stores.get(tier)
        if store is None:
            continue
        keys: list[BlockKey] = list(store.keys(target))
        if tier == "disk":
            evicted[tier] = store.delete_many(keys)
        else:
            evicted[tier] = sum(store.delete(key) for key in keys)
    return evicted


def clear(state: ServerState, namespace: str | None) -> dict[str, int]:
    """Flush the disk writer first (blocks still queued would come back), then evict the
    namespace from the CPU pool and the disk."""
    manager = state.manager
    if manager is not None:
        manager.flush(manager.config.flush_timeout_s)
    return evict(state, ("cpu", "disk"), namespace)


def tier_report(state: ServerState) -> dict[str, Any]:
    s = state.llm.stats()
    engine = {
        "num_blocks": s.num_blocks,
        "num_used_blocks": s.num_used_blocks,
        "num_cached_blocks": s.num_cached_blocks,
        "kv_usage": s.kv_usage,
        "num_running": s.num_running,
        "num_waiting": s.num_waiting,
        "prefix_cache_queries": s.prefix_cache_queries,
        "prefix_cache_hits": s.prefix_cache_hits,
        "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
        "connector_hits": s.connector_hits,
        "connector_load_failures": s.connector_load_failures,
        "connector_overlapped_loads": s.connector_overlapped_loads,
        "connector_overlap_tokens": s.connector_overlap_tokens,
        "num_preemptions": s.num_preemptions,
        "num_prompt_tokens": s.num_prompt_tokens,
        "num_generated_tokens": s.num_generated_tokens,
        "num_finished_requests": s.num_finished_requests,
    }
    manager = state.manager
    return {
        "model": state.config.model_name,
        "namespace": manager.namespace.hex() if manager is not None else None,
        "kv_cache_dir": manager.config.kv_cache_dir if manager is not None else None,
        "kv_remote_url": (
            redact_url(manager.config.remote_url)
            if manager is not None and manager.config.remote_url is not None else None
        ),
        "tiers": manager.stats() if manager is not None else {},
        "engine": engine,
        "server": {"inflight": state.inflight, "max_inflight": state.config.max_inflight},
    }
