"""Calls to the remote tier's server, each guarded: a deadline, a byte cap, a circuit breaker.

A call never raises: every client error is caught and the call fails, which the store
turns into a miss (lookups) or a drop (stores). ``timeout_s`` is the deadline of a whole call:
connecting, sending and reading the whole reply (each socket wait is cut to the time left),
so a server that answers slowly, byte by byte, holds a caller no longer than a dead one. A
call past its deadline is a failure and its connection is closed, never returned to the
pool in the middle of a reply (nor is one whose call ended any other way before its last
reply: :mod:`storage.server_pipeline`). A call reads at most ``MAX_CALL_BYTES`` (1 GiB,
:mod:`storage.call_deadline`), whatever the server sends; a get of records larger together
is read in several calls. A circuit breaker (:mod:`storage.circuit_breaker`) keeps a
dead server from costing a timeout per call. A call fails, for the breaker, when no server
answered it: a command the server refuses by itself (out of memory) is a drop for its key
only, and on a cluster, so is a node that does not answer while another does::

    closed ──N consecutive failures──▶ open ──cooldown──▶ half-open ──probe ok──▶ closed
                                        ▲                    │
                                        └────probe fails─────┘

While open, lookups are misses and stores are dropped without touching the network. After
the cooldown the next call, whichever it is, probes the server (a ``PING`` before the call
itself; on a cluster, of every primary, from a fresh view of the slots); the client's pool
reconnects by itself. :attr:`GuardedCalls.available` is true
once a probe is due, so a caller that checks it first does not keep the breaker open.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from storage.call_deadline import CallDeadline
from storage.circuit_breaker import BreakerConfig, CircuitBreaker, Permit
from storage.remote_client import RemoteClient, remote_client

logger = logging.getLogger(__name__)


class GuardedCalls:
    """The client of the server (or cluster) at ``url``, and the breaker and the deadline
    every call to it goes through. ``timeout_s`` is the deadline of a whole call;
    ``max_connections`` sizes the client's connection pool."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        breaker: BreakerConfig | None = None,
        max_connections: int = 16,
    ) -> None:
        self._timeout = timeout_s
        self._breaker = CircuitBreaker(breaker or BreakerConfig())
        self._deadline = CallDeadline()
        self.client: RemoteClient = remote_client(
            url, self._deadline, timeout_s=timeout_s, max_connections=max_connections,
            cooldown_s=self._breaker.config.cooldown_s,
        )
        self._closed = False

    def call(self, fn: Callable[[RemoteClient], Any], what: str) -> tuple[bool, Any]:
        """Run ``fn(client)`` behind the breaker and within the deadline; ``(True,
        result)``, or ``(False, None)`` on failure (and once closed)."""
        if self._closed:
            return False, None
        permit = self._breaker.allow()
        if permit is Permit.REFUSED:
            return False, None
        self._deadline.begin(self._timeout)
        ok, result, error = False, None, None
        try:
            if permit is Permit.PROBE:  # half-open: one cheap probe before the real call
                self.client.probe()
            result = fn(self.client)
            ok = True
        except Exception as e:  # noqa: BLE001 - any client error is a miss or a drop, never a failure
            error = e
        finally:
            self._deadline.end()
            changed = self._breaker.record(permit, ok)
        if changed and ok:
            logger.info("remote tier: the server answers again; breaker closed")
        elif changed:
            logger.warning(
                "remote tier: %s failed (%s); breaker open for %.1f s",
                what, error, self._breaker.config.cooldown_s,
            )
        return ok, result

    def pipeline(self, ops, n: int, what: str, *, fresh: bool = False) -> list:
        """The ``n`` replies of the commands ``ops(pipe)`` queues, sent in one pipelined
        round-trip (per node, on a cluster); a reply is an exception where its command
        failed, e.g. all of them when the server is down, those of one node when that node
        is. Only a call no server or node answered counts against the breaker. ``fresh``:
        on connections opened for the call (:meth:`RemoteClient.pipeline`)."""
        _, replies = self.call(lambda client: client.pipeline(ops, fresh=fresh), what)
        if replies is None:
            return [ConnectionError(f"remote {what} failed")] * n
        return replies

    @property
    def available(self) -> bool:
        """``False`` while the breaker is open and no probe is due: a call now would fail
        without touching the network."""
        return self._breaker.available

    def close(self) -> None:
        """Fail every later call at once, and release the client's connections."""
        self._closed = True
        self.client.close()
