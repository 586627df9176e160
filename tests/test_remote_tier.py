"""The remote tier behind the tier manager: engines that share a Valkey/Redis server share
their prefixes, tenants (cache salts) stay apart, and a dead server only costs hits."""
from __future__ import annotations

import functools
import threading
import time
import uuid

import pytest

from engine import LLM
from engine_testing import one_thread  # noqa: F401  (autouse fixture)
from redis_server import RedisServer, server_binary
from remote_testing import ANSWER_S, SECRET, SILENT_S
from storage.circuit_breaker import BreakerConfig
from storage.remote_store import RemoteStore
from tier_testing import BLOCK, FLUSH, GREEDY, PROMPTS, hit_tokens, make_llm
from tiered_kv import TierConfig, tier_stores
from tiered_kv.config import remote_seal_key
from tiered_kv.tier_manager import TierManager

@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    with LLM(max_model_len=256, enable_prefix_caching=False, device="cpu") as llm:
        return [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)]


def remote(url: str, **fields) -> TierConfig:
    """A remote tier with its own key prefix (tests share one server), no CPU pool."""
    fields.setdefault("cpu_bytes", 0)
    fields.setdefault("remote_timeout_s", ANSWER_S)
    fields.setdefault("remote_secret", SECRET)
    return TierConfig(remote_url=url, remote_prefix=f"t-{uuid.uuid4().hex}:", **fields)


def test_config_is_validated():
    for fields, message in [
        (dict(remote_url="http://h"), "start with"),
        (dict(remote_url="redis://h", remote_write_policy="write-back"), "remote_write_policy"),
        (dict(remote_url="redis://h", remote_timeout_s=0), "remote_timeout_s"),
        (dict(remote_url="redis://h", remote_ttl_s=0), "remote_ttl_s"),
    ]:
        with pytest.raises(ValueError, match=message):
            TierConfig(**fields)
    assert TierConfig(cpu_bytes=0, remote_url="valkey://h:6379/0").has_remote


def test_a_remote_tier_without_its_secret_fails_at_start_with_one_line(tmp_path):
    url = "redis://127.0.0.1:1/0"  # never contacted
    with pytest.raises(ValueError, match="--kv-secret-file FILE or TIERED_KV_SECRET") as err:
        TierManager(TierConfig(cpu_bytes=0, remote_url=url))
    assert "\n" not in str(err.value)
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    from_file = TierConfig(cpu_bytes=0, remote_url=url, remote_secret_file=secret_file)
    from_env = TierConfig(cpu_bytes=0, remote_url=url, remote_secret=SECRET)
    assert remote_seal_key(from_file) == remote_seal_key(from_env)
    assert SECRET not in repr(from_env) and SECRET not in repr(remote_seal_key(from_env))
    with pytest.raises(ValueError, match="given twice"):
        remote_seal_key(TierConfig(cpu_bytes=0, remote_url=url, remote_secret_file=secret_file,
                                   remote_secret=SECRET))
    with pytest.raises(ValueError, match="TIERED_KV_SECRET is 8 bytes") as err:
        remote_seal_key(TierConfig(cpu_bytes=0, remote_url=url, remote_secret="hunter22"))
    assert "hunter22" not in str(err.value)
    with pytest.raises(ValueError, match="no such file"):
        remote_seal_key(TierConfig(cpu_bytes=0, remote_url=url, remote_secret_file=tmp_path / "x"))


