"""``tiered-kv``: the command-line entry point.

- ``tiered-kv serve``: the OpenAI-compatible server (docs/server.md, docs/configuration.md)
- ``tiered-kv storage ...``: admin of a KV cache directory
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from tiered_kv.storage_cli import app as storage_app

app = typer.Typer(
    name="tiered-kv",
    help="A paged LLM inference engine with a tiered, persistent KV cache.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(storage_app, name="storage")

_SERVER = "Server"
_ENGINE = "Engine"
_TIERS = "KV tiers"


@app.command()
def serve(
    model: Optional[str] = typer.Option(
        None, help="Checkpoint folder (Hugging Face layout) or 'tiny', the built-in test model. (default: tiny)",
        rich_help_panel=_ENGINE,
    ),
    served_model_name: Optional[str] = typer.Option(
        None, help="Model name in the API (the 'model' field clients send). (default: --model)",
        rich_help_panel=_SERVER,
    ),
    host: Optional[str] = typer.Option(
        None, help="Address to listen on; 0.0.0.0 for every interface. (default: 127.0.0.1)",
        rich_help_panel=_SERVER,
    ),
    port: Optional[int] = typer.Option(None, help="Port to listen on. (default: 8000)", rich_help_panel=_SERVER),
    api_key: Optional[str] = typer.Option(
        None, help="Require 'Authorization: Bearer KEY' on the inference routes (/v1/*). "
        "(default: none)",
        rich_help_panel=_SERVER,
    ),
    admin_api_key: Optional[str] = typer.Option(
        None, help="The key of the /admin/* routes, which are off without it. (default: none)",
        rich_help_panel=_SERVER,
    ),
    max_queue_len: Optional[int] = typer.Option(
        None, help="Requests that may wait beyond --max-num-seqs running ones; more get 429 with "
        "Retry-After. (default: 256)",
        rich_help_panel=_SERVER,
    ),
    max_request_body_mib: Optional[float] = typer.Option(
        None, help="Largest request body in MiB; larger ones get 413. (default: 8)", rich_help_panel=_SERVER
    ),
    log_level: Optional[str] = typer.Option(
        None, help="critical, error, warning, info or debug. (default: info)", rich_help_panel=_SERVER
    ),
    config: Optional[Path] = typer.Option(
        None, help="YAML file of settings (keys as the flags, without '--'); flags and TIERED_KV_* "
        "environment variables override it.",
        rich_help_panel=_SERVER,
    ),
    dtype: Optional[str] = typer.Option(
        None, help="Weights and activations: auto, float32, float16 or bfloat16. (default: auto)",
        rich_help_panel=_ENGINE,
    ),
    max_model_len: Optional[int] = typer.Option(
        None, help="Longest prompt plus output, in tokens. (default: the model's, at most 4096)",
        rich_help_panel=_ENGINE,
    ),
    max_num_seqs: Optional[int] = typer.Option(
        None, help="Sequences the engine runs at once. (default: 64)", rich_help_panel=_ENGINE
    ),
    max_num_batched_tokens: Optional[int] = typer.Option(
        None, help="Tokens per engine step (chunked prefill). (default: 2048)", rich_help_panel=_ENGINE
    ),
    block_size: Optional[int] = typer.Option(
        None, help="Tokens per KV block, a power of two. (default: 16)", rich_help_panel=_ENGINE
    ),
    gpu_memory_utilization: Optional[float] = typer.Option(
        None, help="Fraction of the GPU's memory the engine may use. (default: 0.9)", rich_help_panel=_ENGINE
    ),
    num_gpu_blocks_override: Optional[int] = typer.Option(
        None, help="Exact number of KV blocks in the engine's pool (on any device). [default: sized "
        "from memory]",
        rich_help_panel=_ENGINE,
    ),
    kv_cache_dtype: Optional[str] = typer.Option(
        None, help="auto (the model's dtype) or fp8. (default: auto)", rich_help_panel=_ENGINE
    ),
    enable_prefix_caching: Optional[bool] = typer.Option(
        None, "--enable-prefix-caching/--no-enable-prefix-caching",
        help="Reuse KV blocks of earlier requests with the same prefix. (default: on)",
        rich_help_panel=_ENGINE,
    ),
    seed: Optional[int] = typer.Option(
        None, help="Seed for requests that do not send their own. (default: 0)", rich_help_panel=_ENGINE
    ),
    kv_cache_dir: Optional[str] = typer.Option(
        None, help="Directory of the disk tier (created if missing); its KV survives restarts. "
        "(default: ./kv_cache)",
        rich_help_panel=_TIERS,
    ),
    kv_offloading_size: Optional[float] = typer.Option(
        None, help="GiB of CPU memory for the CPU tier; 0: no CPU tier. (default: 1)", rich_help_panel=_TIERS
    ),
    kv_disk_size: Optional[float] = typer.Option(
        None, help="GiB budget of the disk tier (LRU); 0: no disk tier. (default: 8)", rich_help_panel=_TIERS
    ),
    kv_codec: Optional[str] = typer.Option(
        None, help="Disk encoding: raw, zstd[:LEVEL], kivi2, kivi4, kivi2+zstd, kivi4+zstd (kivi: "
        "lossy). (default: raw)",
        rich_help_panel=_TIERS,
    ),
    kv_write_policy: Optional[str] = typer.Option(
        None, help="write-through (to disk at once) or write-back (when the CPU tier evicts). "
        "(default: write-through)",
        rich_help_panel=_TIERS,
    ),
    kv_offload: Optional[str] = typer.Option(
        None, help="Which blocks go down: prompt (blocks of prompt tokens only) or all (also "
        "generated ones). (default: prompt)",
        rich_help_panel=_TIERS,
    ),
    kv_remote_url: Optional[str] = typer.Option(
        None, help="Shared remote tier: redis://, rediss:// (TLS), valkey:// or valkeys:// URL, "
        "e.g. redis://:PASSWORD@host:6379/0. (default: none)",
        rich_help_panel=_TIERS,
    ),
    kv_remote_write_policy: Optional[str] = typer.Option(
        None, help="write-through (store every saved block remotely too) or read-only. "
        "(default: write-through)",
        rich_help_panel=_TIERS,
    ),
    kv_remote_timeout: Optional[float] = typer.Option(
        None, help="Seconds to connect to or wait for the remote tier per call. (default: 0.1)",
        rich_help_panel=_TIERS,
    ),
    kv_remote_ttl: Optional[int] = typer.Option(
        None, help="Expire remote blocks after this many seconds. (default: never; the server's "
        "maxmemory-policy evicts)",
        rich_help_panel=_TIERS,
    ),
) -> None:
    """Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions) with a
    persistent, tiered KV cache. Each flag can also be set as TIERED_KV_<FLAG> (e.g.
    TIERED_KV_MAX_MODEL_LEN) or as a key of the --config file; flags win over the environment,
    which wins over the file."""
    flags = dict(locals())
    flags.pop("config")
    from storage.base import StoreError
    from tiered_kv import server
    from tiered_kv.serve_config import ServeConfig

    try:
        settings = ServeConfig.load(flags, config_file=config)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    try:
        server.run(settings)
    except StoreError as e:
        typer.echo(f"error: the KV cache directory cannot be used: {e}", err=True)
        raise typer.Exit(1) from None
    except (ValueError, OSError) as e:  # no such model, or the engine refused its settings
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def main() -> None:
    app()
