"""Helpers shared by the engine tests: a one-thread fixture, sequences, an in-memory connector."""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence as Seq

import pytest
import torch

from engine.connector import FinishedTransfers, KVConnector, SavedBlock
from engine.hashing import root_hash
from engine.models.tiny import write_tiny_tokenizer
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence

NAMESPACE = bytes(32)


@pytest.fixture(scope="module")
def reference_llama(tmp_path_factory):
    """``(path, model)``: :func:`write_reference_llama` in a fresh folder, once a module."""
    path = tmp_path_factory.mktemp("hf-llama")
    return path, write_reference_llama(path)


def random_prompts(lengths: Seq[int], seed: int) -> list[list[int]]:
    """Prompts of random byte tokens, one of each length."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def write_reference_llama(path):
    """A tiny random Llama checkpoint written by ``transformers`` (with the tiny byte-level
    tokenizer) to ``path``, for tests that hold the engine to it; returns the model."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=264,  # the tiny byte-level tokenizer's
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=0.1,  # wide enough logits that greedy has no near-ties
        bos_token_id=256,
        eos_token_id=257,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    write_tiny_tokenizer(path)
    return model


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Run torch on one thread: on a small shared VM two OpenMP threads stall each other
    on every tiny op, which makes tiny-model steps ~30x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def hold_steps(monkeypatch, engine, after: int = 0, hold_s: float = 30.0) -> threading.Event:
    """Let ``engine`` take ``after`` more steps, then hold it until the returned event is set
    (or ``hold_s`` has passed, so that a test of broken code fails instead of hanging): a
    held step computes nothing and returns no outputs, while an ``AsyncLLM``'s thread still
    takes in adds and aborts and refreshes its stats. How far a request gets before the test
    acts is then up to the test, not to how fast the engine is next to its consumer."""
    release = threading.Event()
    step, taken = engine.step, [0]
    deadline = time.monotonic() + hold_s

    def held_step():
        if taken[0] >= after and not release.is_set() and time.monotonic() < deadline:
            release.wait(0.005)
            return []
        taken[0] += 1
        return step()

    monkeypatch.setattr(engine, "step", held_step)
    return release


def make_seq(
    token_ids: Seq[int],
    request_id: str = "r",
    *,
    block_size: int = 4,
    params: SamplingParams | None = None,
    cache_salt: str | None = None,
) -> Sequence:
    return Sequence(
        request_id,
        list(token_ids),
        params or SamplingParams(),
        block_size=block_size,
        root_hash=root_hash(NAMESPACE, cache_salt),
        generator=torch.Generator().manual_seed(0),
        cache_salt=cache_salt,
    )


def scheduler_step(s: Scheduler, max_tokens: int = 1000) -> SchedulerOutput:
    """What an engine step does to a scheduler, without the model: take in the connector's
    finished transfers, then schedule and complete one step, sampling token 7 wherever a
    step finishes the tokens (and finishing a sequence at ``max_tokens``)."""
    if s.connector is not None:
        s.apply_transfers(s.connector.poll())
    out = s.schedule()
    s.complete_step(out)
    for seq, _ in out.scheduled:
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
            if seq.num_output_tokens >= max_tokens:
                s.finish(seq, "length")
    return out