def test_a_second_engine_reuses_the_first_engines_prefix(redis_server, reference, tmp_path):
    a_tiers = remote(redis_server.url, cpu_bytes=4 << 20)
    with make_llm(a_tiers) as a:
        first = a.generate(PROMPTS[0], GREEDY)[0]
        assert a.engine.connector.flush(30)
        a_stats = a.engine.connector.stats()
    assert first.num_cached_tokens == 0 and first.token_ids == reference[0]
    assert a_stats["remote"]["stored_blocks"] >= hit_tokens(PROMPTS[0]) // BLOCK
    # B: its own empty CPU pool and its own disk directory, the same server and prefix.
    b_tiers = TierConfig(
        kv_cache_dir=tmp_path / "b", cpu_bytes=4 << 20, disk_bytes=64 << 20,
        remote_url=redis_server.url, remote_prefix=a_tiers.remote_prefix, remote_timeout_s=ANSWER_S,
        remote_secret=SECRET,
    )
    with make_llm(b_tiers) as b:
        manager = b.engine.connector
        shared = b.generate(PROMPTS[0], GREEDY)[0]
        assert manager.flush(30)
        after_remote = manager.stats()
        b.generate(FLUSH, GREEDY)
        again = b.generate(PROMPTS[0], GREEDY)[0]
        stats = manager.stats()
    assert shared.token_ids == again.token_ids == reference[0]
    assert shared.num_cached_tokens == hit_tokens(PROMPTS[0]) > 0
    assert after_remote["remote"]["hit_blocks"] == hit_tokens(PROMPTS[0]) // BLOCK
    assert after_remote["remote"]["corrupt"] == after_remote["remote"]["load_failures"] == 0
    # Promoted on the remote hit: the second time the CPU pool serves it, and B's disk has it.
    assert stats["cpu"]["hit_blocks"] == hit_tokens(PROMPTS[0]) // BLOCK
    assert stats["remote"]["hit_blocks"] == after_remote["remote"]["hit_blocks"]
    assert after_remote["disk"]["stored_blocks"] >= hit_tokens(PROMPTS[0]) // BLOCK


def test_another_cache_salt_never_hits_the_remote_tier(redis_server, reference):
    tiers = remote(redis_server.url)
    with make_llm(tiers) as a:
        a.generate(PROMPTS[1], GREEDY, cache_salt="tenant-a")
        assert a.engine.connector.flush(30)
    with make_llm(tiers) as b:
        other = b.generate(PROMPTS[1], GREEDY, cache_salt="tenant-b")[0]
        same = b.generate(PROMPTS[1], GREEDY, cache_salt="tenant-a")[0]
        stats = b.engine.connector.stats()
    assert other.num_cached_tokens == 0 and other.token_ids == reference[1]
    assert same.num_cached_tokens == hit_tokens(PROMPTS[1]) and same.token_ids == reference[1]
    assert stats["remote"]["hit_blocks"] == hit_tokens(PROMPTS[1]) // BLOCK


def test_read_only_engines_do_not_write(redis_server):
    tiers = remote(redis_server.url, remote_write_policy="read-only", cpu_bytes=4 << 20)
    with make_llm(tiers) as llm:
        llm.generate(PROMPTS[0], GREEDY)
        manager = llm.engine.connector
        assert manager.flush(30)
        assert list(manager.stores()["remote"].keys()) == []
        assert manager.stats()["remote"]["stored_blocks"] == 0


def test_corrupt_remote_record_is_recomputed(redis_server, reference):
    tiers = remote(redis_server.url)
    with make_llm(tiers) as a:
        a.generate(PROMPTS[0], GREEDY)
        assert a.engine.connector.flush(30)
    client = redis_server.client()
    prefix = tiers.remote_prefix.encode()
    stored = sorted(client.scan_iter(match=prefix + b"*"))
    assert len(stored) >= hit_tokens(PROMPTS[0]) // BLOCK
    for kb in stored:
        client.set(kb, b"not a record")
    with make_llm(tiers) as b:
        again = b.generate(PROMPTS[0], GREEDY)[0]
        stats = b.engine.connector.stats()
    assert again.token_ids == reference[0] and again.num_cached_tokens == 0
    assert stats["remote"]["corrupt"] >= 1 and stats["remote"]["load_failures"] >= 1


def test_a_dead_server_costs_hits_not_requests(tmp_path, reference):
    binary = server_binary()
    if binary is None:
        pytest.skip("no valkey-server or redis-server binary (CI installs redis-server)")
    server = RedisServer(binary, tmp_path / "redis")
    (tmp_path / "redis").mkdir()
    server.start()
    server.stop()
    tiers = remote(server.url, kv_cache_dir=tmp_path / "kv", cpu_bytes=4 << 20,
                   remote_timeout_s=0.05)
    with make_llm(tiers) as llm:
        outs = [llm.generate(PROMPTS[0], GREEDY)[0] for _ in range(3)]
        stats = llm.engine.connector.stats()
    assert all(o.token_ids == reference[0] for o in outs)
    assert stats["remote"]["hit_blocks"] == 0
    assert stats["remote"]["dropped"] >= 1
    assert stats["disk"]["stored_blocks"] >= hit_tokens(PROMPTS[0]) // BLOCK


