"""KV events (engine/kv_events.py): vLLM's wire format over a real ZMQ socket, matching what
the block pool caches and evicts, and replay of missed batches."""
from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from engine import LLM, SamplingParams
from engine.hashing import hash_blocks, root_hash
from engine.kv_events import END_SEQ, KVEventsConfig, decode_batch, external_hash
from engine_testing import one_thread  # noqa: F401  (autouse fixture)
from ports import free_port

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
BLOCK = 16


def _config(**extra) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{free_port()}",
                          topic="kv", **extra)


def _receive(sub: zmq.Socket, until, timeout_s: float = 10.0) -> list[tuple[int, list]]:
    """(seq, raw msgpack batch) messages until ``until(messages)`` holds."""
    messages: list[tuple[int, list]] = []
    deadline = time.monotonic() + timeout_s
    while not until(messages):
        assert time.monotonic() < deadline, f"timed out with {messages}"
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            messages.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
    return messages


def _drain(sub: zmq.Socket, idle_s: float = 0.5) -> list[tuple[int, list]]:
    """Every message until none came for ``idle_s``: the engine publishes each step's batch
    before its next step, so once ``generate`` returned, all are on their way."""
    messages: list[tuple[int, list]] = []
    while sub.poll(int(idle_s * 1000)):
        _, seq, payload = sub.recv_multipart()
        messages.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
    return messages


def _events(messages) -> list[list]:
    return [event for _, batch in messages for event in batch[1]]


@pytest.fixture
def subscribed():
    """An engine publishing to a SUB socket that is already connected."""
    config = _config(replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    with LLM(max_model_len=128, num_gpu_blocks_override=12, device="cpu",
             kv_events_config=config) as llm:
        sub.connect(config.endpoint)
        time.sleep(0.3)  # ZMQ's slow joiner: the subscription must reach the publisher
        yield llm, sub, config, context
    sub.close(linger=0)
    context.term()


def test_stored_blocks_are_published_in_vllm_format(subscribed):
    llm, sub, _, _ = subscribed
    prompt = list(range(1, 1 + 3 * BLOCK + 5))  # 3 full prompt blocks
    llm.generate(prompt, GREEDY)
    stored = []
    messages = _receive(sub, lambda m: sum(len(e[1]) for e in _events(m) if e[0] == "BlockStored") >= 3)
    for event in _events(messages):
        if event[0] == "BlockStored":
            stored.append(event)
    tag, hashes, parent, token_ids, block_size, lora_id, medium = stored[0]
    expected = hash_blocks(root_hash(llm.engine.namespace, None), prompt, BLOCK)
    assert hashes[:3] == [external_hash(h) for h in expected[:3]]
    assert parent is None and block_size == BLOCK and lora_id is None and medium == "GPU"
    assert token_ids[: 3 * BLOCK] == prompt[: 3 * BLOCK]
    assert [seq for seq, _ in messages] == sorted(seq for seq, _ in messages)
    # Each published hash is cached in the engine's pool right now.
    cached = {external_hash(h) for h in llm.engine.block_manager._cached}
    assert set(hashes) <= cached


def test_evicted_blocks_are_published_as_removed(subscribed):
    llm, sub, _, _ = subscribed
    # 12 blocks in the pool: four prompts of 3 blocks each must evict earlier ones.
    prompts = [[(7 * i + j) % 250 + 1 for j in range(3 * BLOCK)] for i in range(5)]
    for p in prompts:
        llm.generate(p, GREEDY)
    messages = _drain(sub)
    assert any(e[0] == "BlockRemoved" for e in _events(messages))
    live: set[int] = set()
    for event in _events(messages):
        if event[0] == "BlockStored":
            live |= set(event[1])
        elif event[0] == "BlockRemoved":
            assert set(event[1]) <= live, "removed a block never stored"
            live -= set(event[1])
    cached = {external_hash(h) for h in llm.engine.block_manager._cached}
    assert live == cached


def test_missed_batches_come_back_by_replay(subscribed):
    llm, sub, config, context = subscribed
    llm.generate(list(range(1, 1 + 2 * BLOCK)), GREEDY)
    live = _receive(sub, lambda m: len(m) >= 1)
    replay = context.socket(zmq.DEALER)  # a DEALER takes every reply frame of the request
    replay.connect(config.replay_endpoint)
    replay.send_multipart([b"", (0).to_bytes(8, "big")])
    replayed = []
    while True:
        assert replay.poll(10_000), "no replay answer"
        empty, seq, payload = replay.recv_multipart()
        assert empty == b""
        if seq == END_SEQ:
            assert payload == b""
            break
        replayed.append((int.from_bytes(seq, "big"), decode_batch(payload)))
    replay.close(linger=0)
    # Seq 0 is the AllBlocksCleared sent at start (published before anyone subscribed).
    assert replayed[0][0] == 0
    assert type(replayed[0][1].events[0]).__name__ == "AllBlocksCleared"
    assert [seq for seq, _ in replayed] == list(range(len(replayed)))
    assert {seq for seq, _ in live} <= {seq for seq, _ in replayed}


def test_config_parses_vllms_json_and_refuses_unknown_keys():
    config = KVEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"topic": "kv-events"}'
    )
    assert config.publishes and config.topic == "kv-events"
    with pytest.raises(ValueError, match="unknown kv_events_config keys"):
        KVEventsConfig.from_json('{"enable_kv_cache_event": true}')
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig.from_json('{"publisher": "kafka"}')
    with pytest.raises(ValueError, match="JSON"):
        KVEventsConfig.from_json("{")


def test_a_busy_endpoint_is_a_clear_error():
    config = _config()
    with LLM(max_model_len=64, num_gpu_blocks_override=8, device="cpu", kv_events_config=config):
        with pytest.raises(ValueError, match="cannot bind"):
            LLM(max_model_len=64, num_gpu_blocks_override=8, device="cpu", kv_events_config=config)
