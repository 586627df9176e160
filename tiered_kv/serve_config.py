"""``tiered-kv serve``'s configuration: one frozen dataclass and the one place that reads it.

A value comes from, first to last: a command-line flag, a ``TIERED_KV_<FIELD>`` environment
variable, a key of the YAML ``--config`` file, the default. Every environment variable the
server reads is read here, by :meth:`ServeConfig.load`. Invalid values raise ``ValueError``
naming the flag; the CLI turns that into an error message and exit code 2.
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import yaml

from engine.config import DTYPES, KV_CACHE_DTYPES, EngineConfig
from tiered_kv.config import GiB, MiB, OFFLOAD_MODES, WRITE_POLICIES, TierConfig

ENV_PREFIX = "TIERED_KV_"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """Everything ``tiered-kv serve`` can be told. Field ``x_y`` is flag ``--x-y``, environment
    variable ``TIERED_KV_X_Y`` and YAML key ``x_y`` (or ``x-y``). See docs/configuration.md."""

    # the model and the HTTP server
    model: str = "tiny"
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    admin_api_key: str | None = None
    max_queue_len: int = 256
    max_request_body_mib: float = 8.0
    log_level: str = "info"
    generation_config: str = "auto"
    # the engine (vLLM's names)
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    seed: int = 0
    # the tiers below the GPU pool
    kv_cache_dir: str = "./kv_cache"
    kv_offloading_size: float = 1.0
    kv_disk_size: float = 8.0
    kv_codec: str = "raw"
    kv_write_policy: str = "write-through"
    kv_offload: str = "prompt"
    kv_remote_url: str | None = None
    kv_remote_write_policy: str = "write-through"
    kv_remote_timeout: float = 0.1
    kv_remote_ttl: int | None = None
    kv_secret_file: str | None = None
    secret: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        _str("model", self.model)
        if self.served_model_name is not None:
            _str("served_model_name", self.served_model_name)
        _str("host", self.host)
        if _bad_int(self.port, 1) or self.port > 65535:
            raise ValueError(f"--port must be an integer in [1, 65535], got {self.port!r}")
        if self.api_key is not None:
            _str("api_key", self.api_key)
        if self.admin_api_key is not None:
            _str("admin_api_key", self.admin_api_key)
        if _bad_int(self.max_queue_len, 0):
            raise ValueError(f"--max-queue-len must be an integer >= 0, got {self.max_queue_len!r}")
        if not _positive_number(self.max_request_body_mib):
            raise ValueError(
                f"--max-request-body-mib must be a number of MiB > 0, got {self.max_request_body_mib!r}"
            )
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        for name in ("kv_offloading_size", "kv_disk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value >= 0
            ):
                raise ValueError(f"{_flag(name)} must be a number of GiB >= 0, got {value!r}")
        if not isinstance(self.kv_cache_dir, str):
            raise ValueError(f"--kv-cache-dir must be a path, got {self.kv_cache_dir!r}")
        if self.kv_write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"--kv-write-policy must be one of {', '.join(WRITE_POLICIES)}, got {self.kv_write_policy!r}"
            )
        if self.kv_offload not in OFFLOAD_MODES:
            raise ValueError(f"--kv-offload must be one of {', '.join(OFFLOAD_MODES)}, got {self.kv_offload!r}")
        # The engine's and the tiers' own checks, with their field names mapped to flags.
        for build in (self.engine_config, self.tier_config):
            try:
                build()
            except ValueError as e:
                raise ValueError(_with_flag_names(str(e))) from None

    @property
    def model_name(self) -> str:
        """The name clients use in ``model``: ``--served-model-name``, else ``--model``."""
        return self.served_model_name or self.model

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
        return dict(
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            kv_cache_dtype=self.kv_cache_dtype,
            enable_prefix_caching=self.enable_prefix_caching,
            seed=self.seed,
        )

    def engine_config(self) -> EngineConfig:
        return EngineConfig(model=self.model, **self.engine_kwargs())

    def tier_config(self) -> TierConfig | None:
        """The tiers, or ``None`` when both sizes are 0 and there is no remote tier (GPU
        prefix caching only).

        ``--kv-disk-size 0`` turns the disk tier off, ``--kv-offloading-size 0`` the CPU pool;
        ``--kv-remote-url`` adds the shared remote tier.
        """
        cpu_bytes = int(self.kv_offloading_size * GiB)
        disk_bytes = int(self.kv_disk_size * GiB)
        if not cpu_bytes and not disk_bytes and self.kv_remote_url is None:
            return None
        return TierConfig(
            kv_cache_dir=self.kv_cache_dir if disk_bytes else None,
            cpu_bytes=cpu_bytes,
            disk_bytes=max(disk_bytes, 1),
            codec=self.kv_codec,
            write_policy=self.kv_write_policy,
            offload=self.kv_offload,
            remote_url=self.kv_remote_url,
            remote_write_policy=self.kv_remote_write_policy,
            remote_timeout_s=self.kv_remote_timeout,
            remote_ttl_s=self.kv_remote_ttl,
            remote_secret_file=self.kv_secret_file,
            remote_secret=self.secret,
        )

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
        values: dict[str, Any] = {}
        path = config_file if config_file is not None else environ.get(ENV_PREFIX + "CONFIG")
        if path:
            values.update(_read_yaml(Path(path)))
        for name, parse in _PARSERS.items():
            raw = environ.get(ENV_PREFIX + name.upper())
            if raw is not None:
                try:
                    values[name] = parse(raw)
                except ValueError:
                    raise ValueError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid value") from None
        for name, value in (flags or {}).items():
            if name not in _PARSERS:
                raise ValueError(f"unknown setting {name!r}")
            if value is not None:
                values[name] = value
        return cls(**values)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of settings, got {type(data).__name__}")
    values: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in _PARSERS:
            raise ValueError(f"--config {path}: unknown key {key!r} (known: {', '.join(_PARSERS)})")
        if isinstance(value, str):  # numbers as strings ("8000") are fine, as in the environment
            value = _PARSERS[name](value)
        values[name] = value
    return values


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse_optional(text: str) -> Any:
        return None if text.strip().lower() in ("", "none", "null") else parse(text)

    return parse_optional


def _parser(field: dataclasses.Field) -> Callable[[str], Any]:
    kind = str(field.type)
    base = {"int": int, "float": float, "bool": _parse_bool, "str": str}[kind.split(" ")[0]]
    return _optional(base) if "None" in kind else base


_PARSERS: dict[str, Callable[[str], Any]] = {f.name: _parser(f) for f in dataclasses.fields(ServeConfig)}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


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
}


def _with_flag_names(message: str) -> str:
    head, sep, rest = message.partition(" ")
    if head in _RENAMED:
        return _RENAMED[head] + sep + rest
    if head in _PARSERS:
        return _flag(head) + sep + rest
    return message


def _bad_int(value: object, minimum: int) -> bool:
    return isinstance(value, bool) or not isinstance(value, int) or value < minimum


def _positive_number(value: object) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value) and value > 0


def _str(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{_flag(name)} must be a non-empty string, got {value!r}")
