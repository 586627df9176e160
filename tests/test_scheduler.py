from __future__ import annotations

import pytest
import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.connector import FinishedTransfers
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import SequenceStatus
from engine.stats import StatsCollector
from engine_testing import NAMESPACE, MemoryConnector, make_seq, scheduler_step

BS = 4
STORED = list(range(200, 212))  # 3 blocks; the connector can supply the first 2 of them


def scheduler(
    num_blocks: int = 64, connector: MemoryConnector | None = None, **config
) -> Scheduler:
    defaults = dict(device="cpu", block_size=BS, max_model_len=64, max_num_batched_tokens=16)
    cfg = EngineConfig(**{**defaults, **config}).resolve(4096)
    bm = BlockManager(
        num_blocks,
        BS,
        enable_prefix_caching=cfg.enable_prefix_caching,
        on_evict=connector.on_blocks_evicted if connector is not None else None,
    )
    return Scheduler(cfg, bm, StatsCollector(), connector)


def memory_connector(num_blocks: int = 64, **kw) -> MemoryConnector:
    """A connector over a stand-in ``[num_blocks, 1]`` cache; its store holds STORED's blocks."""
    conn = MemoryConnector(**kw)
    conn.register_kv_cache(torch.zeros(num_blocks, 1), NAMESPACE, BS)
    for block_hash in make_seq(STORED, block_size=BS).hashes_of_full_blocks():
        conn.store[(NAMESPACE, block_hash)] = (None, torch.ones(1))
    return conn


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(seq.request_id, n) for seq, n in out.scheduled]


def test_token_budget_is_respected_and_the_rest_waits():
    s = scheduler()
    for i in range(3):
        s.add(make_seq(range(100 * i, 100 * i + 10), f"r{i}", block_size=BS))
    out = scheduler_step(s)
    assert plan(out) == [("r0", 10), ("r1", 6)]
    assert out.num_batched_tokens == 16
    assert [q.request_id for q in s.waiting] == ["r2"]
    out = scheduler_step(s)
    # Running first: r0 decodes, r1 finishes its prompt, then r2 gets what is left.
    assert plan(out) == [("r0", 1), ("r1", 4), ("r2", 10)]
    assert out.num_batched_tokens <= 16


def test_chunked_prefill_splits_a_long_prompt():
    s = scheduler()
    seq = make_seq(range(40), block_size=BS)
    s.add(seq)
    chunks = [plan(scheduler_step(s)) for _ in range(4)]
    assert chunks == [[("r", 16)], [("r", 16)], [("r", 8)], [("r", 1)]]
    assert seq.num_output_tokens == 2  # one after the prompt, one after the decode


def test_without_chunked_prefill_a_prompt_runs_whole_or_waits():
    s = scheduler(enable_chunked_prefill=False, max_num_batched_tokens=64)
    s.add(make_seq(range(40), "a", block_size=BS))
    s.add(make_seq(range(100, 130), "b", block_size=BS))
    assert plan(scheduler_step(s)) == [("a", 40)]  # b does not fit next to a
    assert plan(scheduler_step(s)) == [("a", 1), ("b", 30)]


def test_max_num_seqs_caps_the_running_set():
    s = scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(4):
        s.add(make_seq(range(100 * i, 100 * i + 5), f"r{i}", block_size=BS))
    assert plan(scheduler_step(s)) == [("r0", 5), ("r1", 5)]
    assert plan(scheduler_step(s)) == [("r0", 1), ("r1", 1)]
    assert len(s.running) == 2 and len(s.waiting) == 2


