"""The tier manager's configuration: one frozen dataclass, validated on construction."""
from __future__ import annotations

import dataclasses
import os
import reprlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from storage.codecs import get_codec
from storage.remote_store import parse_remote_url
from storage.seal import SealKey, load_key_file
from tiered_kv.units import finite

GiB = 1 << 30
MiB = 1 << 20
WRITE_POLICIES = ("write-through", "write-back")
OFFLOAD_MODES = ("prompt", "all")
REMOTE_WRITE_POLICIES = ("write-through", "read-only")


@dataclasses.dataclass(frozen=True)
class TierConfig:
    """Which tiers exist under the engine's block pool and how blocks move between them.

    ``kv_cache_dir``: the disk tier's directory (an LMDB store); ``None``: no disk tier.
    ``cpu_bytes``: the host-memory pool's budget; ``0``: no CPU tier.
    ``disk_bytes``: the disk tier's budget (encoded record bytes).
    ``codec``: how blocks are encoded on disk (``raw``, ``zstd``, ``kivi2``, ``kivi4``,
    ``kivi4+zstd``...; see ``docs/codecs.md``). Lossy codecs are kept apart from lossless
    records: see ``docs/tiers.md``.
    ``write_policy``: ``write-through`` stores every offered block in the CPU pool and queues
    it for disk at once; ``write-back`` writes a block to disk only when the CPU pool evicts
    it (and the pool's remaining blocks at :meth:`~tiered_kv.TierManager.close`).
    ``offload``: ``prompt`` keeps blocks made only of prompt tokens; ``all`` also keeps
    blocks that contain generated tokens.
    ``staging_bytes``: without a CPU tier (``cpu_bytes=0``), the pinned buffer that holds
    blocks until the disk and remote writers have them (with a CPU tier, the CPU pool is
    that buffer). A block is dropped (counted) only when the buffer is full of blocks not
    yet written.
    ``flush_timeout_s``: how long :meth:`~tiered_kv.TierManager.close` may take to write
    what is queued.
    ``sync``: fsync every LMDB commit (``False``: only flush and close fsync).
    ``remote_url``: the shared remote tier, a Valkey/Redis server (``redis://``,
    ``rediss://``, ``valkey://``, ``valkeys://``), or a cluster with ``?cluster=1`` (any
    node's URL; see ``storage.remote_client``); ``None``: no remote tier.
    ``remote_write_policy``: ``write-through`` queues every stored block for the remote
    tier too (from its own writer thread); ``read-only`` only reads what others stored.
    ``remote_timeout_s``: the deadline of each remote call as a whole (connect, send, reply).
    ``remote_ttl_s``: expire remote keys after this many seconds (``None``: the server's
    ``maxmemory-policy`` alone decides what goes).
    ``remote_prefix``: the prefix of this deployment's keys on the server.
    ``remote_secret_file``: a file holding the deployment's shared secret, which seals the
    remote tier's records; ``remote_secret``: the same secret given directly (the
    ``TIERED_KV_SECRET`` environment variable). See docs/security.md.
    ``tenant_priorities``: tenant (a request's ``cache_salt``) -> priority. When the CPU
    pool or the disk tier must evict, the blocks of the highest value go first (a lower
    value matters more, as a request's priority does); unlisted tenants and requests
    without a salt have 0. See :func:`load_tenant_priorities` and docs/tiers.md.
    """

    kv_cache_dir: str | os.PathLike[str] | None = None
    cpu_bytes: int = 1 * GiB
    disk_bytes: int = 8 * GiB
    codec: str = "raw"
    write_policy: str = "write-through"
    offload: str = "prompt"
    staging_bytes: int = 256 * MiB
    flush_timeout_s: float = 30.0
    sync: bool = True
    remote_url: str | None = None
    remote_write_policy: str = "write-through"
    remote_timeout_s: float = 0.1
    remote_ttl_s: int | None = None
    remote_prefix: str = "tkv:"
    remote_secret_file: str | os.PathLike[str] | None = None
    remote_secret: str | None = dataclasses.field(default=None, repr=False)
    tenant_priorities: Mapping[str, int] = dataclasses.field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.kv_cache_dir is not None and not isinstance(self.kv_cache_dir, (str, os.PathLike)):
            raise ValueError(f"kv_cache_dir must be a path or None, got {self.kv_cache_dir!r}")
        if self.kv_cache_dir is not None and not os.fspath(self.kv_cache_dir):
            raise ValueError("kv_cache_dir must not be empty (None means no disk tier)")
        _int("cpu_bytes", self.cpu_bytes, minimum=0)
        _int("disk_bytes", self.disk_bytes, minimum=1)
        _int("staging_bytes", self.staging_bytes, minimum=1)
        try:
            get_codec(self.codec)
        except ValueError as e:  # it names the valid specs
            raise ValueError(f"codec is not usable: {e}") from None
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"write_policy must be one of {', '.join(WRITE_POLICIES)}, "
                f"got {self.write_policy!r}"
            )
        if self.offload not in OFFLOAD_MODES:
            raise ValueError(
                f"offload must be one of {', '.join(OFFLOAD_MODES)}, got {self.offload!r}"
            )
        timeout = self.flush_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
            finite(timeout) and timeout >= 0
        ):
            raise ValueError(f"flush_timeout_s must be a finite number >= 0, got {timeout!r}")
        if not isinstance(self.sync, bool):
            raise ValueError(f"sync must be True or False, got {self.sync!r}")
        if self.remote_url is not None:
            try:
                parse_remote_url(self.remote_url)
            except ValueError as e:
                raise ValueError(f"remote_url is not usable: {e}") from None
        if self.remote_write_policy not in REMOTE_WRITE_POLICIES:
            raise ValueError(
                f"remote_write_policy must be one of {', '.join(REMOTE_WRITE_POLICIES)}, "
                f"got {self.remote_write_policy!r}"
            )
        rt = self.remote_timeout_s
        if isinstance(rt, bool) or not isinstance(rt, (int, float)) or not (
            finite(rt) and rt > 0
        ):
            raise ValueError(f"remote_timeout_s must be a finite number > 0, got {rt!r}")
        if self.remote_ttl_s is not None:
            _int("remote_ttl_s", self.remote_ttl_s, minimum=1)
        if not isinstance(self.remote_prefix, str) or not self.remote_prefix:
            raise ValueError(f"remote_prefix must be a non-empty string, got {self.remote_prefix!r}")
        _check_tenant_priorities(self.tenant_priorities)
        if not self.has_cpu and not self.has_disk and not self.has_remote:
            raise ValueError(
                "no tier configured: set cpu_bytes > 0, kv_cache_dir, remote_url, or several"
            )
        if self.write_policy == "write-back" and self.has_disk and not self.has_cpu:
            raise ValueError(
                "write_policy write-back writes blocks to disk when the CPU pool evicts them; "
                "it needs a CPU pool (cpu_bytes > 0)"  # the field first: serve names its flag
            )

    @property
    def has_cpu(self) -> bool:
        return self.cpu_bytes > 0

    @property
    def has_disk(self) -> bool:
        return self.kv_cache_dir is not None

    @property
    def has_remote(self) -> bool:
        return self.remote_url is not None

    @property
    def cache_path(self) -> Path | None:
        return None if self.kv_cache_dir is None else Path(self.kv_cache_dir)

    def tenant_priority(self, cache_salt: str | None) -> int:
        """The eviction priority of a request's blocks (0 for an unlisted tenant)."""
        return self.tenant_priorities.get(cache_salt, 0) if cache_salt else 0

    def tenant_priorities_of(self, cache_salts: Sequence[str | None]) -> list[int]:
        """:meth:`tenant_priority` of each of ``cache_salts`` (a save's blocks)."""
        priorities = self.tenant_priorities
        if not priorities:
            return [0] * len(cache_salts)
        return [priorities.get(salt, 0) if salt else 0 for salt in cache_salts]


