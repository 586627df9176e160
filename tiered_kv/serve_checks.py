"""The checks :class:`~tiered_kv.serve_config.ServeConfig` runs on construction.

Each setting's own choices, then what its type alone cannot say (non-empty strings, ports,
sizes, one device), then the engine's and the tiers' own checks by building their configs.
Every error is a ``ValueError`` naming the flag (an engine or tier field is renamed to the
flag that sets it); the CLI turns it into one line and exit code 2.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from tiered_kv.config import GiB, MiB
from tiered_kv.generation_defaults import GenerationDefaults, parse_override
from tiered_kv.serve_option import Setting
from tiered_kv.serve_option import flag_name as _flag

if TYPE_CHECKING:
    from tiered_kv.serve_config import ServeConfig

SINGLE_DEVICE = (
    "this server runs the model on one device; run one server per GPU behind a load balancer "
    "(they share KV through --kv-remote-url)"
)


def check(config: ServeConfig, settings: tuple[Setting, ...]) -> None:
    """``ValueError`` naming the flag of the first invalid value of ``config``, whose
    ``settings`` these are. Normalizes ``served_model_name`` and ``api_key`` (one string or
    several) to tuples in place."""
    for setting in settings:
        setting.check_choice(getattr(config, setting.name))
    _str("model", config.model)
    for name in ("served_model_name", "api_key"):  # one value or several
        value = getattr(config, name)
        values = (value,) if isinstance(value, str) else () if value is None else value
        if not isinstance(values, (tuple, list)):
            raise ValueError(f"{_flag(name)} must be one or more strings, got {value!r}")
        object.__setattr__(config, name, tuple(values))
        for v in values:
            _str(name, v)
    for name in ("admin_api_key", "revision", "chat_template", "tokenizer", "override_generation_config"):
        if getattr(config, name) is not None:
            _str(name, getattr(config, name))
    if config.override_generation_config is not None:  # refused now, not after the model loaded
        overrides = parse_override(config.override_generation_config)
        GenerationDefaults.from_dict(overrides, "--override-generation-config")
    _str("host", config.host)
    _str("generation_config", config.generation_config)
    if _bad_int(config.port, 1) or config.port > 65535:
        raise ValueError(f"--port must be an integer in [1, 65535], got {config.port!r}")
    if _bad_int(config.max_logprobs, -1):
        raise ValueError(f"--max-logprobs must be an integer >= -1, got {config.max_logprobs!r}")
    if _bad_int(config.max_queue_len, 0):
        raise ValueError(f"--max-queue-len must be an integer >= 0, got {config.max_queue_len!r}")
    if not (_size(config.max_request_body_mib, MiB) and config.max_request_body_mib > 0):
        raise ValueError(
            f"--max-request-body-mib must be a number of MiB > 0, got {config.max_request_body_mib!r}"
        )
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        value = getattr(config, name)
        if value != 1:
            raise ValueError(f"{_flag(name)} {value}: only 1 is supported: {SINGLE_DEVICE}")
    for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
        value = getattr(config, name)
        if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
            raise ValueError(f"{_flag(name)} must be a list of non-empty strings, got {value!r}")
    for name in ("kv_offloading_size", "kv_disk_size"):
        value = getattr(config, name)
        if not (_size(value, GiB) and value >= 0):
            raise ValueError(f"{_flag(name)} must be a number of GiB >= 0, got {value!r}")
    if not isinstance(config.kv_cache_dir, str):
        raise ValueError(f"--kv-cache-dir must be a path, got {config.kv_cache_dir!r}")
    # The engine's and the tiers' own checks, with their field names mapped to flags.
    for build in (config.engine_config, config.tier_config):
        try:
            build()
        except ValueError as e:
            raise ValueError(_with_flag_names(str(e), settings)) from None


_RENAMED = {  # engine/tier field -> the flag that sets it
    "kv_cache_dir": "--kv-cache-dir",
    "cpu_bytes": "--kv-offloading-size",
    "disk_bytes": "--kv-disk-size",
    "codec": "--kv-codec",
    "write_policy": "--kv-write-policy",
    "offload": "--kv-offload",
    "remote_url": "--kv-remote-url",
    "remote_write_policy": "--kv-remote-write-policy",
    "remote_timeout_s": "--kv-remote-timeout",
    "remote_ttl_s": "--kv-remote-ttl",
    "remote_secret_file": "--kv-secret-file",
}


def _with_flag_names(message: str, settings: tuple[Setting, ...]) -> str:
    head, sep, rest = message.partition(" ")
    if head in _RENAMED:
        return _RENAMED[head] + sep + rest
    if any(s.name == head for s in settings):
        return _flag(head) + sep + rest
    return message


def _bad_int(value: object, minimum: int) -> bool:
    return isinstance(value, bool) or not isinstance(value, int) or value < minimum


def _size(value: object, unit: int) -> bool:
    """A number of ``unit`` s whose count of bytes is finite (an ``int`` of any size is; a
    float as large as 1e308 is not, once multiplied)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, int) or math.isfinite(value * unit)


def _str(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{_flag(name)} must be a non-empty string, got {value!r}")