def test_preemption_frees_the_newest_and_it_resumes_from_the_cache():
    s = scheduler(num_blocks=6, max_model_len=24, max_num_batched_tokens=64)
    a, b = make_seq(range(12), "a", block_size=BS), make_seq(range(100, 112), "b", block_size=BS)
    s.add(a)
    s.add(b)
    scheduler_step(s)  # 3 + 3 blocks: the pool is full
    assert s.block_manager.num_free_blocks == 0
    out = scheduler_step(s)  # a's 13th token needs a 4th block: b (the newest) is preempted
    assert [q.request_id for q in out.preempted] == ["b"]
    assert plan(out) == [("a", 1)]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and s.waiting[0] is b
    assert b.num_computed_tokens == 0 and s.stats.num_preemptions == 1
    # a took b's last block (freed tail first); b's first two blocks are still cached.
    s.finish(a, "length")
    out = scheduler_step(s)
    assert plan(out) == [("b", 5)]  # 13 tokens: 8 from the cache, 5 recomputed
    assert b.num_cached_tokens == 0  # its first admission had no hit
    # As in vLLM, its return is not a second query (it would find its own blocks), nor are
    # its recomputed prompt tokens counted again.
    assert (s.stats.prefix_cache_queries, s.stats.prefix_cache_hits) == (24, 0)
    assert s.stats.num_prompt_tokens == 24


def test_a_request_preempted_mid_prompt_counts_each_prompt_token_once():
    s = scheduler(num_blocks=6, max_model_len=32, max_num_batched_tokens=4)
    a, b = make_seq(range(8), "a", block_size=BS), make_seq(range(100, 116), "b", block_size=BS)
    s.add(a)
    scheduler_step(s)
    scheduler_step(s)  # a's prompt is computed: it decodes
    s.add(b)
    while b.num_preemptions == 0:
        assert scheduler_step(s).scheduled
    assert 0 < b.prompt_tokens_counted < b.num_prompt_tokens  # preempted mid-prompt
    s.finish(a, "length")
    while b.num_computed_tokens < b.num_prompt_tokens:
        scheduler_step(s)
    assert s.stats.num_prompt_tokens == 8 + 16  # b's tokens after its return are counted


def test_a_sequence_that_cannot_grow_preempts_itself_when_alone():
    s = scheduler(num_blocks=3, max_model_len=12)
    a = make_seq(range(8), "a", block_size=BS)
    b = make_seq(range(50, 53), "b", block_size=BS)
    s.add(a)
    s.add(b)
    scheduler_step(s)
    assert s.block_manager.num_free_blocks == 0
    out = scheduler_step(s)  # a needs a third block: b (newest) goes first
    assert [q.request_id for q in out.preempted] == ["b"] and plan(out) == [("a", 1)]


def test_finish_and_abort_free_blocks_of_running_and_waiting():
    s = scheduler(max_num_seqs=1)
    a, b = make_seq(range(10), "a", block_size=BS), make_seq(range(10), "b", block_size=BS)
    s.add(a)
    s.add(b)
    scheduler_step(s)
    assert s.block_manager.num_used_blocks == 3 and s.waiting[0] is b
    s.finish(b, "abort")  # waiting
    s.finish(a, "abort")  # running
    assert s.block_manager.num_used_blocks == 0
    assert not s.has_unfinished() and s.schedule().is_empty
    assert a.finish_reason == b.finish_reason == "abort"


