"""KV-cache events in vLLM's format, published over ZMQ, for KV-aware routers.

A router that knows which instance holds which prefix sends each request where its KV is
(llm-d's precise prefix scorer, NVIDIA Dynamo's KV router). vLLM publishes what its block
pool caches and evicts; this engine publishes the same messages, so those routers work
unchanged:

- each engine step that cached or evicted blocks sends one ``KVEventBatch`` as a 3-frame
  message ``[topic, seq (8 bytes, big-endian, from 0), msgpack(batch)]`` on a PUB socket;
- a batch is ``[ts, [event, ...]]``; an event is a tagged array:
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``,
  ``["BlockRemoved", block_hashes, medium]`` or ``["AllBlocksCleared"]``;
- a block hash is the low 64 bits of the block's 32-byte key, as an unsigned integer (vLLM's
  default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``); the first block of a prompt has no
  parent (``None``); ``medium`` is ``"GPU"``;
- the engine sends ``AllBlocksCleared`` first, so a router drops what it knew of an earlier
  life of this instance;
- with a ``replay_endpoint``, a ROUTER socket resends the last ``buffer_steps`` batches from a
  requested seq: request ``[8-byte start seq]``, replies ``[seq, payload]`` then the end
  marker ``[-1 as 8 signed bytes, b""]``.

Configured as vLLM's ``--kv-events-config`` JSON (:meth:`KVEventsConfig.from_json`).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Sequence as Seq
from typing import Any, Union

import msgspec
import zmq

from engine.json_config import from_json

logger = logging.getLogger(__name__)

MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_MS = 50


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` fields, with its defaults."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"  # or "null": events are collected but not sent
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("enable_kv_cache_events must be true or false")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError("replay_endpoint must be a string or null")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse ``--kv-events-config``; ``ValueError`` names what is wrong."""
        return from_json(cls, text, "kv_events_config")


class BlockStored(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    block_hashes: list[int]
    parent_block_hash: Union[int, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None]


class BlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    block_hashes: list[int]
    medium: Union[str, None]


class AllBlocksCleared(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: Union[int, None] = None


def external_hash(block_hash: bytes) -> int:
    """A block key as routers see it: its low 64 bits, big-endian."""
    return int.from_bytes(block_hash[-8:], "big")


class KVEventLog:
    """The events of one engine step, collected by the block manager (engine thread only)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVEvent] = []

    def stored(self, block_hashes: Seq[bytes], parent: bytes | None, token_ids: Seq[int]) -> None:
        """Consecutive blocks of one sequence entered the prefix cache."""
        self._events.append(BlockStored(
            [external_hash(h) for h in block_hashes],
            None if parent is None else external_hash(parent),
            list(token_ids), self.block_size, None, MEDIUM,
        ))

    def removed(self, block_hashes: Seq[bytes]) -> None:
        self._events.append(BlockRemoved([external_hash(h) for h in block_hashes], MEDIUM))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events


class ZmqEventPublisher:
    """Sends batches from its own thread, which owns the sockets (ZMQ sockets are not
    thread-safe). :meth:`publish` never blocks the engine: past ``max_queue_size`` waiting
    batches, a batch is dropped and counted (``dropped``); a subscriber that falls behind
    loses messages past ``hwm`` at the socket, and can ask for them again by replay."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self.dropped = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=config.max_queue_size)
        self._context = zmq.Context()
        self._pub = self._bind(zmq.PUB, config.endpoint)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._replay = None
        if config.replay_endpoint is not None:
            self._replay = self._bind(zmq.ROUTER, config.replay_endpoint)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=config.buffer_steps
        )
        self._thread = threading.Thread(target=self._run, name="tiered-kv-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        payload = self._encoder.encode(KVEventBatch(time.time(), events))
        try:
            self._queue.put_nowait(payload)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning(
                    "KV events: %d batches dropped, the publisher queue is full "
                    "(raise max_queue_size in --kv-events-config)", self.dropped,
                )

    def close(self) -> None:
        """Send what is queued, then close the sockets. Idempotent."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._context.term()

    def _bind(self, kind: int, endpoint: str) -> zmq.Socket:
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.bind(endpoint)
        except zmq.ZMQError as e:
            socket.close()
            self._context.term()
            raise ValueError(f"KV events: cannot bind {endpoint!r}: {e}") from None
        return socket

    def _run(self) -> None:
        topic = self.config.topic.encode()
        seq = 0
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    payload = self._queue.get(timeout=_POLL_MS / 1000)
                except queue.Empty:
                    continue
                if payload is None:
                    return
                self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                seq += 1
        finally:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            logger.warning("KV events: malformed replay request of %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch as a subscriber decodes it (tests, tools)."""
    return msgspec.msgpack.decode(payload, type=KVEventBatch)


def as_plain(batch: KVEventBatch) -> Any:
    """The batch's msgpack structure as plain Python values."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