def test_server_restart_resumes_hits(tmp_path, reference):
    binary = server_binary()
    if binary is None:
        pytest.skip("no valkey-server or redis-server binary (CI installs redis-server)")
    (tmp_path / "redis").mkdir()
    server = RedisServer(binary, tmp_path / "redis")
    server.start()
    tiers = remote(server.url)
    try:
        with make_llm(tiers) as a:
            a.generate(PROMPTS[0], GREEDY)
            assert a.engine.connector.flush(30)
        server.stop()
        server.start()  # empty again (no persistence), same port
        with make_llm(tiers) as a:
            a.generate(PROMPTS[0], GREEDY)
            assert a.engine.connector.flush(30)
        with make_llm(tiers) as b:
            hit = b.generate(PROMPTS[0], GREEDY)[0]
        assert hit.num_cached_tokens == hit_tokens(PROMPTS[0]) and hit.token_ids == reference[0]
    finally:
        server.stop()


def test_hits_resume_after_the_server_was_frozen(tmp_path, reference, monkeypatch, caplog):
    """SIGSTOP the server under a read-only engine (no writes to probe for it): lookups time
    out, the breaker opens, requests are recomputed; after SIGCONT the lookup itself probes
    and the hits come back."""
    binary = server_binary()
    if binary is None:
        pytest.skip("no valkey-server or redis-server binary (CI installs redis-server)")
    server = RedisServer(binary, tmp_path)
    server.start()
    breaker = BreakerConfig(failures=2, cooldown_s=0.5)
    monkeypatch.setattr(
        tier_stores, "RemoteStore", functools.partial(RemoteStore, breaker=breaker)
    )
    writer = remote(server.url)
    reader = TierConfig(
        remote_url=server.url, remote_prefix=writer.remote_prefix, remote_timeout_s=SILENT_S,
        remote_write_policy="read-only", cpu_bytes=0, remote_secret=SECRET,
    )

    def cached_tokens(llm: LLM) -> int:
        """Serve PROMPTS[0], then FLUSH so that the engine's own cache cannot serve it next."""
        out = llm.generate(PROMPTS[0], GREEDY)[0]
        assert out.token_ids == reference[0]
        llm.generate(FLUSH, GREEDY)
        return out.num_cached_tokens

    try:
        with make_llm(writer) as a:
            a.generate(PROMPTS[0], GREEDY)
            assert a.engine.connector.flush(30)
        with make_llm(reader) as b:
            assert cached_tokens(b) == hit_tokens(PROMPTS[0])
            server.pause()
            assert [cached_tokens(b) for _ in range(3)] == [0, 0, 0]  # recomputed, not failed
            assert "breaker open" in caplog.text
            server.resume()
            resumed = time.monotonic()
            cached = cached_tokens(b)
            while cached == 0 and time.monotonic() - resumed < 5:
                cached = cached_tokens(b)
            stats = b.engine.connector.stats()
        assert cached == hit_tokens(PROMPTS[0]), "no remote hits 5 s after the server came back"
        assert stats["remote"]["hit_blocks"] == 2 * hit_tokens(PROMPTS[0]) // BLOCK
    finally:
        server.resume()
        server.stop()


def test_a_slow_remote_lookup_holds_only_its_request(redis_server, reference, monkeypatch):
    """The lookup runs on a lookup thread: while it hangs, another request keeps getting
    tokens, and once it answers, its request hits the remote tier."""
    tiers = remote(redis_server.url, cpu_bytes=4 << 20)
    with make_llm(tiers) as a:
        a.generate(PROMPTS[0], GREEDY)
        assert a.engine.connector.flush(30)
    entered, release = threading.Event(), threading.Event()
    longest_prefix = RemoteStore.longest_prefix

    def slow_longest_prefix(self, keys):
        entered.set()
        release.wait(30)
        return longest_prefix(self, keys)

    monkeypatch.setattr(RemoteStore, "longest_prefix", slow_longest_prefix)
    with make_llm(tiers) as b:
        engine = b.engine
        other = engine.add_request([7, 8, 9], GREEDY)  # no full block: nothing to look up
        waiting = engine.add_request(PROMPTS[0], GREEDY)
        tokens, outputs = {other: 0, waiting: 0}, {}
        while not entered.is_set() or tokens[other] < GREEDY.max_tokens:
            for out in engine.step():
                tokens[out.request_id] = len(out.token_ids)
                outputs[out.request_id] = out
        assert tokens[waiting] == 0  # still looking while the other one finished
        release.set()
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = out
    assert outputs[waiting].token_ids == reference[0]
    assert outputs[waiting].num_cached_tokens == hit_tokens(PROMPTS[0])
