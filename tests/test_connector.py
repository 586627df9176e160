"""The KV connector contract, driven by an in-memory connector on the tiny model."""
from __future__ import annotations

import dataclasses

import pytest

from engine import LLM, SamplingParams
from engine.connector import KVConnector
from engine.hashing import hash_blocks, root_hash
from engine_testing import MemoryConnector, one_thread  # noqa: F401  (autouse fixture)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [
    "A document that several requests share, long enough for a few blocks. " * 2,
    "Another, different document: the connector keeps both of them around. " * 2,
]


def make_llm(connector: KVConnector | None, **kw) -> LLM:
    blocks = kw.pop("blocks", 64)
    return LLM(
        max_model_len=256, num_gpu_blocks_override=blocks, kv_connector=connector, device="cpu", **kw
    )


@pytest.fixture(scope="module")
def reference():
    with make_llm(None, enable_prefix_caching=False) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def saved_store():
    """A store holding the saved blocks of both prompts; copy it before use."""
    store: dict = {}
    with make_llm(MemoryConnector(store)) as llm:
        llm.generate(PROMPTS, GREEDY)
    return store


def test_connector_is_registered_with_the_cache_and_namespace():
    conn = MemoryConnector()
    with make_llm(conn) as llm:
        engine = llm.engine
        assert conn.kv_cache is engine.model_runner.kv_cache
        assert conn.namespace == engine.namespace and len(conn.namespace) == 32
        assert conn.block_size == 16
    assert conn.closed


def test_full_blocks_are_saved_with_their_chain(reference):
    conn = MemoryConnector()
    with make_llm(conn) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == reference
        ns = llm.engine.namespace
    assert sorted(conn.finished) == sorted(o.request_id for o in outs)
    for out in outs:
        tokens = out.prompt_token_ids + out.token_ids
        # The last token has no KV: it was sampled, never fed back.
        chain = hash_blocks(root_hash(ns), tokens[: len(tokens) - 1], 16)
        saved = [b for b in conn.saved if b.block_hash in set(chain)]
        assert [b.block_hash for b in saved] == chain
        for i, block in enumerate(saved):
            assert block.parent_hash == (chain[i - 1] if i else None)
            assert list(block.token_ids) == tokens[16 * i : 16 * (i + 1)]
            assert block.is_prompt == (16 * (i + 1) <= len(out.prompt_token_ids))
        assert any(not b.is_prompt for b in saved)  # decoded blocks are offered too


def test_a_fresh_engine_loads_saved_blocks_and_matches(reference):
    store: dict = {}
    with make_llm(MemoryConnector(store)) as first:
        first.generate(PROMPTS, GREEDY)
    conn = MemoryConnector(store)
    with make_llm(conn) as second:
        outs = second.generate(PROMPTS, GREEDY)
        stats = second.engine.stats()
    assert [o.token_ids for o in outs] == reference
    for out in outs:
        assert out.num_cached_tokens == (len(out.prompt_token_ids) - 1) // 16 * 16 > 0
    assert stats.connector_hits == sum(o.num_cached_tokens for o in outs)
    assert stats.prefix_cache_hits == 0 and stats.connector_load_failures == 0
    assert len(conn.loads) == 2
    # Loaded blocks enter the GPU prefix cache: a third run hits on the GPU, loads nothing.
    with make_llm(conn) as third:
        third.generate(PROMPTS[0], GREEDY)
        again = third.generate(PROMPTS[0], GREEDY)[0]
        assert third.engine.stats().prefix_cache_hits == again.num_cached_tokens > 0


def test_blocks_evicted_from_a_tiny_pool_come_back_through_the_connector(reference):
    conn = MemoryConnector()
    with make_llm(conn, blocks=16) as llm:
        first = llm.generate(PROMPTS[0], GREEDY)[0]
        llm.generate(PROMPTS[1], GREEDY)  # needs most of the pool: evicts the first's blocks
        assert conn.evicted
        loads_before = len(conn.loads)
        again = llm.generate(PROMPTS[0], GREEDY)[0]
        stats = llm.engine.stats()
    assert again.token_ids == first.token_ids == reference[0]
    assert again.num_cached_tokens == (len(first.prompt_token_ids) - 1) // 16 * 16
    assert len(conn.loads) == loads_before + 1 and stats.connector_hits > 0