def test_over_long_prompt_and_duplicate_ids_are_rejected():
    s = scheduler(max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add(make_seq(range(16), block_size=BS))
    s.add(make_seq(range(15), "x", block_size=BS))
    with pytest.raises(ValueError, match="already in use"):
        s.add(make_seq(range(3), "x", block_size=BS))


def test_a_full_prompt_hit_still_computes_the_last_block():
    s = scheduler()
    s.add(make_seq(range(8), "a", block_size=BS))
    scheduler_step(s)
    second = make_seq(range(8), "b", block_size=BS)
    s.add(second)
    out = scheduler_step(s)
    # 8 tokens = 2 full cached blocks, but the last token's logits are needed: hit 1 block.
    assert ("b", 4) in plan(out)
    assert second.num_cached_tokens == 4


def test_prefix_caching_off_never_hits():
    s = scheduler(enable_prefix_caching=False)
    s.add(make_seq(range(9), "a", block_size=BS))
    scheduler_step(s)
    s.add(make_seq(range(9), "b", block_size=BS))
    assert ("b", 9) in plan(scheduler_step(s))
    assert s.stats.prefix_cache_hits == 0
    assert s.stats.prefix_cache_queries == 18 and s.stats.connector_queries == 0  # no tiers


def test_a_loading_sequence_takes_no_budget_and_does_not_stall_the_others():
    conn = memory_connector(load_delay_polls=2)
    s = scheduler(connector=conn)
    b = make_seq(STORED, "b", block_size=BS)
    s.add(make_seq(range(10), "a", block_size=BS))
    s.add(b)
    s.add(make_seq(range(100, 103), "c", block_size=BS))
    assert plan(scheduler_step(s)) == [("a", 10), ("c", 3)]
    # b got blocks for what it loads only, and waits for the load.
    assert b.status is SequenceStatus.LOADING and list(s.loading) == ["b"]
    assert conn.loads == [("b", b.block_hashes[:2], b.block_table)] and len(b.block_table) == 2
    assert b.num_cached_tokens is None and s.has_pending_transfers()
    assert plan(scheduler_step(s)) == [("a", 1), ("c", 1)]  # two polls that do not report the load
    assert plan(scheduler_step(s)) == [("a", 1), ("c", 1)]
    assert plan(scheduler_step(s)) == [("a", 1), ("c", 1), ("b", 4)]  # reported: b computes the rest
    assert b.status is SequenceStatus.RUNNING and b.num_cached_tokens == 8
    assert (s.stats.connector_hits, s.stats.connector_load_failures) == (8, 0)
    assert s.stats.connector_queries == 10 + b.num_prompt_tokens + 3  # each one asked the tiers
    # The loaded blocks are in the prefix cache but not offered back to the connector.
    assert s.block_manager.find_cached_prefix(make_seq(STORED, "x"), 2) == b.block_table[:2]
    assert not {blk.block_hash for blk in conn.saved} & set(b.block_hashes[:2])


def test_a_partial_load_recomputes_the_rest_without_asking_again():
    conn = memory_connector(load_limit=1)
    s = scheduler(connector=conn)
    b = make_seq(STORED, "b", block_size=BS)
    s.add(b)
    assert plan(scheduler_step(s)) == []
    assert plan(scheduler_step(s)) == [("b", 8)]  # 1 of 2 blocks loaded
    assert b.num_cached_tokens == 4 and b.num_computed_tokens == 12
    assert (s.stats.connector_hits, s.stats.connector_load_failures) == (4, 1)
    assert [blk.block_hash for blk in conn.saved] == b.block_hashes[1:3]  # the recomputed ones
    scheduler_step(s)
    assert len(conn.queries) == len(conn.loads) == 1


def test_without_prefix_caching_loaded_blocks_are_still_used():
    conn = memory_connector()
    s = scheduler(connector=conn, enable_prefix_caching=False)
    b = make_seq(STORED, "b", block_size=BS)
    s.add(b)
    scheduler_step(s)
    assert plan(scheduler_step(s)) == [("b", 4)] and b.num_cached_tokens == 8
    assert s.block_manager.num_cached_blocks == 0
    assert [blk.block_hash for blk in conn.saved] == b.block_hashes[2:3]


def test_loading_sequences_count_toward_max_num_seqs():
    s = scheduler(connector=memory_connector(load_delay_polls=1), max_num_seqs=1)
    s.add(make_seq(STORED, "b", block_size=BS))
    s.add(make_seq(range(5), "a", block_size=BS))
    assert plan(scheduler_step(s)) == [] and plan(scheduler_step(s)) == []  # b holds the one slot while it loads
    assert plan(scheduler_step(s)) == [("b", 4)]
    assert [q.request_id for q in s.waiting] == ["a"]


def test_a_load_that_fails_to_start_is_computed_at_once():
    class Refusing(MemoryConnector):
        def start_load(self, request_id, block_hashes, block_ids, cache_salt=None) -> None:
            raise OSError("no")

    conn = Refusing()
    conn.register_kv_cache(torch.zeros(64, 1), NAMESPACE, BS)
    conn.store.update(memory_connector().store)
    s = scheduler(connector=conn)
    s.add(make_seq(STORED, "b", block_size=BS))
    assert plan(scheduler_step(s)) == [("b", 12)]
    assert s.stats.connector_load_failures == 1 and not s.loading


def test_an_aborted_load_frees_its_blocks_only_when_reported():
    conn = memory_connector(load_delay_polls=1)
    s = scheduler(connector=conn)
    b = make_seq(STORED, "b", block_size=BS)
    s.add(b)
    scheduler_step(s)
    s.finish(b, "abort")
    assert b.is_finished and conn.finished == ["b"] and not s.has_unfinished() and not s.loading
    assert s.block_manager.num_used_blocks == 2 and s.has_pending_transfers()
    # The id is free again; the new request does not load while the old load is in flight.
    again = make_seq(STORED, "b", block_size=BS)
    s.add(again)
    assert plan(scheduler_step(s)) == [("b", 12)] and len(conn.loads) == 1
    scheduler_step(s)  # reports the aborted load: its blocks are freed
    assert s.block_manager.num_used_blocks == len(again.block_table)
    assert s.stats.connector_hits == 0


def test_an_aborted_load_leaves_its_blocks_in_the_prefix_cache():
    conn = memory_connector()
    s = scheduler(connector=conn)
    s.add(b := make_seq(STORED, "b", block_size=BS))
    scheduler_step(s)
    s.finish(b, "abort")
    scheduler_step(s)
    assert s.block_manager.num_used_blocks == 0 and not s.has_pending_transfers()
    s.add(c := make_seq(STORED, "c", block_size=BS))
    assert plan(scheduler_step(s)) == [("c", 4)] and c.num_cached_tokens == 8
    assert len(conn.loads) == 1


def test_saved_blocks_are_held_until_reported_and_a_sequence_waits_for_them():
    conn = memory_connector(save_delay_polls=2)
    s = scheduler(num_blocks=4, connector=conn)
    a, c = make_seq(range(8), "a", block_size=BS), make_seq(range(100, 107), "c", block_size=BS)
    s.add(a)
    s.add(c)
    scheduler_step(s)  # 2 + 2 blocks: the pool is full; a's two blocks and c's first are offered
    assert [blk.block_id for blk in conn.saved] == a.block_table + c.block_table[:1]
    a_blocks = list(a.block_table)
    s.finish(a, "length")
    assert s.block_manager.num_free_blocks == 0 and s.block_manager.num_held_only_blocks == 2
    assert plan(scheduler_step(s)) == [("c", 1)]  # c's 8th token still fits its second block
    out = scheduler_step(s)  # c needs a third block: only held ones would do, so c waits
    assert out.is_empty and out.preempted == [] and c.status is SequenceStatus.RUNNING
    out = scheduler_step(s)  # the poll reports the first saves: a's blocks are free again
    assert plan(out) == [("c", 1)] and c.block_table[2] in a_blocks
    assert s.stats.num_preemptions == 0


def test_a_report_that_breaks_the_contract_is_refused():
    s = scheduler(connector=memory_connector())
    with pytest.raises(ValueError, match="never started"):
        s.apply_transfers(FinishedTransfers(loaded={"nobody": 1}))
    with pytest.raises(ValueError, match="block 3"):
        s.apply_transfers(FinishedTransfers(saved=[3]))
    s.add(b := make_seq(STORED, "b", block_size=BS))
    scheduler_step(s)
    with pytest.raises(ValueError, match="asked for 2"):
        s.apply_transfers(FinishedTransfers(loaded={"b": 3}))


# ---------------------------------------------------------------- scheduling_policy="priority"


def ranked(tokens, request_id: str, priority: int):
    seq = make_seq(tokens, request_id, block_size=BS)
    seq.priority = priority
    return seq


def test_fcfs_refuses_a_priority_as_vllm_does():
    s = scheduler()
    with pytest.raises(ValueError, match="Priority scheduling is not enabled"):
        s.add(ranked(range(5), "a", 3))
    s.add(ranked(range(5), "b", 0))
    assert plan(scheduler_step(s)) == [("b", 5)]


def test_waiting_sequences_are_served_by_priority_then_arrival():
    s = scheduler(max_num_seqs=1, scheduling_policy="priority")
    for request_id, priority in [("r0", 1), ("r1", 0), ("r2", 1), ("r3", -2), ("r4", 1)]:
        s.add(ranked(range(5), request_id, priority))
    s.finish(s.get("r2"), "abort")  # waiting: leaves the queue
    assert [q.request_id for q in s.waiting] == ["r3", "r1", "r0", "r4"]
    order = [plan(scheduler_step(s, max_tokens=1))[0][0] for _ in range(4)]
    assert order == ["r3", "r1", "r0", "r4"]
    assert not s.has_unfinished()


@pytest.mark.parametrize("policy, victim, survivors", [
    ("fcfs", "c", [("a", 1), ("b", 1)]),
    ("priority", "b", [("a", 1), ("c", 1)]),
])
def test_the_pool_runs_short_and_the_last_by_priority_is_preempted(policy, victim, survivors):
    s = scheduler(num_blocks=9, max_num_batched_tokens=64, scheduling_policy=policy)
    for request_id, priority in [("a", 0), ("b", 5 if policy == "priority" else 0), ("c", 0)]:
        s.add(ranked(range(100 * len(s.waiting), 100 * len(s.waiting) + 12), request_id, priority))
    scheduler_step(s)  # 3 x 3 blocks: the pool is full
    assert s.block_manager.num_free_blocks == 0
    out = scheduler_step(s)  # each needs a 4th block: one is preempted for the others
    assert [q.request_id for q in out.preempted] == [victim]
    assert plan(out) == survivors


def test_a_preempted_sequence_waits_behind_a_later_higher_priority_one():
    s = scheduler(num_blocks=9, max_num_batched_tokens=64, scheduling_policy="priority")
    for i, (request_id, priority) in enumerate([("a", 0), ("b", 5), ("c", 0)]):
        s.add(ranked(range(100 * i, 100 * i + 12), request_id, priority))
    scheduler_step(s)
    s.add(ranked(range(900, 905), "d", 1))
    assert [q.request_id for q in scheduler_step(s).preempted] == ["b"]
    assert [q.request_id for q in s.waiting] == ["d", "b"]


def test_a_victim_scheduled_earlier_in_the_step_gives_its_budget_back():
    s = scheduler(num_blocks=7, max_num_batched_tokens=64, scheduling_policy="priority")
    low = ranked(range(12), "low", 5)
    s.add(low)
    scheduler_step(s)  # low: 3 blocks
    s.add(ranked(range(100, 111), "high", 0))
    assert plan(scheduler_step(s)) == [("low", 1), ("high", 11)]  # 4 + 3 blocks: the pool is full
    assert plan(scheduler_step(s)) == [("low", 1), ("high", 1)]
    out = scheduler_step(s)  # low is scheduled first, then high needs a 4th block: low goes
    assert [q.request_id for q in out.preempted] == ["low"]
    assert plan(out) == [("high", 1)] and out.num_batched_tokens == 1
    assert low.status is SequenceStatus.WAITING and low.block_table == []


def test_may_admit_says_whether_the_first_waiting_request_could_start_next_step():
    s = scheduler(num_blocks=6, max_num_seqs=4)
    assert not s.may_admit()  # nothing waits
    s.add(make_seq(range(1, 17), request_id="a", block_size=BS))  # 4 blocks
    assert s.may_admit()
    scheduler_step(s)
    s.add(make_seq(range(101, 109), request_id="b", block_size=BS))  # 2 blocks
    assert not s.may_admit()  # 2 are free, but a's next token takes one first
    assert plan(scheduler_step(s)) == [("a", 1)]  # and b waits indeed
    s.finish(s.get("a"), "length")
    assert s.may_admit()
    assert plan(scheduler_step(s)) == [("b", 8)]
    # a prefix shared with a running request costs no block: only its lookup tells
    hit = scheduler(num_blocks=6, max_num_seqs=4)
    hit.add(make_seq(range(1, 17), request_id="a", block_size=BS))
    scheduler_step(hit)  # a: 4 full blocks, cached; its next token takes the 5th
    hit.add(make_seq([*range(1, 17), 50, 51, 52, 53], request_id="b", block_size=BS))
    assert hit.may_admit()  # 4 blocks shared with a, 1 new: the last free one
    assert plan(scheduler_step(hit)) == [("a", 1), ("b", 4)]
    full = scheduler(num_blocks=64, max_num_seqs=1)
    full.add(make_seq(range(1, 5), request_id="x", block_size=BS))
    scheduler_step(full)
    full.add(make_seq(range(5, 9), request_id="y", block_size=BS))
    assert not full.may_admit()  # max_num_seqs keeps it out
