"""One WARNING line per interval for KV blocks a tier dropped, naming what to change.

Drops are counted in the tier's metrics as they happen; the log says so at most once per
:data:`DROP_WARNING_INTERVAL_S`, with the count since the last line, and :meth:`close`
logs what is left so that no drop goes unsaid.
"""
from __future__ import annotations

import logging
import threading
import time

DROP_WARNING_INTERVAL_S = 60.0


class DropWarning:
    """``message`` is a %-format of the count and then ``add``'s ``args``, logged on ``log``."""

    def __init__(self, log: logging.Logger, message: str) -> None:
        self._log = log
        self._message = message
        self._lock = threading.Lock()
        self._count = 0
        self._args: tuple = ()
        self._last = -DROP_WARNING_INTERVAL_S

    def add(self, blocks: int, *args: object) -> None:
        with self._lock:
            self._count += blocks
            self._args = args
            now = time.monotonic()
            if now - self._last < DROP_WARNING_INTERVAL_S:
                return
            count, self._count, self._last = self._count, 0, now
        self._log.warning(self._message, count, *args)

    def close(self) -> None:
        """Log the drops not logged yet."""
        with self._lock:
            count, self._count = self._count, 0
        if count:
            self._log.warning(self._message, count, *self._args)
