"""The remote tier beyond the shared contract: corruption, the circuit breaker, URLs."""
from __future__ import annotations

import hashlib
import time
import uuid

import pytest
import torch

from redis_server import RedisServer, server_binary
from storage.base import BlockKey
from storage.record import Record, encode_record
from storage.remote_store import BreakerConfig, RemoteStore, parse_remote_url, redact_url

NS = hashlib.sha256(b"ns").digest()


def key(i: int) -> BlockKey:
    return BlockKey(NS, hashlib.sha256(f"b{i}".encode()).digest())


def record(i: int) -> Record:
    kv = torch.arange(64, dtype=torch.float16) + i
    return Record(key(i), None, (i,), "raw", torch.float16, (64,), kv.numpy().tobytes())


def store(url: str, **kw) -> RemoteStore:
    kw.setdefault("timeout_s", 0.2)
    return RemoteStore(url, prefix=f"t-{uuid.uuid4().hex}:", stats_interval_s=0, **kw)


def test_corrupt_record_is_a_counted_miss_and_deleted(redis_server):
    s = store(redis_server.url)
    s.put(key(0), record(0))
    s.put(key(1), record(1))
    client = redis_server.client()
    kb0, kb1 = s._kb(key(0)), s._kb(key(1))
    raw = bytearray(client.get(kb0))
    raw[len(raw) // 2] ^= 0x40  # flip one payload bit
    client.set(kb0, bytes(raw))
    client.set(kb1, b"garbage")
    assert s.get_many([key(0), key(1)]) == [None, None]
    st = s.stats()
    assert st.corrupt == 2 and st.hits == 0
    assert client.exists(kb0, kb1) == 0  # deleted: the next engine stores a good copy
    s.close()


def test_record_under_another_key_is_not_served(redis_server):
    s = store(redis_server.url)
    s.put(key(0), record(0))
    client = redis_server.client()
    client.set(s._kb(key(1)), client.get(s._kb(key(0))))
    assert s.get(key(1)) is None
    assert s.stats().corrupt == 1
    s.close()


def test_ttl_expires_keys(redis_server):
    s = store(redis_server.url, ttl_s=100)
    s.put(key(0), record(0))
    assert 0 < redis_server.client().ttl(s._kb(key(0))) <= 100
    s.close()


def test_unreachable_server_is_misses_and_drops_and_breaker_skips_the_network(tmp_path):
    binary = server_binary()
    if binary is None:
        pytest.skip("no valkey-server or redis-server binary (CI installs redis-server)")
    server = RedisServer(binary, tmp_path)
    server.start()
    s = store(server.url, breaker=BreakerConfig(failures=2, cooldown_s=0.5))
    try:
        assert s.put(key(0), record(0))
        assert s.get(key(0)) is not None
        server.stop()
        assert s.get(key(0)) is None
        assert s.contains_many([key(0), key(1)]) == [False, False]
        assert not s.available
        start = time.perf_counter()
        for i in range(200):  # breaker open: no network, no timeouts
            assert s.get(key(0)) is None
            assert s.longest_prefix([key(0)]) == 0
            assert s.put(key(i), record(i)) is False
            assert list(s.keys()) == []
        assert time.perf_counter() - start < 1.0
        st = s.stats()
        assert st.dropped == 200 and st.misses >= 201
        server.start()  # same port
        deadline = time.monotonic() + 10
        while not s.available and time.monotonic() < deadline:
            s.contains(key(0))  # after the cooldown, the half-open probe reconnects
            time.sleep(0.05)
        assert s.available
        r = record(0)
        assert s.put(key(0), r)  # a fresh, empty server: store again
        assert encode_record(s.get(key(0))) == encode_record(r)
    finally:
        s.close()
        server.stop()


def test_urls():
    assert parse_remote_url("valkey://h:1/0") == "valkey://h:1/0"
    assert parse_remote_url("rediss://:pw@h:6380/1")
    with pytest.raises(ValueError, match="start with"):
        parse_remote_url("http://h")
    with pytest.raises(ValueError, match="Cluster"):
        parse_remote_url("redis://h:1/0?cluster=1")
    with pytest.raises(ValueError, match="no host"):
        parse_remote_url("redis://")
    assert redact_url("redis://u:secret@h:1/0") == "redis://u:***@h:1/0"
    assert "secret" not in str(pytest.raises(ValueError, parse_remote_url, "http://:secret@h").value)


def test_bad_prefix_and_ttl(redis_server):
    with pytest.raises(ValueError):
        RemoteStore(redis_server.url, prefix="a*")
    with pytest.raises(ValueError):
        RemoteStore(redis_server.url, ttl_s=0)