class MemoryConnector(KVConnector):
    """Keeps saved blocks in a dict (``store``, shareable between instances) keyed by
    (namespace, hash), and moves bytes as late as the protocol allows: a load scribbles
    over its blocks at once and writes the real KV only in the poll that reports it; a save
    reads its block only in the poll that reports it. An engine that touched a block too
    early would compute, or store, wrong KV.

    ``load_delay_polls`` / ``save_delay_polls``: polls that report nothing about a transfer
    before the one that reports it. ``lookup_delay_steps``: how many times a request's
    lookup answers ``None`` (still looking) before it answers. ``load_limit`` caps how many blocks a load fills (the
    rest keep the garbage); ``fail_loads`` fills none. ``defer_saves``: a save waits (as for
    room below) until :meth:`release_held` gives it up, unstored (``released``).
    ``load_seconds_per_block``: what :meth:`estimate_load_seconds` answers, per block.
    """

    def __init__(
        self,
        store: dict | None = None,
        *,
        fail_loads: bool = False,
        load_limit: int | None = None,
        load_delay_polls: int = 0,
        save_delay_polls: int = 0,
        lookup_delay_steps: int = 0,
        defer_saves: bool = False,
        load_seconds_per_block: float | None = None,
    ) -> None:
        self.store: dict[tuple[bytes, bytes], tuple[SavedBlock, torch.Tensor]] = (
            {} if store is None else store
        )
        self.fail_loads = fail_loads
        self.load_limit = load_limit
        self.load_delay_polls = load_delay_polls
        self.lookup_delay_steps = lookup_delay_steps
        self.lookups_asked: dict[str, int] = {}
        self.save_delay_polls = save_delay_polls
        self.defer_saves = defer_saves
        self.load_seconds_per_block = load_seconds_per_block
        self._deferred: list[SavedBlock] = []
        self.released: list[int] = []  # block ids of deferred saves given up
        self.kv_cache: torch.Tensor | None = None
        self.namespace: bytes | None = None
        self.saved: list[SavedBlock] = []  # offered to save_blocks, in order
        self.loads: list[tuple[str, list[bytes], list[int]]] = []  # started
        self.loaded: list[tuple[str, int]] = []  # reported: request id, blocks filled
        self.queries: list[tuple[str, int, int]] = []
        self.polls: list[float] = []  # the timeout of each poll
        self.evicted: list[bytes] = []
        self.finished: list[str] = []
        self.closed = False
        self._loads: list[list] = []  # [polls left, (request id, hashes, block ids)]
        self._saves: list[list] = []  # [polls left, SavedBlock]
        self._released: list[int] = []  # given up, reported by the next poll

    @property
    def num_in_flight(self) -> int:
        return len(self._loads) + len(self._saves) + len(self._deferred)

    def register_kv_cache(self, kv_cache: torch.Tensor, namespace: bytes, block_size: int) -> None:
        self.kv_cache, self.namespace, self.block_size = kv_cache, namespace, block_size

    def get_num_matched_blocks(self, request_id, block_hashes, num_computed_blocks) -> int | None:
        self.lookups_asked[request_id] = self.lookups_asked.get(request_id, 0) + 1
        if self.lookups_asked[request_id] <= self.lookup_delay_steps:
            self.queries.append((request_id, len(block_hashes), num_computed_blocks))
            return None  # still looking
        count = 0
        for h in block_hashes[num_computed_blocks:]:
            if (self.namespace, h) not in self.store:
                break
            count += 1
        self.queries.append((request_id, len(block_hashes), num_computed_blocks))
        return count

    def estimate_load_seconds(self, request_id, num_blocks) -> float | None:
        per_block = self.load_seconds_per_block
        return None if per_block is None else per_block * num_blocks

    def start_load(self, request_id, block_hashes, block_ids, cache_salt=None) -> None:
        load = (request_id, list(block_hashes), list(block_ids))
        self.loads.append(load)
        for b in block_ids:
            self.kv_cache[b] = 1e4  # KV that must never be used
        self._loads.append([self.load_delay_polls, load])

    def save_blocks(self, blocks: Seq[SavedBlock]) -> None:
        self.saved += blocks
        if self.defer_saves:
            self._deferred += blocks
        else:
            self._saves += [[self.save_delay_polls, block] for block in blocks]

    def poll(self, timeout: float = 0.0) -> FinishedTransfers:
        self.polls.append(timeout)
        loaded = {}
        for request_id, hashes, block_ids in _due(self._loads):
            count = 0 if self.fail_loads else len(hashes)
            if self.load_limit is not None:
                count = min(count, self.load_limit)
            for h, b in zip(hashes[:count], block_ids[:count]):
                self.kv_cache[b] = self.store[(self.namespace, h)][1]
            loaded[request_id] = count
            self.loaded.append((request_id, count))
        saved = [self._copy_out(block) for block in _due(self._saves)]
        saved += self._released
        self._released = []
        return FinishedTransfers(loaded, saved)

    def release_held(self) -> None:
        self._released += [block.block_id for block in self._deferred]
        self.released += self._released
        self._deferred = []

    def on_blocks_evicted(self, block_hashes) -> None:
        self.evicted += list(block_hashes)

    def request_finished(self, request_id: str) -> None:
        self.finished.append(request_id)

    def close(self) -> None:
        for _, block in self._saves:
            self._copy_out(block)
        self._loads, self._saves, self._deferred = [], [], []
        self.closed = True

    def _copy_out(self, block: SavedBlock) -> int:
        data = self.kv_cache[block.block_id].clone()  # [L, 2, block_size, H, D]
        self.store[(self.namespace, block.block_hash)] = (block, data)
        return block.block_id


def _due(pending: list[list]) -> list:
    """Count a poll against each ``[polls left, item]``; take out and return the items due."""
    due = [item for left, item in pending if left == 0]
    pending[:] = [[left - 1, item] for left, item in pending if left > 0]
    return due


def fail_detokenizing(monkeypatch, marked, at_call: int, message: str = "detokenizer broke") -> None:
    """Make detokenizing the requests ``marked(params)`` picks raise ``RuntimeError(message)``
    at the detokenizer's ``at_call``-th output token (the prompt tokens it is primed with
    are not counted), so ``at_call - 1`` tokens come out before the failure."""
    from engine.output_processor import OutputProcessor

    real = OutputProcessor._detokenizer

    def detokenizer(self, prompt_token_ids, params):
        detokenizer = real(self, prompt_token_ids, params)
        if marked(params):
            add, count = detokenizer.add, [0]

            def failing_add(token_id):
                count[0] += 1
                if count[0] == at_call:
                    raise RuntimeError(message)
                return add(token_id)

            detokenizer.add = failing_add
        return detokenizer

    monkeypatch.setattr(OutputProcessor, "_detokenizer", detokenizer)
