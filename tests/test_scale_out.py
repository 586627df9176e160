"""docs/scale_out.md's recipes, with `tiered-kv serve` processes on loopback sharing a 3-node
Valkey/Redis Cluster: a prefix computed by one server is a hit on another; prefill on one
instance and decode on another through the shared tier; KV events a router subscribes to."""
from __future__ import annotations

import time

import httpx
import pytest
import zmq

from engine.kv_events import BlockStored, decode_batch
from redis_server import redis_cluster  # noqa: F401  (fixture)
from remote_testing import ANSWER_S
from server_testing import ServerProcess, free_port

ADMIN_KEY = "scale-out-admin-key"
SECRET = "the deployment's shared secret: " + "3c" * 16
BLOCK = 16


def prompt_ids(seed: int, blocks: int, extra: int = 5) -> list[int]:
    """A token-id prompt of ``blocks`` full blocks and ``extra`` more tokens."""
    return [(seed * 7919 + i * 31) % 250 + 1 for i in range(blocks * BLOCK + extra)]


def complete(server: ServerProcess, prompt: list[int], max_tokens: int, salt: str | None = None) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def cached_tokens(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def flush(server: ServerProcess) -> None:
    """Every block the server stored so far is in the remote tier when this returns."""
    response = httpx.post(server.url + "/admin/flush", json={"timeout": 30}, timeout=60,
                          headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert response.status_code == 200 and response.json()["flushed"], response.text


@pytest.fixture(scope="module")
def events_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def servers(redis_cluster, tmp_path_factory, events_port):  # noqa: F811
    """Two servers sharing the cluster, each with its own CPU pool and no disk tier: A with
    the secret in a file and KV events on, B with the secret in the environment."""
    work = tmp_path_factory.mktemp("scale_out")
    secret_file = work / "kv_secret"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)
    common = ["--model", "tiny", "--max-model-len", "512", "--num-gpu-blocks-override", "96",
              "--kv-offloading-size", "0.01", "--kv-disk-size", "0",
              "--kv-remote-url", redis_cluster.url, "--kv-remote-timeout", str(ANSWER_S),
              "--admin-api-key", ADMIN_KEY, "--log-level", "warning"]
    events = ('{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:%d", "topic": "kv"}'
              % events_port)
    started: list[ServerProcess] = []
    try:
        started.append(ServerProcess(
            [*common, "--kv-secret-file", str(secret_file), "--kv-events-config", events],
            work / "a.log",
        ))
        started.append(ServerProcess(common, work / "b.log", {"TIERED_KV_SECRET": SECRET}))
        yield started
    finally:
        for server in started:
            server.kill()


def test_a_prefix_computed_by_one_server_is_a_hit_on_another(servers):
    a, b = servers
    prompt = prompt_ids(1, blocks=12)
    first = complete(a, prompt, 8)
    assert cached_tokens(first) == 0
    flush(a)
    again = complete(b, prompt, 8)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert cached_tokens(again) == 12 * BLOCK


def test_prefill_on_one_instance_and_decode_on_another(servers):
    """A router sends the prompt to A with max_tokens=1 (prefill), waits for A's blocks to
    reach the shared tier, then sends the whole request, with the same cache_salt, to B."""
    a, b = servers
    prompt = prompt_ids(2, blocks=10)
    single = complete(a, prompt, 16, salt="reference")  # what one server alone answers
    assert cached_tokens(single) == 0
    prefill = complete(a, prompt, 1, salt="tenant-1")
    assert prefill["usage"]["completion_tokens"] == 1 and cached_tokens(prefill) == 0
    flush(a)
    decode = complete(b, prompt, 16, salt="tenant-1")
    assert cached_tokens(decode) == 10 * BLOCK  # every full prompt block, restored from the tier
    assert decode["choices"][0]["text"] == single["choices"][0]["text"]
    assert decode["usage"]["completion_tokens"] == 16
    other_tenant = complete(b, prompt, 16, salt="tenant-2")  # another salt shares nothing
    assert cached_tokens(other_tenant) == 0
    assert other_tenant["choices"][0]["text"] == single["choices"][0]["text"]


def test_a_subscriber_sees_the_prompts_first_block_stored(servers, events_port):
    a, _ = servers
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{events_port}")
    try:
        # ZMQ's slow joiner: messages published before the subscription reaches the server
        # are lost. Send fresh one-block prompts until one's events arrive.
        deadline = time.monotonic() + 30
        probe = 100
        while not sub.poll(200):
            assert time.monotonic() < deadline, "no KV events from the server"
            probe += 1
            complete(a, prompt_ids(probe, blocks=1), 1)
        while sub.poll(500):  # what the probes caused
            sub.recv_multipart()
        prompt = prompt_ids(3, blocks=3)
        complete(a, prompt, 4)
        stored = []
        deadline = time.monotonic() + 10
        while not stored:
            assert time.monotonic() < deadline, "no BlockStored for the prompt"
            if not sub.poll(200):
                continue
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv" and len(seq) == 8
            stored += [e for e in decode_batch(payload).events
                       if isinstance(e, BlockStored) and e.token_ids[:BLOCK] == prompt[:BLOCK]]
    finally:
        sub.close(linger=0)
        context.term()
    event = stored[0]
    assert event.parent_block_hash is None and event.block_size == BLOCK and event.medium == "GPU"
    assert len(event.block_hashes) >= 3 and event.token_ids[: 3 * BLOCK] == prompt[: 3 * BLOCK]
    assert all(0 <= h < 1 << 64 for h in event.block_hashes)
