"""An overlapped load: with nothing else to run, a long connector hit recomputes its head
while its tail loads, and the output is the same as recomputing everything."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import LLM, SamplingParams
from engine.hashing import hash_blocks, root_hash
from engine.prefill_cost import PrefillCost
from engine_testing import MemoryConnector, one_thread  # noqa: F401  (autouse fixture)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = "A document that several requests share, long enough for a few blocks. " * 2
BS = 16


def make_llm(
    connector: MemoryConnector | None, *, per_token: float | None = None, fixed: float = 0.0, **kw
) -> LLM:
    kw.setdefault("max_model_len", 256)
    llm = LLM(num_gpu_blocks_override=kw.pop("blocks", 64), kv_connector=connector,
              device="cpu", **kw)
    llm.engine.scheduler.prefill_cost = None if per_token is None else PrefillCost(fixed, per_token)
    return llm


@pytest.fixture(scope="module")
def reference():
    with make_llm(None, enable_prefix_caching=False) as llm:
        return llm.generate(PROMPT, GREEDY)[0].token_ids


@pytest.fixture(scope="module")
def saved_store():
    store: dict = {}
    with make_llm(MemoryConnector(store)) as llm:
        llm.generate(PROMPT, GREEDY)
    return store


def hashes_of(llm: LLM, prompt: str) -> list[bytes]:
    engine = llm.engine
    ids = engine.tokenizer.encode(prompt)
    return hash_blocks(root_hash(engine.namespace), ids, BS)


def test_the_head_is_recomputed_while_the_tail_loads(reference, saved_store):
    # loading a block takes as long as computing it: half of the 8-block hit each way
    conn = MemoryConnector(dict(saved_store), load_seconds_per_block=1.0, load_delay_polls=2)
    with make_llm(conn, per_token=1.0 / BS) as llm:
        engine = llm.engine
        request_id = engine.add_request(PROMPT, GREEDY)
        engine.step()  # the head's prefill runs while the tail loads
        seq = engine.scheduler.get(request_id)
        assert seq.num_computed_tokens == 4 * BS and request_id in engine.scheduler.tail_loads
        final = {}
        while engine.has_unfinished_requests():
            final.update((o.request_id, o) for o in engine.step())
        stats = engine.stats()
        hashes = hashes_of(llm, PROMPT)
    (load,) = conn.loads
    assert load[1] == hashes[4:8]  # the tail only
    out = final[request_id]
    assert out.token_ids == reference and out.num_cached_tokens == 4 * BS
    assert stats.connector_hits == 4 * BS and stats.num_used_blocks == 0
    assert (stats.connector_overlapped_loads, stats.connector_overlap_tokens) == (1, 4 * BS)


def test_a_tail_that_loads_before_the_head_is_done_waits_for_it(reference, saved_store):
    conn = MemoryConnector(dict(saved_store), load_seconds_per_block=3.0)
    # a 16-token budget: the 6-block head takes 6 steps, the tail is reported at once
    with make_llm(conn, per_token=1.0 / BS, max_num_batched_tokens=BS) as llm:
        out = llm.generate(PROMPT, GREEDY)[0]
    assert len(conn.loads[0][1]) == 2
    assert out.token_ids == reference and out.num_cached_tokens == 2 * BS


def test_a_short_tail_load_is_recomputed(reference, saved_store):
    conn = MemoryConnector(dict(saved_store), load_seconds_per_block=1.0, load_limit=1)
    with make_llm(conn, per_token=1.0 / BS) as llm:
        out = llm.generate(PROMPT, GREEDY)[0]
        stats = llm.engine.stats()
    assert out.token_ids == reference and out.num_cached_tokens == BS
    assert stats.connector_load_failures == 1


@pytest.mark.parametrize("per_token, load", [(None, 1.0), (1.0 / BS, None), (1.0, 1e-3)])
def test_without_both_timings_or_with_a_fast_tier_everything_loads(
    reference, saved_store, per_token, load
):
    conn = MemoryConnector(dict(saved_store), load_seconds_per_block=load)
    with make_llm(conn, per_token=per_token) as llm:
        out = llm.generate(PROMPT, GREEDY)[0]
        stats = llm.engine.stats()
    assert len(conn.loads[0][1]) == 8
    assert out.token_ids == reference and out.num_cached_tokens == 8 * BS
    assert (stats.connector_overlapped_loads, stats.connector_overlap_tokens) == (0, 0)


def test_a_step_whose_fixed_cost_outweighs_the_saving_is_not_taken(reference, saved_store):
    # loading 8 blocks takes 8 s; a head step costs 2 s + 1 s a block: 3 blocks at best
    conn = MemoryConnector(dict(saved_store), load_seconds_per_block=1.0)
    with make_llm(conn, per_token=1.0 / BS, fixed=2.0) as llm:
        out = llm.generate(PROMPT, GREEDY)[0]
    assert len(conn.loads[0][1]) == 8 and out.token_ids == reference


def test_a_head_of_several_steps_pays_the_fixed_cost_once_a_step(reference, saved_store):
    # 8 blocks load in 24 s, a block computes in 1 s, a step costs 1 s more, and a step
    # takes one block: one step's head would be 5 blocks, but 5 steps leave room for 4
    conn = MemoryConnector(dict(saved_store), load_seconds_per_block=3.0)
    with make_llm(conn, per_token=1.0 / BS, fixed=1.0, max_num_batched_tokens=BS) as llm:
        out = llm.generate(PROMPT, GREEDY)[0]
    assert len(conn.loads[0][1]) == 4
    assert out.token_ids == reference and out.num_cached_tokens == 4 * BS


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_engine_times_a_prefill_step_at_start_up():
    with LLM(max_model_len=256, num_gpu_blocks_override=64, kv_connector=MemoryConnector(),
             device="cuda") as llm:
        cost = llm.engine.scheduler.prefill_cost
    assert cost is not None and min(cost) >= 0 and cost.step_seconds(0, 240) > 0


def test_a_busy_engine_loads_everything(reference, saved_store):
    conn = MemoryConnector(dict(saved_store), load_seconds_per_block=1.0)
    with make_llm(conn, per_token=1.0 / BS) as llm:
        engine = llm.engine
        longer = dataclasses.replace(GREEDY, max_tokens=20)
        busy = engine.add_request("Something else entirely.", longer)
        engine.step()
        request_id = engine.add_request(PROMPT, GREEDY)
        final = {}
        while engine.has_unfinished_requests():
            final.update((o.request_id, o) for o in engine.step())
    assert len(conn.loads[0][1]) == 8
    assert final[request_id].token_ids == reference and len(final[busy].token_ids) == 20


def test_an_aborted_request_frees_its_blocks_once_its_tail_is_reported(saved_store):
    conn = MemoryConnector(dict(saved_store), load_seconds_per_block=1.0, load_delay_polls=3)
    with make_llm(conn, per_token=1.0 / BS) as llm:
        engine = llm.engine
        request_id = engine.add_request(PROMPT, GREEDY)
        engine.step()
        used = engine.stats().num_used_blocks
        assert engine.abort_request(request_id).finish_reason == "abort"
        assert engine.stats().num_used_blocks == used  # the tail's blocks are the connector's
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.stats().num_used_blocks == 0


def test_a_sequence_whose_tail_loads_is_never_preempted(reference, saved_store):
    """Under the priority policy the loading request matters least, and the pool runs short
    while its tail loads: the other one waits instead of preempting it."""
    conn = MemoryConnector(dict(saved_store), load_seconds_per_block=1.0, load_delay_polls=80)
    with make_llm(conn, per_token=1.0 / BS, blocks=11, max_model_len=176,
                  scheduling_policy="priority") as llm:
        engine, scheduler = llm.engine, llm.engine.scheduler
        loading = engine.add_request(PROMPT, GREEDY, priority=5)
        engine.step()
        other = engine.add_request("Hi.", dataclasses.replace(GREEDY, max_tokens=60), priority=0)
        final, waited = {}, 0
        while engine.has_unfinished_requests():
            tail_in_flight = loading in scheduler.tail_loads
            outs = engine.step()
            final.update((o.request_id, o) for o in outs)
            if tail_in_flight:
                assert scheduler.get(loading).num_preemptions == 0
                waited += other not in {o.request_id for o in outs} and not final[other].finished
        stats = engine.stats()
    assert waited  # the other request did run short of blocks while the tail loaded
    assert final[loading].token_ids == reference and len(final[other].token_ids) == 60
    assert stats.num_used_blocks == 0


# ------------------------------------------------------------- over the real tiers


def test_a_disk_hit_split_between_recompute_and_load_matches(tmp_path):
    """The tier manager times its loads (a disk block at the prior 2 GB/s here): with a
    prefill that costs as much per block, half the hit is recomputed, the rest read from
    disk into the blocks after it, and the output is unchanged."""
    from tiered_kv import TierConfig, build_llm

    prompt = list(range(3, 3 + 130))  # 8 full blocks
    tiers = TierConfig(kv_cache_dir=tmp_path / "kv", cpu_bytes=0, disk_bytes=64 << 20)
    kwargs = dict(device="cpu", max_model_len=256, num_gpu_blocks_override=16)
    with build_llm("tiny", tiers, **kwargs) as llm:
        expected = llm.generate(prompt, GREEDY)[0].token_ids
        assert llm.engine.connector.flush(30)
    with build_llm("tiny", tiers, **kwargs) as llm:  # a new engine: only the disk has them
        manager = llm.engine.connector
        block_nbytes = llm.engine.model_runner.kv_cache[0].numel() * 4
        llm.engine.scheduler.prefill_cost = PrefillCost(0.0, block_nbytes / 2e9 / BS)
        out = llm.generate(prompt, GREEDY)[0]
        stats = manager.stats()
    assert out.token_ids == expected
    assert out.num_cached_tokens == 4 * BS  # the tail: blocks 4..7
    assert stats["disk"]["hit_blocks"] == 4 and stats["disk"]["load_failures"] == 0


def test_the_load_clock_starts_from_priors_and_follows_loads():
    from tiered_kv.load_clock import PRIOR_BYTES_PER_S, WEIGHT, LoadClock

    clock = LoadClock(1 << 20)
    disk = (1 << 20) / PRIOR_BYTES_PER_S["disk"]
    assert clock.estimate(["disk", "disk"]) == pytest.approx(2 * disk)
    clock.observe("disk", seconds=0.1, blocks=10)  # 10 ms a block
    assert clock.seconds_per_block("disk") == pytest.approx(disk + WEIGHT * (0.01 - disk))
    clock.observe("disk", seconds=1.0, blocks=0)  # nothing loaded: nothing learned
    clock.observe("elsewhere", seconds=1.0, blocks=1)
    assert clock.seconds_per_block("disk") == pytest.approx(disk + WEIGHT * (0.01 - disk))
    assert clock.estimate(["cpu"]) < clock.estimate(["remote"])
