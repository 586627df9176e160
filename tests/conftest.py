"""Fixtures shared across test modules."""
from __future__ import annotations

import pytest

from redis_server import RedisServer, server_binary


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> RedisServer:
    """One Valkey/Redis server for the session; tests keep apart by key prefix."""
    binary = server_binary()
    if binary is None:
        pytest.skip("no valkey-server or redis-server binary (CI installs redis-server)")
    server = RedisServer(binary, tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()
