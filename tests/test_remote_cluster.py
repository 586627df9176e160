"""The remote tier on a Valkey/Redis Cluster of three nodes on loopback: keys spread over
every node, moving slots are followed, a node that dies or freezes costs misses, never
errors, and engines share prefixes through the cluster and keep serving while a node is down.
The shared contract runs against the cluster in tests/test_store_conformance.py."""
from __future__ import annotations

import functools
import hashlib
import time
import uuid

import pytest
import torch

from engine import LLM
from engine_testing import one_thread  # noqa: F401  (autouse fixture)
from redis_server import RedisCluster, redis_cluster, server_binary  # noqa: F401  (fixture)
from storage.base import BlockKey
from storage.circuit_breaker import BreakerConfig
from storage.record import Record, encode_record
from storage.remote_store import RemoteStore
from storage.seal import SealKey
from test_remote_tier import SECRET, remote
from test_tier_manager import BLOCK, FLUSH, GREEDY, PROMPTS, hit_tokens, make_llm
from tiered_kv import TierConfig, tier_manager

NS = hashlib.sha256(b"cluster-ns").digest()
KEY = SealKey(b"the deployment's shared secret for the cluster tests")


def key(i: int) -> BlockKey:
    return BlockKey(NS, hashlib.sha256(f"c{i}".encode()).digest())


def record(i: int) -> Record:
    kv = torch.arange(256, dtype=torch.float16) + i
    return Record(key(i), None, (i,), "raw", torch.float16, (256,), kv.numpy().tobytes(),
                  created_ns=1_700_000_000_000_000_000 + i)


def store(url: str, **kw) -> RemoteStore:
    kw.setdefault("timeout_s", 0.5)
    kw.setdefault("stats_interval_s", 0)
    return RemoteStore(url, seal_key=KEY, prefix=f"t-{uuid.uuid4().hex}:", **kw)


def same(a: Record | None, b: Record) -> bool:
    return a is not None and encode_record(a, KEY) == encode_record(b, KEY)


def keys_on(node, prefix: str) -> int:
    client = node.client()
    try:
        return sum(1 for _ in client.scan_iter(match=prefix.encode() + b"*"))
    finally:
        client.close()


@pytest.fixture
def private_cluster(tmp_path):
    """A cluster of this test's own, to kill and restart nodes of."""
    binary = server_binary()
    if binary is None:
        pytest.skip("no valkey-server or redis-server binary (CI installs redis-server)")
    cluster = RedisCluster(binary, tmp_path / "cluster")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    with LLM(max_model_len=256, enable_prefix_caching=False, device="cpu") as llm:
        return [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)]


def test_keys_spread_over_every_node_and_scan_sees_them_all(redis_cluster):
    s = store(redis_cluster.url)
    try:
        assert all(s.put_many((key(i), record(i)) for i in range(60)))
        per_node = [keys_on(node, s.prefix) for node in redis_cluster.nodes]
        assert sum(per_node) == 60 and min(per_node) >= 10  # no hash tag: no hot node
        assert sorted(s.keys()) == sorted(key(i) for i in range(60))
        st = s.stats()
        assert st.entries == 60 and st.bytes_used > 0
        got = s.get_many([key(i) for i in range(61)])
        assert all(same(got[i], record(i)) for i in range(60)) and got[60] is None
        assert s.longest_prefix([key(i) for i in range(60)] + [key(99), key(0)]) == 60
        assert s.delete_many([key(i) for i in range(30)]) == 30
        assert s.contains_many([key(29), key(30)]) == [False, True]
    finally:
        s.close()


def test_a_slot_on_the_move_is_followed_through_ask_and_moved(redis_cluster):
    """Move the slot of a stored key to another node under a client that cached the old
    slot map: mid-migration the old owner answers ASK, afterwards MOVED, and the store
    still finds the record."""
    s = store(redis_cluster.url)
    clients = [node.client() for node in redis_cluster.nodes]
    try:
        assert s.put(key(0), record(0)) and same(s.get(key(0)), record(0))
        kb = s._kb(key(0))
        slot = clients[0].execute_command("CLUSTER KEYSLOT", kb)
        src = next(i for i, c in enumerate(clients)
                   if c.execute_command("CLUSTER COUNTKEYSINSLOT", slot))
        dst = (src + 1) % len(clients)
        ids = [c.execute_command("CLUSTER MYID") for c in clients]
        clients[dst].execute_command("CLUSTER SETSLOT", slot, "IMPORTING", ids[src])
        clients[src].execute_command("CLUSTER SETSLOT", slot, "MIGRATING", ids[dst])
        clients[src].execute_command(
            "MIGRATE", "127.0.0.1", redis_cluster.nodes[dst].port, "", 0, 5000, "KEYS", kb
        )
        assert same(s.get(key(0)), record(0))  # ASK: the key is on the importing node
        assert s.contains(key(0))
        for c in clients:
            c.execute_command("CLUSTER SETSLOT", slot, "NODE", ids[dst])
        assert same(s.get(key(0)), record(0))  # MOVED: the slot map is updated
        assert s.put(key(0), record(0))
        st = s.stats()
        assert st.hits == 3 and st.misses == 0 and st.dropped == 0
        assert s.available
    finally:
        for c in clients:
            c.close()
        s.close()


