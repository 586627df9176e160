"""How long a thread that wants Python's interpreter lock waits for it, sampled.

:class:`GilProbe` runs a thread that sleeps ``PERIOD_S`` at a time and records how late it
wakes. A sleep gives the lock up; waking needs it back, so on a machine with idle cores the
lateness is time the lock was held by other threads: the engine's own (its kernel launches,
its Python), and any other thread's (the tiers' writers and readers). Compared between a
run with tiers and one without, it shows whether the tiers' threads keep the engine's
thread waiting for the lock. On a machine whose cores are all busy, lateness also counts
waiting for a core, and means little.
"""
from __future__ import annotations

import threading
import time

PERIOD_S = 0.0002
LATE_S = 0.001  # a wake-up this late counts as a wait for the lock


class GilProbe:
    """``with GilProbe() as probe: ...``, then ``probe.summary()``."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._late: list[float] = []
        self._wakeups = 0
        self._thread = threading.Thread(target=self._run, name="gil-probe", daemon=True)

    def __enter__(self) -> GilProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        late, clock, sleep = self._late, time.perf_counter, time.sleep
        while not self._stop.is_set():
            start = clock()
            sleep(PERIOD_S)
            overshoot = clock() - start - PERIOD_S
            self._wakeups += 1
            if overshoot > LATE_S:
                late.append(overshoot)

    def summary(self) -> dict:
        """Wake-ups, those over ``LATE_S`` late, their lateness in total and the longest
        (milliseconds)."""
        return {"wakeups": self._wakeups, "late_wakeups": len(self._late),
                "late_ms_total": 1e3 * sum(self._late),
                "longest_late_ms": 1e3 * max(self._late, default=0.0)}
