"""The remote tier on a Valkey/Redis Cluster of three nodes on loopback: keys spread over
every node, moving slots are followed, a node that dies or freezes costs misses, never
errors, and engines share prefixes through the cluster and keep serving while a node is down.
The shared contract runs against the cluster in tests/test_store_conformance.py."""
from __future__ import annotations

import functools
import hashlib
import logging
import time
import uuid

import pytest
import torch

from engine import LLM
from engine_testing import one_thread  # noqa: F401  (autouse fixture)
from redis_server import SLOTS, RedisCluster, redis_cluster, server_binary  # noqa: F401  (fixture)
from remote_testing import ANSWER_S, SECRET, SILENT_S, watch_network
from storage.base import BlockKey
from storage.circuit_breaker import BreakerConfig
from storage.record import Record, encode_record
from storage.remote_store import RemoteStore
from storage.seal import SealKey
from test_remote_tier import remote
from tier_testing import BLOCK, FLUSH, GREEDY, PROMPTS, hit_tokens, make_llm
from tiered_kv import TierConfig, tier_stores

NS = hashlib.sha256(b"cluster-ns").digest()
KEY = SealKey(b"the deployment's shared secret for the cluster tests")


def key(i: int) -> BlockKey:
    return BlockKey(NS, hashlib.sha256(f"c{i}".encode()).digest())


def record(i: int) -> Record:
    kv = torch.arange(256, dtype=torch.float16) + i
    return Record(key(i), None, (i,), "raw", torch.float16, (256,), kv.numpy().tobytes(),
                  created_ns=1_700_000_000_000_000_000 + i)


def store(url: str, **kw) -> RemoteStore:
    kw.setdefault("timeout_s", ANSWER_S)
    kw.setdefault("stats_interval_s", 0)
    kw.setdefault("prefix", f"t-{uuid.uuid4().hex}:")
    return RemoteStore(url, seal_key=KEY, **kw)


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
    # Without replicas, the live nodes go on serving their slots while one is down.
    cluster = RedisCluster(binary, tmp_path / "cluster",
                           extra=("--cluster-require-full-coverage", "no"))
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
    # a prefix of its own, fixed: its keys fall 20, 19 and 21 to the nodes (under a random
    # one, a node gets fewer than 10 of the 60 once in about 300 runs)
    s = store(redis_cluster.url, prefix="t-spread:")
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


def test_a_user_allowed_only_the_tiers_commands_is_enough(redis_cluster):
    """The ACL of docs/scale_out.md: building the client asks a node for the slot map, not
    for the server's command table (``COMMAND``, a 90 KB reply whose parsing took a busy
    host longer than a call's deadline)."""
    user, password, prefix = f"tkv-{uuid.uuid4().hex}", uuid.uuid4().hex, f"t-{uuid.uuid4().hex}:"
    clients = [node.client() for node in redis_cluster.nodes]
    for c in clients:  # a cluster's users are each node's own
        c.execute_command("ACL", "SETUSER", user, "on", f">{password}", f"~{prefix}*",
                          "+get", "+set", "+exists", "+del", "+scan", "+ping", "+info",
                          "+cluster|slots", "+asking")
    s = store(redis_cluster.url.replace("redis://", f"redis://{user}:{password}@"), prefix=prefix)
    chain = [key(i) for i in range(30)]
    try:
        assert all(s.put_many((k, record(i)) for i, k in enumerate(chain)))
        assert all(same(r, record(i)) for i, r in enumerate(s.get_many(chain)))
        assert sorted(s.keys()) == sorted(chain) and s.stats().entries == len(chain)
        assert s.delete_many(chain) == len(chain) and s.available
    finally:
        s.close()
        for c in clients:
            c.execute_command("ACL", "DELUSER", user)
            c.close()


def test_a_slot_on_the_move_is_followed_through_ask_and_moved(redis_cluster):
    """Move the slot of a stored key to another node under a client that cached the old
    slot map: mid-migration the old owner answers ASK, afterwards MOVED, and the store
    still finds the record. (The nodes' config epochs are distinct from the start, see
    RedisCluster: a slot moved while they are not can be lost by the cluster itself.)"""
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
        # every key of the slot (other tests' keys may share it): the source may give the
        # slot away only once it holds none
        keys = clients[src].execute_command("CLUSTER GETKEYSINSLOT", slot, 10_000)
        assert kb.decode() in keys
        clients[src].execute_command(
            "MIGRATE", "127.0.0.1", redis_cluster.nodes[dst].port, "", 0, 5000, "KEYS", *keys
        )
        assert same(s.get(key(0)), record(0))  # ASK: the key is on the importing node
        assert s.contains(key(0))
        # the new owner first, then the old one, then the rest (CLUSTER SETSLOT's order: the
        # old owner never redirects to a node that does not own the slot yet)
        for i in [dst, src, *(i for i in range(len(clients)) if i not in (dst, src))]:
            clients[i].execute_command("CLUSTER SETSLOT", slot, "NODE", ids[dst])
        assert same(s.get(key(0)), record(0))  # MOVED: the slot map is updated
        assert s.put(key(0), record(0))
        st = s.stats()
        assert st.hits == 3 and st.misses == 0 and st.dropped == 0
        assert s.available
    finally:
        for c in clients:
            c.close()
        s.close()


