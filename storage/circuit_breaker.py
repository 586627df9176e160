"""A consecutive-failure circuit breaker, so that a dead server costs no timeout per call::

    closed ──N consecutive failures──▶ open ──cooldown passed──▶ half-open ──probe ok──▶ closed
                                        ▲                            │
                                        └─────────probe fails────────┘

A caller asks :meth:`CircuitBreaker.allow` before touching the network and hands the
permit back with the outcome to :meth:`CircuitBreaker.record`. Once the cooldown has
passed, exactly one caller gets :attr:`Permit.PROBE`; until its outcome is recorded every
other caller is refused. :attr:`CircuitBreaker.available` is true whenever a call would be
let through, a due probe included, so a caller that checks it first never keeps the
breaker open.

While the breaker is open or half-open, only the probe's outcome changes the state: the
outcome of a call let through before the breaker opened is ignored.

What a failure is, is the caller's rule. The remote store (:mod:`storage.remote_store`)
counts a call as failed only when no server answered it. On a cluster, a call that some
nodes answered is a success even if another node did not: that node's keys are misses or
drops, and the node gets a breaker of its own (:class:`storage.cluster_pipeline.NodeBreakers`,
the same cooldown, open at its first failure), so it is skipped until a probe after the
cooldown finds it back or the slot map sends its slots elsewhere. The store's breaker opens
only when every node a call needed was down or silent.
"""
from __future__ import annotations

import dataclasses
import enum
import threading
import time
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class BreakerConfig:
    """``failures`` consecutive failed calls open the breaker for ``cooldown_s`` seconds."""

    failures: int = 3
    cooldown_s: float = 5.0

    def __post_init__(self) -> None:
        if isinstance(self.failures, bool) or not isinstance(self.failures, int) or self.failures < 1:
            raise ValueError(f"breaker failures must be an integer >= 1, got {self.failures!r}")
        if not self.cooldown_s >= 0:
            raise ValueError(f"breaker cooldown must be >= 0 seconds, got {self.cooldown_s!r}")


class Permit(enum.Enum):
    CALL = "call"  # closed: call the server
    PROBE = "probe"  # half-open: this caller is the one probe
    REFUSED = "refused"  # open, or another caller is probing: do not touch the network


class CircuitBreaker:
    """See the module docstring. Thread-safe; ``clock`` is for tests."""

    def __init__(self, config: BreakerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._open_until: float | None = None  # None: closed
        self._probing = False

    def allow(self) -> Permit:
        with self._lock:
            if self._open_until is None:
                return Permit.CALL
            if self._probing or self._clock() < self._open_until:
                return Permit.REFUSED
            self._probing = True
            return Permit.PROBE

    def record(self, permit: Permit, ok: bool) -> bool:
        """The outcome of a call ``permit`` let through; ``True`` if it opened the breaker
        (again) or closed it."""
        if permit is Permit.REFUSED:
            raise ValueError("a refused call has no outcome to record")
        with self._lock:
            if permit is Permit.PROBE:
                self._probing = False
                if ok:
                    self._failures = 0
                    self._open_until = None
                else:
                    self._open_until = self._clock() + self.config.cooldown_s
                return True
            if self._open_until is not None:  # let through before the breaker opened
                return False
            if ok:
                self._failures = 0
                return False
            self._failures += 1
            if self._failures < self.config.failures:
                return False
            self._open_until = self._clock() + self.config.cooldown_s
            return True

    @property
    def available(self) -> bool:
        """``True`` if :meth:`allow` would let a call through now (a due probe included)."""
        with self._lock:
            if self._open_until is None:
                return True
            return not self._probing and self._clock() >= self._open_until

    @property
    def is_open(self) -> bool:
        """``True`` from the failure that opened the breaker until a probe closes it."""
        with self._lock:
            return self._open_until is not None