def test_a_frozen_or_dead_node_is_misses_and_drops_then_the_tier_comes_back(private_cluster):
    s = store(private_cluster.url, timeout_s=0.2, breaker=BreakerConfig(failures=2, cooldown_s=0.5))
    chain = [key(i) for i in range(24)]
    victim = private_cluster.nodes[1]
    try:
        assert all(s.put_many((k, record(i)) for i, k in enumerate(chain)))
        assert keys_on(victim, s.prefix) > 0
        victim.pause()  # frozen: connections open, no reply
        start = time.perf_counter()
        assert s.contains_many(chain) == [False] * len(chain)
        assert time.perf_counter() - start < 2 * 0.2  # the deadline of the whole call
        victim.resume()
        time.sleep(0.6)  # one failure: still closed, the next call goes through
        assert s.longest_prefix(chain) == len(chain)
        victim.stop()  # killed mid-traffic
        assert s.get_many(chain) == [None] * len(chain)
        assert s.put_many((k, record(i)) for i, k in enumerate(chain)) == [False] * len(chain)
        assert not s.available  # two failures: open
        start = time.perf_counter()
        for _ in range(50):
            assert s.longest_prefix(chain) == 0 and s.get(chain[0]) is None
            assert list(s.keys()) == []
        assert time.perf_counter() - start < 0.5  # open: no network
        victim.start()  # same port and nodes.conf: it rejoins with its slots, empty
        private_cluster.wait_ok()
        deadline = time.monotonic() + 10
        while not s.available and time.monotonic() < deadline:
            time.sleep(0.05)
        present = s.contains_many(chain)  # the probe, from a fresh view of the cluster
        assert 0 < sum(present) < len(chain)  # what the restarted node held is gone
        assert all(s.put_many((k, record(i)) for i, k in enumerate(chain)))
        assert all(same(r, record(i)) for i, r in enumerate(s.get_many(chain)))
        st = s.stats()
        assert st.dropped == len(chain) and st.corrupt == 0
    finally:
        s.close()


def test_a_second_engine_is_served_its_prefix_from_the_cluster(redis_cluster, reference):
    tiers = remote(redis_cluster.url)
    with make_llm(tiers) as a:
        first = a.generate(PROMPTS[0], GREEDY)[0]
        assert a.engine.connector.flush(30)
    spread = [keys_on(node, tiers.remote_prefix) for node in redis_cluster.nodes]
    assert sum(spread) >= hit_tokens(PROMPTS[0]) // BLOCK and sum(n > 0 for n in spread) >= 2
    with make_llm(tiers) as b:
        again = b.generate(PROMPTS[0], GREEDY)[0]
        stats = b.engine.connector.stats()
    assert first.token_ids == again.token_ids == reference[0]
    assert again.num_cached_tokens == hit_tokens(PROMPTS[0]) > 0
    assert stats["remote"]["hit_blocks"] == hit_tokens(PROMPTS[0]) // BLOCK
    assert stats["remote"]["corrupt"] == stats["remote"]["load_failures"] == 0


def test_an_engine_runs_on_while_a_node_is_down_and_hits_again_after(
    private_cluster, reference, monkeypatch
):
    breaker = BreakerConfig(failures=2, cooldown_s=0.5)
    monkeypatch.setattr(
        tier_manager, "RemoteStore", functools.partial(RemoteStore, breaker=breaker)
    )
    tiers = remote(private_cluster.url, remote_timeout_s=0.5)

    def cached_tokens(llm: LLM) -> int:
        """Serve PROMPTS[0], then FLUSH so that the engine's own cache cannot serve it next."""
        out = llm.generate(PROMPTS[0], GREEDY)[0]
        assert out.token_ids == reference[0]
        llm.generate(FLUSH, GREEDY)
        return out.num_cached_tokens

    with make_llm(tiers) as a:
        a.generate(PROMPTS[0], GREEDY)
        assert a.engine.connector.flush(30)
    victim = max(private_cluster.nodes, key=lambda n: keys_on(n, tiers.remote_prefix))
    with make_llm(tiers) as b:
        assert cached_tokens(b) == hit_tokens(PROMPTS[0])
        victim.stop()
        assert [cached_tokens(b) for _ in range(3)] == [0, 0, 0]  # recomputed, not failed
        victim.start()
        private_cluster.wait_ok()
        restarted = time.monotonic()
        # The restarted node lost its blocks: a request hits the blocks before the first of
        # them, recomputes and stores the rest; the next one hits them all.
        cached = cached_tokens(b)
        while cached < hit_tokens(PROMPTS[0]) and time.monotonic() - restarted < 10:
            cached = cached_tokens(b)
        stats = b.engine.connector.stats()
    assert cached == hit_tokens(PROMPTS[0]), "no remote hits 10 s after the node came back"
    assert stats["remote"]["corrupt"] == 0


def test_cluster_urls():
    from storage.remote_store import parse_remote_url
    from storage.remote_client import is_cluster_url

    assert is_cluster_url(parse_remote_url("redis://h:7000/?cluster=1"))
    assert is_cluster_url(parse_remote_url("rediss://:pw@h:7000/0?cluster=true"))
    assert not is_cluster_url(parse_remote_url("valkey://h:6379/2?cluster=0"))
    assert not is_cluster_url("redis://h:6379/0")
    for url, message in [
        ("redis://h:7000/?cluster=maybe", "cluster must be 1"),
        ("redis://:secret@h:7000/3?cluster=1", "only database 0"),
        ("redis://h:7000/?cluster=1&cluster=0", "2 times"),
    ]:
        with pytest.raises(ValueError, match=message) as err:
            parse_remote_url(url)
        assert "\n" not in str(err.value) and "secret" not in str(err.value)
    with pytest.raises(ValueError, match="remote_url is not usable"):
        TierConfig(cpu_bytes=0, remote_url="redis://h/5?cluster=yes", remote_secret=SECRET)
