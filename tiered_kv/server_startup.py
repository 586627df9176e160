"""What ``tiered-kv serve`` says once the model is loaded, and the ``serving`` line it logs
once requests are accepted.

After loading: the model, its dtype, the device, the KV pool, the tiers (the disk tier with
what it already holds; the remote URL without its password) and the start-up time. Then, once
the app's startup has completed and the socket is served, ``serving <name> on <url>``.
"""
from __future__ import annotations

import logging
import socket
from collections.abc import Callable

import torch
import uvicorn

from engine.async_engine import AsyncLLM
from storage.remote_store import redact_url
from tiered_kv.serve_config import ServeConfig
from tiered_kv.tier_manager import TierManager
from tiered_kv.units import format_size

logger = logging.getLogger(__name__)


def startup_lines(
    config: ServeConfig, llm: AsyncLLM, manager: TierManager | None, seconds: float
) -> list[str]:
    """The lines logged after loading; ``seconds``: how long loading took."""
    engine = llm.engine
    spec = engine.model_runner.spec
    weights = next(engine.model_runner.model.parameters()).dtype
    num_blocks = engine.num_blocks
    block_size = llm.config.block_size
    lines = [
        f"model: {config.model} (served as {config.model_name!r}), dtype {_dtype(weights)}, "
        f"KV cache dtype {_dtype(spec.dtype)}",
        f"device: {device_description(engine.device)}",
        f"KV pool: {num_blocks} blocks of {block_size} tokens ({num_blocks * block_size} tokens), "
        f"{format_size(num_blocks * spec.bytes_per_block)}",
        f"tiers: {tier_summary(manager)}",
        f"started in {seconds:.1f} s",
    ]
    return lines


def device_description(device: torch.device) -> str:
    """``cpu``, or ``cuda:0 (NVIDIA H100 80GB HBM3)``."""
    if device.type != "cuda":
        return str(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


def tier_summary(manager: TierManager | None) -> str:
    """One line: each tier's budget, the disk tier's directory and what it already holds."""
    if manager is None:
        return "none (the KV cache stays in the engine's pool)"
    tier_config = manager.config
    stats = manager.stats()
    parts = []
    if "cpu" in stats:
        parts.append(f"cpu {format_size(tier_config.cpu_bytes)}")
    if "disk" in stats:
        disk = stats["disk"]
        parts.append(
            f"disk {tier_config.kv_cache_dir} ({disk.get('entries', 0)} entries, "
            f"{format_size(int(disk.get('bytes_used', 0)))} already there, budget "
            f"{format_size(tier_config.disk_bytes)}, codec {tier_config.codec})"
        )
    if tier_config.remote_url is not None:
        parts.append(f"remote {redact_url(tier_config.remote_url)}")
    return "; ".join(parts) or "none"


class AnnouncingServer(uvicorn.Server):
    """A uvicorn server that calls ``on_serving`` once its startup has completed: the app's
    lifespan has started and the sockets are served."""

    def __init__(self, config: uvicorn.Config, on_serving: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_serving = on_serving

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit:
            self._on_serving()


def log_serving(model_name: str, host: str, port: int) -> None:
    shown = f"[{host}]" if ":" in host else host
    logger.info("serving %r on http://%s:%d", model_name, shown, port)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