def test_gpu_hit_first_then_connector_for_the_rest():
    conn = MemoryConnector()
    with make_llm(conn) as llm:
        llm.generate(PROMPTS[0], GREEDY)
    with make_llm(conn) as llm:
        prefix = llm.tokenizer.encode(PROMPTS[0])[:40]  # 2 full blocks + 8 tokens
        llm.generate(prefix, GREEDY)  # GPU now holds (loaded) blocks 0-1
        out = llm.generate(PROMPTS[0], GREEDY)[0]
    request_id, hashes, num_computed = conn.queries[-1]
    assert num_computed == 2 and hashes == len(out.prompt_token_ids) // 16
    load_request, load_hashes, _ = conn.loads[-1]
    assert load_request == out.request_id
    # Cached tokens count both: the GPU hit and what was loaded after it.
    assert out.num_cached_tokens == (len(out.prompt_token_ids) - 1) // 16 * 16
    assert len(load_hashes) == out.num_cached_tokens // 16 - 2


def test_a_failed_load_is_recomputed_with_identical_output(reference):
    store: dict = {}
    with make_llm(MemoryConnector(store)) as first:
        first.generate(PROMPTS, GREEDY)
    failing = MemoryConnector(store, fail_loads=True)
    with make_llm(failing) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        stats = llm.engine.stats()
        assert [o.token_ids for o in outs] == reference
        assert all(o.num_cached_tokens == 0 for o in outs)
        assert stats.connector_load_failures == 2 and stats.connector_hits == 0
        # The failed blocks were not entered in the prefix cache; a rerun hits only what
        # the recompute itself cached.
        again = llm.generate(PROMPTS[0], GREEDY)[0]
        assert again.token_ids == reference[0]


def test_a_request_loads_while_the_others_keep_decoding(reference, saved_store):
    conn = MemoryConnector(dict(saved_store), load_delay_polls=4)
    with make_llm(conn) as llm:
        engine = llm.engine
        longer = dataclasses.replace(GREEDY, max_tokens=30)
        busy = engine.add_request("Something else entirely.", longer)
        engine.step()
        loader = engine.add_request(PROMPTS[0], GREEDY)
        final, busy_tokens_while_loading = {}, 0
        while engine.has_unfinished_requests():
            outs = engine.step()
            if engine.stats().num_loading:
                busy_tokens_while_loading += sum(o.request_id == busy for o in outs)
            final.update((o.request_id, o) for o in outs)
        stats = engine.stats()
    assert busy_tokens_while_loading == 5  # the steps of the 4 polls and of the load's start
    assert final[loader].token_ids == reference[0] and final[loader].num_cached_tokens == 128
    assert len(final[busy].token_ids) == 30
    assert set(conn.polls) == {0.0}  # there was always something to run: no step waited
    assert stats.num_used_blocks == 0  # the last saves were reported, their blocks released


def test_a_request_whose_lookup_is_pending_waits_and_the_ones_behind_it_run(
    reference, saved_store
):
    conn = MemoryConnector(dict(saved_store), lookup_delay_steps=3)
    with make_llm(conn) as llm:
        engine = llm.engine
        first = engine.add_request(PROMPTS[0], GREEDY)  # its lookup is slow
        behind = engine.add_request("Hi.", GREEDY)  # no full block: nothing to look up
        final, first_token_step, step = {}, {}, 0
        while engine.has_unfinished_requests():
            step += 1
            for o in engine.step():
                first_token_step.setdefault(o.request_id, step)
                final[o.request_id] = o
    assert first_token_step[behind] == 1  # not stuck behind the lookup
    assert first_token_step[first] > 4  # asked at steps 1-4, loaded in step 4
    assert conn.lookups_asked[first] == 4  # three "still looking", then the answer
    assert final[first].token_ids == reference[0] and final[first].num_cached_tokens == 128


def test_an_engine_with_only_pending_lookups_waits_on_poll_instead_of_failing(saved_store):
    conn = MemoryConnector(dict(saved_store), lookup_delay_steps=2)
    with make_llm(conn) as llm:
        out = llm.generate(PROMPTS[0], GREEDY)[0]
    assert out.num_cached_tokens == 128
    assert [t for t in conn.polls if t > 0]  # the steps with nothing to run waited


def test_a_partial_load_recomputes_the_rest(reference, saved_store):
    conn = MemoryConnector(dict(saved_store), load_limit=3)
    with make_llm(conn) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        stats = llm.engine.stats()
    assert [o.token_ids for o in outs] == reference
    assert [o.num_cached_tokens for o in outs] == [48, 48]
    assert (stats.connector_hits, stats.connector_load_failures) == (96, 2)
    assert len(conn.loads) == 2


def test_loads_work_without_prefix_caching(reference, saved_store):
    conn = MemoryConnector(dict(saved_store), load_delay_polls=1)
    with make_llm(conn, enable_prefix_caching=False) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        stats = llm.engine.stats()
    assert [o.token_ids for o in outs] == reference
    assert [o.num_cached_tokens for o in outs] == [128, 128]
    assert stats.connector_hits == 256 and stats.num_cached_blocks == 0


