"""The remote tier's URL: which server or cluster, checked before anything connects.

URLs::

    redis://[user:PASSWORD@]host:6379[/db]        one server (valkey://; TLS: rediss://, valkeys://)
    redis://[user:PASSWORD@]host:6379/?cluster=1  a Valkey/Redis Cluster; host:port: any node

A URL is never shown with its password (:func:`redact_url`): not in logs, not in errors.
"""
from __future__ import annotations

from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

URL_SCHEMES = ("redis", "rediss", "valkey", "valkeys")
CLUSTER_ON = ("1", "true", "yes")
CLUSTER_OFF = ("0", "false", "no")


def parse_remote_url(url: str) -> str:
    """Check a ``redis://``, ``rediss://`` (TLS), ``valkey://`` or ``valkeys://`` (TLS) URL,
    e.g. ``redis://:password@host:6379/0``, or with ``?cluster=1`` a cluster's; returns it
    unchanged. Raises ``ValueError`` with one line (never showing the password)."""
    if not isinstance(url, str):
        raise ValueError(f"remote URL must be a string, got {url!r}")  # noqa: TRY004 - config
    parts = urlsplit(url)
    if parts.scheme not in URL_SCHEMES:
        raise ValueError(
            f"remote URL must start with one of {', '.join(s + '://' for s in URL_SCHEMES)}, "
            f"got {redact_url(url)!r}"
        )
    if not parts.hostname:
        raise ValueError(f"remote URL has no host: {redact_url(url)!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ValueError(f"remote URL has an invalid port: {redact_url(url)!r}") from None
    if is_cluster_url(url) and parts.path.strip("/") not in ("", "0"):
        raise ValueError(
            f"a cluster has only database 0; drop {parts.path!r} from {redact_url(url)!r}"
        )
    return url


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` asks for a Valkey/Redis Cluster (``?cluster=1``, ``true`` or ``yes``).
    Raises ``ValueError`` for any other value of ``cluster``."""
    values = parse_qs(urlsplit(url).query, keep_blank_values=True).get("cluster", [])
    if not values:
        return False
    if len(values) > 1:
        raise ValueError(f"remote URL gives cluster= {len(values)} times: {redact_url(url)!r}")
    value = values[0].lower()
    if value not in CLUSTER_ON + CLUSTER_OFF:
        raise ValueError(
            f"remote URL: cluster must be 1 (a Valkey/Redis Cluster) or 0 (one server), "
            f"got {values[0]!r}"
        )
    return value in CLUSTER_ON


def redact_url(url: str) -> str:
    """``url`` without its password, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.hostname or ""
    if parts.port:
        netloc = f"{netloc}:{parts.port}"
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def without_cluster(url: str) -> str:
    """``url`` less its ``cluster`` parameter, which the client library does not know."""
    parts = urlsplit(url)
    query = [(k, v) for k, vs in parse_qs(parts.query, keep_blank_values=True).items()
             for v in vs if k != "cluster"]
    return urlunsplit(parts._replace(query=urlencode(query)))