def load_tenant_priorities(path: str | os.PathLike[str]) -> dict[str, int]:
    """Read a tenant -> priority mapping from a YAML (or JSON) file: one ``tenant: priority``
    per line, e.g. ``gold: -10`` and ``batch: 10``. Raises ``ValueError`` naming the file
    for one that cannot be read or does not hold such a mapping."""
    try:
        data = read_yaml(path)
    except ValueError as e:
        raise ValueError(f"cannot read the tenant priorities {os.fspath(path)}: {e}") from None
    try:
        _check_tenant_priorities(data if data is not None else {})
    except ValueError as e:
        raise ValueError(f"{os.fspath(path)}: {e}") from None
    return dict(data or {})


def read_yaml(path: str | os.PathLike[str]) -> object:
    """The one document of the YAML (or JSON) file ``path``. ``ValueError``, its reason in one
    line, if it cannot be read (not UTF-8 included) or parsed (nested too deeply included)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(e.strerror or str(e)) from None
    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, ValueError) as e:  # ValueError: a tagged value, `!!int x`
        raise ValueError(f"not valid YAML: {' '.join(str(e).split())}") from None
    except RecursionError:
        raise ValueError("not valid YAML: nested too deeply") from None


def remote_seal_key(config: TierConfig) -> SealKey:
    """The key of the deployment's shared secret, which seals the remote tier's records.

    ``ValueError`` (one line, naming the setting, never the secret) if it is missing, given
    twice, unreadable or too short.
    """
    if config.remote_secret_file is not None and config.remote_secret is not None:
        raise ValueError(
            "the remote tier's secret is given twice (--kv-secret-file and TIERED_KV_SECRET); "
            "give one"
        )
    if config.remote_secret_file is not None:
        return load_key_file(config.remote_secret_file)
    if config.remote_secret is not None:
        return SealKey(config.remote_secret.encode("utf-8"), source="TIERED_KV_SECRET")
    raise ValueError(
        "the remote tier (--kv-remote-url) needs the deployment's shared secret, which seals "
        "its records: give every instance the same one with --kv-secret-file FILE or "
        "TIERED_KV_SECRET (at least 32 bytes, e.g. `openssl rand -hex 32`)"
    )


def _check_tenant_priorities(priorities: object) -> None:
    if not isinstance(priorities, Mapping):
        raise ValueError(
            f"tenant_priorities must map tenants to integers, got {type(priorities).__name__}"
        )
    for tenant, priority in priorities.items():
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"a tenant must be a non-empty string (a cache_salt), got {_shown(tenant)}")
        if isinstance(priority, bool) or not isinstance(priority, int) or not (
            -(2**63) <= priority < 2**63
        ):
            raise ValueError(
                f"tenant {_shown(tenant)}: the priority must be an integer, got {_shown(priority)}"
            )


def _shown(value: object) -> str:
    """``repr(value)``, cut short: through its aliases a few lines of YAML can hold a list of
    billions of items."""
    return _SHORT.repr(value)


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 2, 60, 60


def _int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
