"""The remote tier beyond the shared contract: corruption, the circuit breaker, URLs."""
from __future__ import annotations

import hashlib
import threading
import time
import uuid

import pytest
import torch

from redis_server import DripServer, RedisServer, server_binary
from remote_testing import ANSWER_S, SILENT_S, watch_network
from storage.base import BlockKey
from storage.record import SEAL_SIZE, Record, encode_record
from storage.remote_store import BreakerConfig, RemoteStore, parse_remote_url, redact_url
from storage.seal import SealKey

NS = hashlib.sha256(b"ns").digest()
KEY = SealKey(b"the deployment's shared secret for these tests")


def key(i: int) -> BlockKey:
    return BlockKey(NS, hashlib.sha256(f"b{i}".encode()).digest())


def record(i: int) -> Record:
    kv = torch.arange(64, dtype=torch.float16) + i
    return Record(key(i), None, (i,), "raw", torch.float16, (64,), kv.numpy().tobytes())


def store(url: str, **kw) -> RemoteStore:
    kw.setdefault("timeout_s", ANSWER_S)
    kw.setdefault("stats_interval_s", 0)  # fresh server-side stats on every call
    kw.setdefault("seal_key", KEY)
    return RemoteStore(url, prefix=f"t-{uuid.uuid4().hex}:", **kw)


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


def test_a_resealed_record_with_altered_kv_is_refused_and_deleted(redis_server):
    """Anyone who can write to the server can change a record's KV and recompute an
    unkeyed checksum (xxh3-64, the last eight bytes): without the secret it never verifies."""
    import xxhash

    s = store(redis_server.url)
    s.put(key(0), record(0))
    client = redis_server.client()
    kb = s._kb(key(0))
    forged = bytearray(client.get(kb))
    forged[len(forged) - SEAL_SIZE - 1] ^= 0x55  # the KV's last byte
    forged[-8:] = xxhash.xxh3_64_intdigest(bytes(forged[:-8])).to_bytes(8, "little")
    client.set(kb, bytes(forged))
    assert s.get(key(0)) is None
    assert s.stats().corrupt == 1 and s.stats().hits == 0
    assert client.exists(kb) == 0
    s.close()


def test_an_instance_with_another_secret_serves_nothing_of_ours(redis_server):
    ours = store(redis_server.url)
    theirs = RemoteStore(
        redis_server.url, prefix=ours.prefix, seal_key=SealKey(b"not the deployment's secret, though long"),
        timeout_s=ANSWER_S,
    )
    theirs.put(key(0), record(0))
    assert ours.contains(key(0)) and ours.get(key(0)) is None  # a miss, counted, deleted
    assert ours.stats().corrupt == 1 and not ours.contains(key(0))
    ours.close()
    theirs.close()


def test_a_store_needs_a_seal_key(redis_server):
    with pytest.raises(ValueError, match="seal key"):
        RemoteStore(redis_server.url, seal_key=None)


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


def test_unreachable_server_is_misses_and_drops_and_breaker_skips_the_network(
    tmp_path, breaker_clock, monkeypatch
):
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
        network = watch_network(monkeypatch, s)
        for i in range(200):  # breaker open: no network, no timeouts
            assert s.get(key(0)) is None
            assert s.longest_prefix([key(0)]) == 0
            assert s.put(key(i), record(i)) is False
            assert list(s.keys()) == []
        st = s.stats()
        assert network == []
        assert st.dropped == 200 and st.misses >= 201
        server.start()  # same port
        breaker_clock.now += 0.5  # the cooldown has passed: a probe is due
        assert s.available
        r = record(0)
        assert s.put(key(0), r)  # the probe reconnects; a fresh, empty server: store again
        assert encode_record(s.get(key(0)), KEY) == encode_record(r, KEY)
    finally:
        s.close()
        server.stop()


def test_a_paused_server_opens_the_breaker_and_a_probe_closes_it(
    private_server, breaker_clock, monkeypatch
):
    cooldown = 1.0
    s = store(private_server.url, timeout_s=SILENT_S,
              breaker=BreakerConfig(failures=2, cooldown_s=cooldown))
    try:
        r = record(0)
        assert s.put(key(0), r) and s.get(key(0)) is not None
        private_server.pause()  # connections stay open, replies never come
        assert s.get(key(0)) is None and s.contains(key(0)) is False
        assert not s.available
        network = watch_network(monkeypatch, s)
        for _ in range(50):  # open: misses without touching the network
            assert s.get(key(0)) is None
        assert network == []
        breaker_clock.now += cooldown
        assert s.available  # half-open: callers that check first are let through
        assert s.get(key(0)) is None  # the probe times out: open for another cooldown
        assert network == ["probe"] and not s.available
        private_server.resume()
        breaker_clock.now += cooldown
        assert s.available
        assert encode_record(s.get(key(0)), KEY) == encode_record(r, KEY)  # the probe closes it
        assert s.available
        assert s.stats().hits == 2
    finally:
        s.close()


