"""A :class:`~tiered_kv.serve_config.ServeConfig` turned into the engine's and the tiers' configs.

The JSON settings (``--kv-events-config``, ``--speculative-config``) and the file of
``--tenant-priorities`` are read here; their errors are ``ValueError`` s that name the flag.
The tiers' sizes are in GiB as floats in the settings and in bytes in :class:`TierConfig`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from engine.config import EngineConfig
from engine.kv_events import KVEventsConfig
from engine.spec_decode import SpeculativeConfig
from tiered_kv.config import GiB, TierConfig, load_tenant_priorities

if TYPE_CHECKING:
    from tiered_kv.serve_config import ServeConfig

T = TypeVar("T")


def engine_kwargs(config: ServeConfig) -> dict[str, Any]:
    """The :class:`engine.EngineConfig` fields (without ``model``)."""
    return dict(
        device=config.device,
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        enable_chunked_prefill=config.enable_chunked_prefill,
        block_size=config.block_size,
        gpu_memory_utilization=config.gpu_memory_utilization,
        num_gpu_blocks_override=config.num_gpu_blocks_override,
        cpu_kv_cache_bytes=config.cpu_kv_cache_bytes,
        kv_cache_dtype=config.kv_cache_dtype,
        enable_prefix_caching=config.enable_prefix_caching,
        enforce_eager=config.enforce_eager,
        async_scheduling=config.async_scheduling,
        scheduling_policy=config.scheduling_policy,
        seed=config.seed,
        kv_events_config=_kv_events(config),
        speculative_config=_speculative(config),
    )


def engine_config(config: ServeConfig) -> EngineConfig:
    return EngineConfig(model=config.model, **engine_kwargs(config))


def tier_config(config: ServeConfig) -> TierConfig | None:
    """The tiers, or ``None`` when both sizes are 0 and there is no remote tier (GPU
    prefix caching only).

    ``--kv-disk-size 0`` turns the disk tier off, ``--kv-offloading-size 0`` the CPU pool;
    ``--kv-remote-url`` adds the shared remote tier.
    """
    cpu_bytes = int(config.kv_offloading_size * GiB)
    disk_bytes = int(config.kv_disk_size * GiB)
    if not cpu_bytes and not disk_bytes and config.kv_remote_url is None:
        return None
    return TierConfig(
        kv_cache_dir=config.kv_cache_dir if disk_bytes else None,
        cpu_bytes=cpu_bytes,
        disk_bytes=max(disk_bytes, 1),
        codec=config.kv_codec,
        write_policy=config.kv_write_policy,
        offload=config.kv_offload,
        remote_url=config.kv_remote_url,
        remote_write_policy=config.kv_remote_write_policy,
        remote_timeout_s=config.kv_remote_timeout,
        remote_ttl_s=config.kv_remote_ttl,
        remote_secret_file=config.kv_secret_file,
        remote_secret=config.secret,
        tenant_priorities=_tenant_priorities(config),
    )


def _kv_events(config: ServeConfig) -> KVEventsConfig | None:
    return _parsed(config.kv_events_config, KVEventsConfig.from_json, "--kv-events-config")


def _speculative(config: ServeConfig) -> SpeculativeConfig | None:
    return _parsed(config.speculative_config, SpeculativeConfig.from_json, "--speculative-config")


def _tenant_priorities(config: ServeConfig) -> dict[str, int]:
    parsed = _parsed(config.tenant_priorities, load_tenant_priorities, "--tenant-priorities")
    return {} if parsed is None else parsed


def _parsed(text: str | None, parse: Callable[[str], T], flag: str) -> T | None:
    """``parse(text)`` (``None`` for no text); its ``TypeError`` or ``ValueError`` becomes a
    ``ValueError`` that names ``flag``."""
    if text is None:
        return None
    try:
        return parse(text)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{flag}: {e}") from None