def on_node(cluster: RedisCluster, node, s: RemoteStore, keys: list[BlockKey]) -> list[bool]:
    return [cluster.owner(s._kb(k)) is node for k in keys]


def not_first(cluster: RedisCluster, s: RemoteStore, chain: list[BlockKey]):
    """A node that does not hold the chain's first key."""
    return next(n for n in cluster.nodes if cluster.owner(s._kb(chain[0])) is not n)


def node_warnings(caplog, node) -> int:
    return sum(r.levelname == "WARNING" and f"127.0.0.1:{node.port}" in r.getMessage()
               for r in caplog.records)


def test_a_killed_node_costs_only_its_own_keys_and_is_used_again_after_the_cooldown(
    private_cluster, breaker_clock, caplog
):
    caplog.set_level(logging.INFO, logger="storage.cluster_pipeline")
    timeout, cooldown = ANSWER_S, 0.5  # a killed node refuses at once: no call waits on it
    s = store(private_cluster.url, timeout_s=timeout, prefix="t-down:",
              breaker=BreakerConfig(failures=2, cooldown_s=cooldown))
    chain = [key(i) for i in range(30)]
    fresh = [key(i) for i in range(100, 130)]
    victim = not_first(private_cluster, s, chain)
    lost = on_node(private_cluster, victim, s, chain)
    lost_fresh = on_node(private_cluster, victim, s, fresh)
    assert 0 < sum(lost) < len(chain) and 0 < lost.index(True) and 0 < sum(lost_fresh)
    try:
        assert all(s.put_many((k, record(i)) for i, k in enumerate(chain)))
        victim.stop()  # SIGKILL
        for _ in range(3):
            start = time.perf_counter()
            got = s.get_many(chain)
            assert time.perf_counter() - start < timeout  # within the call's deadline
            assert all(r is None if gone else same(r, record(i))
                       for i, (r, gone) in enumerate(zip(got, lost)))
            assert s.contains_many(chain) == [not gone for gone in lost]
            assert s.longest_prefix(chain) == lost.index(True)  # stops at the dead node's first key
        stored = s.put_many((k, record(100 + i)) for i, k in enumerate(fresh))
        assert stored == [not gone for gone in lost_fresh]
        live = [k for k, gone in zip(fresh, lost_fresh) if not gone]
        assert sum(keys_on(n, s.prefix) for n in private_cluster.nodes if n is not victim) == (
            len(chain) - sum(lost) + len(live))  # the writes to the live nodes landed
        st = s.stats()
        assert st.puts == len(chain) + len(live) and st.dropped == sum(lost_fresh)
        assert st.entries == len(chain) - sum(lost) + len(live)  # SCAN of the nodes that are up
        assert s.available  # the live nodes answered: the store's breaker stays closed
        assert node_warnings(caplog, victim) == 1  # once per cooldown, naming the node
        victim.start()  # same port and nodes.conf: it rejoins with its slots, empty
        private_cluster.wait_ok()
        breaker_clock.now += cooldown
        assert s.get_many(chain)[lost.index(True)] is None  # back, and empty
        assert "answers again" in caplog.text
        assert all(s.put_many((k, record(i)) for i, k in enumerate(chain)))
        assert all(s.put_many((k, record(100 + i)) for i, k in enumerate(fresh)))
        assert all(same(r, record(i)) for i, r in enumerate(s.get_many(chain)))
        assert keys_on(victim, s.prefix) == sum(lost) + sum(lost_fresh)
    finally:
        s.close()


def test_a_frozen_node_costs_its_keys_one_deadline_and_then_nothing(
    private_cluster, breaker_clock, caplog
):
    timeout, cooldown = SILENT_S, 1.0
    s = store(private_cluster.url, timeout_s=timeout, prefix="t-down:",
              breaker=BreakerConfig(failures=2, cooldown_s=cooldown))
    chain = [key(i) for i in range(24)]
    victim = private_cluster.nodes[2]
    lost = on_node(private_cluster, victim, s, chain)
    try:
        assert all(s.put_many((k, record(i)) for i, k in enumerate(chain)))
        victim.pause()  # frozen: connections open, no reply
        start = time.perf_counter()
        assert s.contains_many(chain) == [not gone for gone in lost]
        assert time.perf_counter() - start < 2 * timeout  # the deadline of the whole call
        start = time.perf_counter()
        for _ in range(20):  # down: skipped, no waiting on it
            got = s.get_many(chain)
            assert [r is None for r in got] == lost
        assert time.perf_counter() - start < 20 * timeout / 2
        assert node_warnings(caplog, victim) == 1
        victim.resume()
        breaker_clock.now += cooldown
        assert all(same(r, record(i)) for i, r in enumerate(s.get_many(chain)))
        assert s.stats().corrupt == 0
    finally:
        s.close()


