"""The remote tier of the tier stress test (``tests/test_tier_stress.py``): a server of the
test's own, what the model knows it holds, and what happens to it (outages, corruption).

The stores' breakers run on a clock that stands still (conftest's ``breaker_clock``), so an
outage keeps a breaker open for as long as the test says, not for as long as a loaded
machine took; they open at one failed call, so that an outage costs each manager one call's
deadline, not three (a busy moment may open one too: that costs misses and drops, which
the model allows for, and a check of what the tier holds lets the breakers probe first).
"""
from __future__ import annotations

import functools
import random
import struct

import pytest

from redis_server import RedisServer
from storage.circuit_breaker import BreakerConfig
from storage.record import SEAL_SIZE
from storage.remote_store import RemoteStore
from test_circuit_breaker import Clock
from tiered_kv import tier_stores

BREAKER = BreakerConfig(failures=1)


def remote_tier(request: pytest.FixtureRequest) -> RemoteTier:
    """The remote tier of the test ``request`` is for: its own server (``private_server``),
    its stores' breakers (:data:`BREAKER`) on ``breaker_clock``."""
    monkeypatch = request.getfixturevalue("monkeypatch")
    monkeypatch.setattr(tier_stores, "RemoteStore", functools.partial(RemoteStore, breaker=BREAKER))
    server, clock = (request.getfixturevalue(name) for name in ("private_server", "breaker_clock"))
    return RemoteTier(server, clock)


class RemoteTier:
    """The remote tier's server and what the model knows of it: the blocks a flush or a
    close said reached it (``durable``), those offered since (``unflushed``) and those
    corrupted there. ``clock``: the stores' breakers'."""

    def __init__(self, server: RedisServer, clock: Clock) -> None:
        self.server = server
        self.clock = clock
        self.down: str | None = None  # during an outage: "frozen" or "killed"
        self.durable: set[bytes] = set()
        self.unflushed: set[bytes] = set()
        self.corrupted: set[bytes] = set()

    def take_down(self, rng: random.Random) -> None:
        """Freeze the server (SIGSTOP: it keeps its connections and answers nothing), or
        kill it (it comes back empty: no persistence)."""
        self.down = rng.choice(["frozen", "killed"])
        if self.down == "frozen":
            self.server.pause()
        else:
            self.server.stop()
            self.durable.clear()
            self.unflushed.clear()

    def bring_back(self) -> None:
        """Resume the frozen server, or start the killed one again on its port."""
        if self.down == "frozen":
            self.server.resume()
        else:
            self.server.start()
        self.down = None
        self.let_breakers_probe()

    def let_breakers_probe(self) -> None:
        """Time passes: a breaker that is open probes the server at its next call."""
        self.clock.now += BREAKER.cooldown_s

    def reached(self, ok: bool) -> None:
        """A flush or a close ended; ``ok``: what was offered since the last reached this tier."""
        if ok:
            self.durable |= self.unflushed - self.corrupted
        self.unflushed.clear()

    def corrupt(self, key: bytes, block_hash: bytes, rng: random.Random) -> None:
        """Flip a payload byte of a stored value behind the managers' backs (the payload
        runs from the header's length, at offset 8, to the seal: storage/record.py)."""
        client = self.server.client()
        try:
            size = client.strlen(key)
            assert size, f"durable block {block_hash.hex()[:12]} is not on the server"
            (header,) = struct.unpack("<I", client.getrange(key, 8, 11))
            at = rng.randrange(header, size - SEAL_SIZE)
            byte = client.getrange(key, at, at)[0]
            client.setrange(key, at, bytes([byte ^ 0x55]))
        finally:
            client.close()
        self.durable.discard(block_hash)
        self.corrupted.add(block_hash)
