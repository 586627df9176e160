"""Helpers shared by the remote-tier tests: their deadlines, and a watch on the calls that
reach the network (the clock of the stores' circuit breakers: ``breaker_clock`` in conftest).

The tests run beside others on a small, often loaded machine (2 cores, load 10 and more),
where a live server may take a few hundred milliseconds to answer. A deadline that a
live server can miss turns a busy moment into a miss, a drop, or a node taken for dead;
a cooldown timed by the wall clock passes, or not, depending on how long the calls
before it took. So a test's deadline is one of two, and its cooldowns pass when it says.
"""
from __future__ import annotations

from storage.remote_store import RemoteStore

# The deployment's shared secret that seals the remote tier's records in these tests.
SECRET = "the deployment's shared secret, 32 bytes or more"

# Where no call waits on a silent server: long enough for a live one on a loaded machine.
ANSWER_S = 5.0
# Where calls do wait on a silent (paused, dripping) server: each such call costs it once,
# and the live servers and nodes of the same test still answer within it.
SILENT_S = 1.0


def watch_network(monkeypatch, store: RemoteStore) -> list[str]:
    """From now on, the name of each method of ``store``'s remote client called (every
    one touches the network); the calls still go through."""
    calls: list[str] = []

    def watched(name: str, method):
        def call(*args, **kwargs):
            calls.append(name)
            return method(*args, **kwargs)
        return call

    for name in ("pipeline", "probe", "scan_nodes", "scan", "memory"):
        monkeypatch.setattr(store._calls.client, name, watched(name, getattr(store._calls.client, name)))
    return calls