def test_saved_blocks_are_not_reused_before_the_connector_read_them(reference):
    store: dict = {}
    conn = MemoryConnector(store, save_delay_polls=20)  # reads a block only when reporting it
    with make_llm(conn, blocks=16) as llm:
        first = llm.generate(PROMPTS[0], GREEDY)[0]
        engine = llm.engine
        # 9 full blocks offered, none reported yet: all held, though no request uses them.
        assert engine.stats().num_used_blocks == 9 and engine.has_unfinished_requests()
        second = llm.generate(PROMPTS[1], GREEDY)[0]  # needs 9 blocks, 7 are free: it waits
        assert max(conn.polls) > 0
    assert [first.token_ids, second.token_ids] == reference
    # What the connector read is each block's own KV: a fresh engine loads it and matches.
    with make_llm(MemoryConnector(store)) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert [o.num_cached_tokens for o in outs] == [128, 128]


def test_saves_waiting_for_room_below_are_released_when_the_engine_is_short_of_blocks(
    reference,
):
    """A connector whose saves wait (its buffer is full) holds the engine's blocks; the
    engine, short of blocks, asks it to let go instead of waiting on it, so every request
    runs (an engine that only waited would never get those blocks back)."""
    conn = MemoryConnector(defer_saves=True)
    with make_llm(conn, blocks=16) as llm:
        first = llm.generate(PROMPTS[0], GREEDY)[0]
        assert not conn.released  # nothing was short: the 9 offered blocks stay held
        assert llm.engine.stats().num_used_blocks == 9
        engine = llm.engine
        engine.add_request(PROMPTS[1], GREEDY, request_id="second")  # needs 9 blocks, 7 free
        outs = {}
        for _ in range(100):  # without the release it would wait forever
            outs.update((o.request_id, o) for o in engine.step())
            if "second" in outs and outs["second"].finished:
                break
        second = outs.get("second")
        assert second is not None and second.finished, "the engine waited on held saves"
        assert conn.released[:9] == [b.block_id for b in conn.saved[:9]]
        assert conn.store == {}  # given up: nothing was stored
    assert [first.token_ids, second.token_ids] == reference


def test_an_aborted_load_frees_its_blocks_once_reported(reference, saved_store):
    conn = MemoryConnector(dict(saved_store), load_delay_polls=3)
    with make_llm(conn) as llm:
        engine = llm.engine
        request_id = engine.add_request(PROMPTS[0], GREEDY)
        assert engine.step() == [] and engine.stats().num_loading == 1
        out = engine.abort_request(request_id)
        assert out.finish_reason == "abort" and out.token_ids == []
        assert conn.finished == [request_id] and engine.stats().num_loading == 0
        assert engine.stats().num_used_blocks == 8 and engine.has_unfinished_requests()
        while engine.has_unfinished_requests():
            assert engine.step() == []
        assert engine.stats().num_used_blocks == 0
        again = llm.generate(PROMPTS[0], GREEDY)[0]  # the loaded blocks stayed in the cache
        stats = engine.stats()
    assert again.token_ids == reference[0] and again.num_cached_tokens == 128
    assert stats.prefix_cache_hits == 128 and stats.connector_hits == 0
    assert len(conn.loads) == 1


class RaisingConnector(MemoryConnector):
    def start_load(self, request_id, block_hashes, block_ids, cache_salt=None) -> None:
        raise RuntimeError("disk on fire")


def test_a_raising_load_counts_as_a_failure(reference):
    store: dict = {}
    with make_llm(MemoryConnector(store)) as first:
        first.generate(PROMPTS[0], GREEDY)
    with make_llm(RaisingConnector(store)) as llm:
        out = llm.generate(PROMPTS[0], GREEDY)[0]
        assert out.token_ids == reference[0] and out.num_cached_tokens == 0
        assert llm.engine.stats().connector_load_failures == 1


def test_salted_requests_use_their_own_chain(reference):
    conn = MemoryConnector()
    with make_llm(conn) as llm:
        llm.generate(PROMPTS[0], GREEDY, cache_salt="tenant-a")
    with make_llm(conn) as llm:
        other = llm.generate(PROMPTS[0], GREEDY, cache_salt="tenant-b")[0]
        same = llm.generate(PROMPTS[0], GREEDY, cache_salt="tenant-a")[0]
    assert other.num_cached_tokens == 0 and same.num_cached_tokens > 0
    assert other.token_ids == same.token_ids == reference[0]


def test_the_namespace_depends_on_the_cache_layout():
    a, b = MemoryConnector(), MemoryConnector()
    with make_llm(a), make_llm(b, block_size=32):
        pass
    assert a.namespace != b.namespace


def test_the_protocol_is_abstract():
    with pytest.raises(TypeError):
        KVConnector()  # type: ignore[abstract]
