"""``tiered-kv serve``'s configuration: one frozen dataclass, the single source of every setting.

Each field is declared with :func:`~tiered_kv.serve_option.option`: its type, default, help,
help panel, vLLM's aliases and choices. The CLI (``serve_cli``), the environment and YAML
loading (:meth:`ServeConfig.load`, in ``serve_sources``) and the tables of
docs/configuration.md and docs/compatibility.md (``serve_docs``) are generated from these
fields, so a new field is a new flag, environment variable, YAML key and docs row.

A value comes from, first to last: a command-line flag, a ``TIERED_KV_<FIELD>`` environment
variable, another environment variable the field names (``VLLM_CPU_KVCACHE_SPACE``,
``HF_HOME``...), a key of the YAML ``--config`` file, the default. Invalid values raise
``ValueError`` naming the flag (the checks are in ``serve_checks``); the CLI turns that into
one line and exit code 2. :meth:`ServeConfig.engine_config` and :meth:`ServeConfig.tier_config`
build the engine's and the tiers' configs (``serve_conversions``).
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

from engine.config import DTYPES, KV_CACHE_DTYPES, SCHEDULING_POLICIES, EngineConfig
from tiered_kv.config import GiB, MiB, OFFLOAD_MODES, REMOTE_WRITE_POLICIES, WRITE_POLICIES, TierConfig
from tiered_kv import serve_conversions
from tiered_kv.serve_checks import check
from tiered_kv.serve_option import ENGINE, SERVER, TIERS, EnvAlias, Setting, option, settings_of
from tiered_kv.serve_sources import merge

ENV_PREFIX = "TIERED_KV_"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _gib_to_bytes(text: str) -> int | None:
    gib = float(text)
    if not gib > 0:
        return None  # 0: the default, as vLLM reads it
    if math.isinf(gib * GiB):
        raise ValueError("too large")
    return int(gib * GiB)


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """Everything ``tiered-kv serve`` can be told. Field ``x_y`` is flag ``--x-y``, environment
    variable ``TIERED_KV_X_Y`` and YAML key ``x_y`` (or ``x-y``). See docs/configuration.md."""

    # the model and the HTTP server
    model: str = option(
        "tiny", "The model: a checkpoint folder (Hugging Face layout: config.json, safetensors, "
        "tokenizer), a Hugging Face id (org/name) already in the local Hugging Face cache, or "
        "`tiny`, the built-in random test model. Also the first positional argument, as in "
        "`vllm serve MODEL`.", ENGINE,
        vllm_note="never downloads: an id must already be in the Hugging Face cache",
    )
    tokenizer: str | None = option(
        None, "Where to read the tokenizer from instead of the model: a folder with "
        "tokenizer.json (and tokenizer_config.json), or a Hugging Face id in the local cache.",
        ENGINE, default_text="the model's",
    )
    revision: str | None = option(
        None, "The snapshot of a Hugging Face id to use: a branch or tag the cache has a ref for, "
        "or a commit hash.", ENGINE, default_text="main",
    )
    download_dir: str | None = option(
        None, "The Hugging Face hub cache that model ids are looked up in (hub layout: "
        "models--org--name/snapshots/REV/).", ENGINE,
        default_text="$HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub",
        env=(
            EnvAlias("HF_HUB_CACHE", str, "the hub cache"),
            EnvAlias("HF_HOME", lambda home: os.path.join(home, "hub"), "its hub/ folder"),
            EnvAlias(
                "XDG_CACHE_HOME", lambda cache: os.path.join(cache, "huggingface", "hub"),
                "its huggingface/hub/ folder",
            ),
        ),
        vllm_note="only read from, never downloaded into",
    )
    served_model_name: tuple[str, ...] = option(
        (), "The model's names in the API, one or more (`--served-model-name a b`): a request's "
        "`model` may be any of them, /v1/models lists them all, and the first names the model "
        "in responses and metrics.", SERVER, default_text="the value of --model", parse="values",
        metavar="NAME...",
    )
    host: str = option(
        "127.0.0.1", "Address to listen on; 0.0.0.0 for every interface (containers).", SERVER,
        vllm_note="vLLM listens on every interface by default; this server on loopback",
    )
    port: int = option(8000, "TCP port to listen on.", SERVER)
    api_key: tuple[str, ...] = option(
        (), "Require `Authorization: Bearer KEY`, KEY one of these keys (`--api-key k1 k2`), on "
        "every route but /health, /ping, /version, /metrics (open, as vLLM's) and /admin/* "
        "(--admin-api-key). Prefer the environment variable: flags show in `ps`.", SERVER, default_text="none", parse="values",
        metavar="KEY...", env=(EnvAlias("VLLM_API_KEY", lambda key: (key,) if key else None, "one key; empty: none"),),
    )
    admin_api_key: str | None = option(
        None, "The key of the /admin/* routes, which exist only with it (404 otherwise); the "
        "inference key is not accepted there.", SERVER, vllm=False,
    )
    max_queue_len: int = option(
        256, "Requests that may wait beyond the --max-num-seqs running ones; further requests "
        "get 429 with Retry-After.", SERVER, vllm=False,
    )
    max_request_body_mib: float = option(
        8.0, "Largest request body in MiB (a float); a larger one gets 413.", SERVER, vllm=False,
    )
    disable_uvicorn_access_log: bool = option(
        False, "Leave out uvicorn's access log (a line per HTTP request).", SERVER,
    )
    log_level: str = option(
        "info", "The server's and uvicorn's log level.", SERVER, choices=LOG_LEVELS,
        vllm=False,
    )
    allowed_origins: tuple[str, ...] = option(
        (), "CORS: origins a browser page may call the API from, as a JSON list or "
        "comma-separated (`*`: any). None: browsers refuse cross-origin calls.", SERVER,
        default_text="none",
        vllm_note="vLLM allows every origin by default; this server none until told",
    )
    allowed_methods: tuple[str, ...] = option(
        ("*",), "CORS: the methods allowed cross-origin (with --allowed-origins).", SERVER,
    )
    allowed_headers: tuple[str, ...] = option(
        ("*",), "CORS: the request headers allowed cross-origin (with --allowed-origins).", SERVER,
    )
    allow_credentials: bool = option(
        False, "CORS: allow cookies and credentials cross-origin (with --allowed-origins).", SERVER,
    )
    chat_template: str | None = option(
        None, "The chat template, replacing the tokenizer's: a file, or the Jinja template "
        "itself.", SERVER, default_text="the model's",
    )
    generation_config: str = option(
        "auto", "Default sampling parameters: `auto` (the model's generation_config.json), "
        "`vllm` (vLLM's defaults) or a folder holding a generation_config.json.", SERVER,
    )
    max_logprobs: int = option(
        20, "The most logprobs a request may ask for (completions' `logprobs`, chat's "
        "`top_logprobs`, `prompt_logprobs`); -1: the vocabulary's size.", SERVER,
    )
    override_generation_config: str | None = option(
        None, "A JSON object of generation_config.json keys (`temperature`, `top_p`, `top_k`, "
        "`min_p`, `repetition_penalty`, `max_new_tokens`) set on top of --generation-config's "
        "defaults, e.g. '{\"temperature\": 0.5}'.", SERVER, metavar="JSON",
    )
    # the engine (vLLM's names)
    device: str = option(
        "auto", "Where the model and its KV pool live: `auto` (the GPU if there is one), "
        "`cpu`, `cuda` or `cuda:N`.", ENGINE,
    )
    dtype: str = option(
        "auto", "Weights and activations: `auto` (float32 on the CPU, the checkpoint's dtype on "
        "a GPU) or a floating-point type.", ENGINE, choices=("auto", *DTYPES),
    )
    max_model_len: int | None = option(
        None, "Prompt plus output, in tokens (8k = 8000, 8K = 8192); longer prompts get 400. "
        "`auto` or -1: the default.", ENGINE, parse="human_int_or_auto",
        default_text="the model's, at most 4096",
        vllm_note="`auto` is the model's length capped at 4096, not sized from free memory",
    )
    max_num_seqs: int = option(64, "Sequences the engine runs at once.", ENGINE)
    max_num_batched_tokens: int | None = option(
        None, "Tokens per engine step (8k = 8000); longer prompts are prefilled in chunks.",
        ENGINE, parse="human_int", default_text="2048",
    )
    enable_chunked_prefill: bool = option(
        True, "Prefill long prompts in chunks of --max-num-batched-tokens, between decode "
        "steps. Off: a whole prompt in one step.", ENGINE,
    )
    block_size: int = option(
        16, "Tokens per KV block (a power of two); part of the KV namespace, so a new block "
        "size starts a new cache.", ENGINE,
    )
    gpu_memory_utilization: float = option(
        0.9, "Fraction of the GPU the engine may use (sizes its KV pool).", ENGINE,
    )
    num_gpu_blocks_override: int | None = option(
        None, "Exact number of blocks in the engine's pool, on any device.", ENGINE,
        default_text="sized from memory",
    )
    cpu_kv_cache_bytes: int = option(
        256 * MiB, "Bytes of the engine's own KV pool when it runs on the CPU (no GPU), with "
        "vLLM's suffixes: 1g = 10^9, 1G = 2^30.", ENGINE, parse="human_int",
        metavar="BYTES", default_text="256M (256 MiB)",
        env=(EnvAlias("VLLM_CPU_KVCACHE_SPACE", _gib_to_bytes, "GiB"),),
        vllm=False,
    )
    kv_cache_dtype: str = option(
        "auto", "`auto` (the model's dtype) or `fp8` (float8 e4m3, calibrated scales; "
        "`fp8_e4m3` is the same).", ENGINE, choices=KV_CACHE_DTYPES,
        value_aliases={"fp8_e4m3": "fp8"},
        refused_values={"fp8_e5m2": "the engine stores fp8 KV as e4m3 with calibrated scales; "
                                    "use fp8 (or fp8_e4m3)"},
    )
    enable_prefix_caching: bool = option(
        True, "Reuse blocks of earlier requests with the same prefix in the engine's pool.",
        ENGINE, default_text="on",
    )
    enforce_eager: bool = option(
        False, "Run decode eagerly; without it decode runs under CUDA graphs on a GPU.", ENGINE,
        default_text="off",
    )
    async_scheduling: bool | None = option(
        None, "Queue each decode step's forward before the last step's tokens reach the host, "
        "so that the GPU does not wait on the host between steps; outputs are unchanged.",
        ENGINE, default_text="on with CUDA graphs",
    )
    scheduling_policy: str = option(
        "fcfs", "`fcfs`: first come, first served; `priority`: by the requests' `priority` "
        "(lower first).", ENGINE, choices=SCHEDULING_POLICIES,
    )
    seed: int = option(0, "Seeds the sampling of requests that send no seed.", ENGINE)
    kv_events_config: str | None = option(
        None, "Publish what the block pool caches and evicts for KV-aware routers: vLLM's JSON, "
        "e.g. `{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\"}` "
        "(docs/scale_out.md).", ENGINE, metavar="JSON", default_text="off",
    )
    speculative_config: str | None = option(
        None, "Speculative decoding: vLLM's JSON, `{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}` or `{\"model\": \"/path/to/draft\", "
        "\"num_speculative_tokens\": 4}` (docs/engine.md#speculative-decoding).", ENGINE,
        metavar="JSON", default_text="off",
    )
    tensor_parallel_size: int = option(
        1, "Only 1: one device per server.", ENGINE, aliases=("-tp",),
        vllm_note="1 only",
    )
    pipeline_parallel_size: int = option(
        1, "Only 1: one device per server.", ENGINE, aliases=("-pp",), vllm_note="1 only",
    )
    # the tiers below the GPU pool
    kv_cache_dir: str = option(
        "./kv_cache", "The disk tier's directory (LMDB, created 0700 if missing); its KV "
        "survives restarts. One server writes a directory at a time.", TIERS, vllm=False,
    )
    kv_offloading_size: float = option(
        1.0, "GiB of host memory for the CPU pool (a float; reserved at start, pinned with "
        "CUDA); 0: no CPU pool.", TIERS,
        vllm_note="the pool is tiered-kv's own, under the disk and remote tiers",
    )
    kv_disk_size: float = option(
        8.0, "GiB budget of the disk tier in encoded bytes, evicted by priority, chains from "
        "their end, LRU by last access; 0: no disk tier.", TIERS, vllm=False,
    )
    kv_codec: str = option(
        "raw", "Encoding of the offloaded KV: raw, zstd[:LEVEL] (lossless, on disk and "
        "remote), kivi2, kivi4, kivi2+zstd, kivi4+zstd (lossy, opt-in, kept in their own "
        "namespace; KIVI quantizes on the engine's device, so the CPU pool holds the smaller "
        "blocks too).", TIERS, vllm=False,
    )
    kv_write_policy: str = option(
        "write-through", "write-through: every new block goes to the CPU pool and is queued for "
        "disk at once; write-back: to disk only when the CPU pool evicts it, and at shutdown "
        "(needs a CPU pool).", TIERS, choices=WRITE_POLICIES, vllm=False,
    )
    kv_offload: str = option(
        "prompt", "Which blocks go down: prompt (blocks made of prompt tokens) or all (also "
        "blocks holding generated tokens).", TIERS, choices=OFFLOAD_MODES, vllm=False,
    )
    kv_remote_url: str | None = option(
        None, "The shared remote tier, a Valkey/Redis server: redis://, valkey://, or with "
        "TLS rediss://, valkeys://; credentials in the URL (redis://user:PASSWORD@host:6379/0). "
        "A cluster: any node's URL with `?cluster=1` (docs/scale_out.md).",
        TIERS, vllm=False,
    )
    kv_remote_write_policy: str = option(
        "write-through", "write-through: every new block is also queued for the remote tier; "
        "read-only: only use what other servers stored.", TIERS,
        choices=REMOTE_WRITE_POLICIES, vllm=False,
    )
    kv_remote_timeout: float = option(
        0.1, "Seconds: the deadline of each remote call as a whole, plus one second per 64 MiB "
        "the call moves; after 3 failures in a row the tier is skipped for 5 s.", TIERS,
        vllm=False,
    )
    kv_remote_ttl: int | None = option(
        None, "Expire remote blocks after this many seconds.", TIERS, vllm=False,
        default_text="never; the server's maxmemory-policy evicts",
    )
    kv_secret_file: str | None = option(
        None, "A file holding the deployment's shared secret, which seals the remote tier's "
        "records (docs/security.md).", TIERS, vllm=False,
    )
    tenant_priorities: str | None = option(
        None, "A YAML or JSON file mapping tenants (a request's `cache_salt`) to priorities "
        "(lower is kept longer): when the CPU pool or the disk tier must evict, the blocks of "
        "the highest value go first (docs/tiers.md).", TIERS, vllm=False, metavar="FILE",
        default_text="every tenant 0",
    )
    secret: str | None = option(
        None, "The deployment's shared secret itself (instead of --kv-secret-file); never a "
        "flag, never logged.", TIERS, flag=False, vllm=False,
    )

    def __post_init__(self) -> None:
        check(self, SETTINGS)

    @property
    def model_name(self) -> str:
        """The model's name in responses and metrics: the first ``--served-model-name``,
        else ``--model``."""
        return self.served_model_name[0] if self.served_model_name else self.model

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request's ``model`` may give."""
        return self.served_model_name or (self.model,)

    @property
    def max_inflight(self) -> int:
        """Requests the server holds at once: the running ones plus the waiting queue."""
        return self.max_num_seqs + self.max_queue_len

    @property
    def max_request_body_bytes(self) -> int:
        """Larger request bodies get 413."""
        return int(self.max_request_body_mib * MiB)

    def engine_kwargs(self) -> dict[str, Any]:
        """The :class:`engine.EngineConfig` fields (without ``model``)."""
        return serve_conversions.engine_kwargs(self)

    def engine_config(self) -> EngineConfig:
        return serve_conversions.engine_config(self)

    def tier_config(self) -> TierConfig | None:
        """The tiers, or ``None`` when both sizes are 0 and there is no remote tier (GPU
        prefix caching only)."""
        return serve_conversions.tier_config(self)

    @classmethod
    def load(
        cls,
        flags: Mapping[str, Any] | None = None,
        *,
        config_file: str | os.PathLike[str] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> ServeConfig:
        """Merge flags (``None`` values count as not given) over the environment over the
        YAML file (``config_file``, else ``TIERED_KV_CONFIG``) over the defaults."""
        environ = os.environ if environ is None else environ
        try:
            return cls(**merge(SETTINGS, flags or {}, config_file, environ))
        except ValueError as e:  # one line, as the CLI prints it: a path may hold a line break
            raise ValueError(" ".join(str(e).splitlines())) from None


SETTINGS: tuple[Setting, ...] = settings_of(ServeConfig)

