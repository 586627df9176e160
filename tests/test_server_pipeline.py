"""A pipelined batch on one server pools its connection only once every reply was read
(a fake server, tests/hostile_server.py, scripts the replies)."""
from __future__ import annotations

import pytest
from valkey.exceptions import InvalidResponse

from hostile_server import HostileServer, Reply, bulk
from storage import call_deadline
from storage.call_deadline import CallBytesSpent, CallDeadline
from storage.remote_client import ServerClient

KEYS = [b"k0", b"k1", b"k2"]


@pytest.fixture
def server():
    server = HostileServer()
    server.data = {k: b"v" * 100 for k in KEYS}
    yield server
    server.stop()


@pytest.fixture
def deadline():
    deadline = CallDeadline()
    deadline.begin(5.0)
    yield deadline
    deadline.end()


def get_all(client: ServerClient, **kwargs) -> list:
    return client.pipeline(lambda p: [p.get(k) for k in KEYS], **kwargs)


def pooled(client: ServerClient) -> list:
    return list(client._client.connection_pool._available_connections)


def test_a_batch_read_to_the_end_pools_its_connection(server, deadline):
    client = ServerClient(server.url, deadline, timeout_s=5.0, max_connections=4)
    try:
        assert get_all(client) == [b"v" * 100] * 3
        [connection] = pooled(client)
        assert connection._sock is not None
    finally:
        client.close()


def test_a_batch_that_fails_midway_closes_its_connection(server, deadline):
    """The second reply is not one: the third is still to come, so the connection is
    closed rather than pooled for the next call to read it as its own."""
    client = ServerClient(server.url, deadline, timeout_s=5.0, max_connections=4)
    server.script = lambda batch: Reply(bulk(b"v" * 100) + b"?what\r\n")
    try:
        with pytest.raises(InvalidResponse):
            get_all(client)
        assert all(c._sock is None for c in pooled(client))
    finally:
        client.close()


def test_a_fresh_batch_is_on_a_connection_of_its_own(server, deadline):
    client = ServerClient(server.url, deadline, timeout_s=5.0, max_connections=4)
    try:
        assert get_all(client, fresh=True) == [b"v" * 100] * 3
        assert pooled(client) == []
        assert client._client.connection_pool._created_connections == 0
    finally:
        client.close()


def test_replies_past_the_calls_bytes_are_that_error(server, monkeypatch):
    """A call that may read one reply and a half: the first is kept, the others are cut
    off, and the connection, in the middle of a reply, is closed."""
    monkeypatch.setattr(call_deadline, "MAX_CALL_BYTES", 170)
    deadline = CallDeadline()
    client = ServerClient(server.url, deadline, timeout_s=5.0, max_connections=4)
    try:
        client.probe()  # the handshake, outside the call
        deadline.begin(5.0)
        first, *rest = get_all(client)
        deadline.end()
        assert first == b"v" * 100
        assert [type(r) for r in rest] == [CallBytesSpent] * 2
        assert all(c._sock is None for c in pooled(client))
    finally:
        client.close()