def test_a_server_out_of_memory_drops_the_stores_it_refuses_and_keeps_the_rest(private_server):
    """A pipeline whose later SETs the server refuses (maxmemory reached, noeviction) keeps
    the records stored before: those are puts, the refused ones are drops."""
    # a timeout would drop the whole pipeline: on a loaded 2-core machine half a MiB of SETs
    # can take longer than the default 0.2 s
    s = store(private_server.url, timeout_s=5.0, breaker=BreakerConfig(failures=5, cooldown_s=60))
    client = private_server.client()
    try:
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", used + 20 * len(encode_record(big_record(0), KEY)))
        stored = s.put_many((key(i), big_record(i)) for i in range(60))
        assert 0 < sum(stored) < 60
        assert s.contains_many([key(i) for i in range(60)]) == stored
        st = s.stats()
        assert st.puts == sum(stored) and st.dropped == 60 - sum(stored)
    finally:
        client.config_set("maxmemory", 0)
        client.close()
        s.close()


def big_record(i: int) -> Record:
    kv = torch.arange(4096, dtype=torch.float16) + i
    return Record(key(i), None, (i,), "raw", torch.float16, (4096,), kv.numpy().tobytes())


def test_a_server_that_drips_its_reply_costs_one_timeout_per_call():
    drip = DripServer(interval_s=0.05, drip_for_s=10.0)
    timeout = SILENT_S
    s = store(drip.url, timeout_s=timeout, breaker=BreakerConfig(failures=4, cooldown_s=60))
    calls = [
        ("contains", lambda: s.contains(key(0)), False),
        ("longest_prefix", lambda: s.longest_prefix([key(0), key(1)]), 0),
        ("get", lambda: s.get(key(0)), None),
        ("put", lambda: s.put(key(0), record(0)), False),
    ]
    try:
        for name, call, miss in calls:
            start = time.perf_counter()
            assert call() == miss, name
            # One timeout, not the 10 s the reply drips for (a timeout restarted by every
            # byte would last that long); the slack absorbs a loaded machine's pauses.
            assert time.perf_counter() - start < timeout + 2.0, name
        assert not s.available  # each overrun counted as a failure
        # Each call's connection was closed by the client, not pooled with a reply half read.
        deadline = time.monotonic() + 10
        while drip.hung_up_by_client < len(calls) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert drip.accepted == drip.hung_up_by_client == len(calls)
    finally:
        s.close()
        drip.stop()


def test_urls():
    assert parse_remote_url("valkey://h:1/0") == "valkey://h:1/0"
    assert parse_remote_url("rediss://:pw@h:6380/1")
    with pytest.raises(ValueError, match="start with"):
        parse_remote_url("http://h")
    assert parse_remote_url("redis://h:1/0?cluster=1") == "redis://h:1/0?cluster=1"
    with pytest.raises(ValueError, match="cluster must be 1"):
        parse_remote_url("redis://h:1/0?cluster=on")
    with pytest.raises(ValueError, match="no host"):
        parse_remote_url("redis://")
    assert redact_url("redis://u:secret@h:1/0") == "redis://u:***@h:1/0"
    assert "secret" not in str(pytest.raises(ValueError, parse_remote_url, "http://:secret@h").value)


def test_bad_prefix_and_ttl(redis_server):
    with pytest.raises(ValueError):
        RemoteStore(redis_server.url, seal_key=KEY, prefix="a*")
    with pytest.raises(ValueError):
        RemoteStore(redis_server.url, seal_key=KEY, ttl_s=0)


def test_stats_never_scan_on_the_callers_thread(redis_server, monkeypatch):
    """/metrics reads stats on the event loop: a SCAN of millions of keys must not run
    there. The count is refreshed in the background, at most once per interval."""
    s = store(redis_server.url, stats_interval_s=60)
    for i in range(5):
        assert s.put(key(i), record(i))
    scans = []  # the thread of each scan
    scanned = threading.Event()  # a big keyspace: the scan takes until the test says
    keys = RemoteStore.keys

    def slow_keys(self, namespace=None):
        scans.append(threading.get_ident())
        scanned.wait(10)
        return keys(self, namespace)

    monkeypatch.setattr(RemoteStore, "keys", slow_keys)
    first = s.stats()
    second = s.stats()
    scanned.set()
    assert first.entries == second.entries == 0  # neither call waited for the scan
    deadline = time.monotonic() + 10
    while s.stats().entries != 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.stats().entries == 5
    assert len(scans) == 1  # one refresh in the interval, however often stats() was read
    assert scans != [threading.get_ident()]  # on a thread of its own
    s.close()


def test_a_scan_whose_cursor_cycles_ends(redis_server, monkeypatch):
    """A server (or proxy) that keeps handing back a cursor already passed would keep the
    stats thread walking forever: the walk ends there, with the keys seen so far."""
    s = store(redis_server.url)
    assert s.put(key(0), record(0))
    pages = []

    def cycling_scan(node, cursor, match, count):
        pages.append(cursor)
        if len(pages) > 50:  # the old walk: let it end, with the pages it took
            return 0, []
        return 7, [s._kb(key(0))] if cursor == 0 else []  # 7, then 7 again

    monkeypatch.setattr(s._calls.client, "scan", cycling_scan)
    assert list(s.keys()) == [key(0)]
    assert pages == [0, 7]  # cursor 7 came back after it was walked: the walk stopped
    s.close()