def test_the_store_breaker_opens_only_when_no_node_answers(
    private_cluster, breaker_clock, monkeypatch, caplog
):
    s = store(private_cluster.url, prefix="t-down:", breaker=BreakerConfig(failures=2, cooldown_s=0.5))
    chain = [key(i) for i in range(30)]
    victim = private_cluster.nodes[0]  # the URL's node
    assert not_first(private_cluster, s, chain) is victim
    lost = on_node(private_cluster, victim, s, chain)
    only_lost = [k for k, gone in zip(chain, lost) if gone]
    try:
        assert all(s.put_many((k, record(i)) for i, k in enumerate(chain)))
        victim.stop()
        assert s.longest_prefix(chain) == lost.index(True) and s.available
        assert s.get_many(only_lost) == [None] * len(only_lost)  # no node answered: 1
        assert s.contains_many(only_lost) == [False] * len(only_lost)  # 2: open
        assert not s.available and "breaker open" in caplog.text
        network = watch_network(monkeypatch, s)
        for _ in range(50):
            assert s.get(chain[0]) is None and s.longest_prefix(chain) == 0
        assert network == []  # open: no network
        breaker_clock.now += 0.5
        assert s.available
        # The probe rebuilds the client from a node that answers (the URL's node is dead).
        assert s.contains_many(chain) == [not gone for gone in lost]
        assert s.available
    finally:
        s.close()


def test_slots_that_move_off_a_dead_node_are_sent_to_their_new_owner(private_cluster):
    """Kill a node, then hand its slots to another (as a failover would): once the node is
    down the client reads the slot map again, and its keys go to the new owner."""
    s = store(private_cluster.url, prefix="t-down:", breaker=BreakerConfig(failures=2, cooldown_s=60))
    chain = [key(i) for i in range(30)]
    heir, victim, other = private_cluster.nodes
    lost = on_node(private_cluster, victim, s, chain)
    clients = [heir.client(), other.client()]
    try:
        assert all(s.put_many((k, record(i)) for i, k in enumerate(chain)))
        victim.stop()
        assert s.contains_many(chain) == [not gone for gone in lost]
        heir_id = clients[0].execute_command("CLUSTER MYID")
        for client in clients:
            pipe = client.pipeline(transaction=False)
            for slot in range(SLOTS // 3, 2 * SLOTS // 3):
                pipe.execute_command("CLUSTER SETSLOT", slot, "NODE", heir_id)
            pipe.execute()
        assert s.contains_many(chain) == [not gone for gone in lost]  # moved, empty
        assert all(s.put_many((k, record(i)) for i, k in enumerate(chain)))
        assert all(same(r, record(i)) for i, r in enumerate(s.get_many(chain)))
    finally:
        for client in clients:
            client.close()
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
        tier_stores, "RemoteStore", functools.partial(RemoteStore, breaker=breaker)
    )
    # A stopped node refuses connections at once, so the deadline is not what this test
    # is about; a short one turned a busy moment on a loaded 2-core machine into misses.
    tiers = remote(private_cluster.url, remote_timeout_s=5.0)

    def cached_tokens(llm: LLM) -> int:
        """Serve PROMPTS[0], then FLUSH so that the engine's own cache cannot serve it next."""
        out = llm.generate(PROMPTS[0], GREEDY)[0]
        assert out.token_ids == reference[0]
        llm.generate(FLUSH, GREEDY)
        return out.num_cached_tokens

    with make_llm(tiers) as a:
        a.generate(PROMPTS[0], GREEDY)
        assert a.engine.connector.flush(30)
    spread = [keys_on(node, tiers.remote_prefix) for node in private_cluster.nodes]
    assert sum(spread) >= hit_tokens(PROMPTS[0]) // BLOCK, f"blocks per node: {spread}"
    victim = max(private_cluster.nodes, key=lambda n: keys_on(n, tiers.remote_prefix))
    with make_llm(tiers) as b:
        assert cached_tokens(b) == hit_tokens(PROMPTS[0])
        victim.stop()
        # The chain's blocks up to the first on the dead node hit; the rest are recomputed.
        assert all(cached_tokens(b) < hit_tokens(PROMPTS[0]) for _ in range(3))
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
    from storage.remote_url import is_cluster_url

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
