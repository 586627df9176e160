from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import SequenceStatus
from engine.stats import StatsCollector
from engine_testing import make_seq

BS = 4


def scheduler(num_blocks: int = 64, **config) -> Scheduler:
    defaults = dict(block_size=BS, max_model_len=64, max_num_batched_tokens=16)
    cfg = EngineConfig(**{**defaults, **config}).resolve(4096)
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=cfg.enable_prefix_caching)
    return Scheduler(cfg, bm, StatsCollector())


def step(s: Scheduler, max_tokens: int = 1000) -> SchedulerOutput:
    """Schedule and complete one step, sampling token 7 wherever a step finishes the tokens."""
    out = s.schedule()
    s.complete_step(out)
    for seq, _ in out.scheduled:
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
            if seq.num_output_tokens >= max_tokens:
                s.finish(seq, "length")
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(seq.request_id, n) for seq, n in out.scheduled]


def test_token_budget_is_respected_and_the_rest_waits():
    s = scheduler()
    for i in range(3):
        s.add(make_seq(range(100 * i, 100 * i + 10), f"r{i}", block_size=BS))
    out = step(s)
    assert plan(out) == [("r0", 10), ("r1", 6)]
    assert out.num_batched_tokens == 16
    assert [q.request_id for q in s.waiting] == ["r2"]
    out = step(s)
    # Running first: r0 decodes, r1 finishes its prompt, then r2 gets what is left.
    assert plan(out) == [("r0", 1), ("r1", 4), ("r2", 10)]
    assert out.num_batched_tokens <= 16


def test_chunked_prefill_splits_a_long_prompt():
    s = scheduler()
    seq = make_seq(range(40), block_size=BS)
    s.add(seq)
    chunks = [plan(step(s)) for _ in range(4)]
    assert chunks == [[("r", 16)], [("r", 16)], [("r", 8)], [("r", 1)]]
    assert seq.num_output_tokens == 2  # one after the prompt, one after the decode


def test_without_chunked_prefill_a_prompt_runs_whole_or_waits():
    s = scheduler(enable_chunked_prefill=False, max_num_batched_tokens=64)
    s.add(make_seq(range(40), "a", block_size=BS))
    s.add(make_seq(range(100, 130), "b", block_size=BS))
    assert plan(step(s)) == [("a", 40)]  # b does not fit next to a
    assert plan(step(s)) == [("a", 1), ("b", 30)]


def test_max_num_seqs_caps_the_running_set():
    s = scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(4):
        s.add(make_seq(range(100 * i, 100 * i + 5), f"r{i}", block_size=BS))
    assert plan(step(s)) == [("r0", 5), ("r1", 5)]
    assert plan(step(s)) == [("r0", 1), ("r1", 1)]
    assert len(s.running) == 2 and len(s.waiting) == 2


def test_preemption_frees_the_newest_and_it_resumes_from_the_cache():
    s = scheduler(num_blocks=6, max_model_len=24, max_num_batched_tokens=64)
    a, b = make_seq(range(12), "a", block_size=BS), make_seq(range(100, 112), "b", block_size=BS)
    s.add(a)
    s.add(b)
    step(s)  # 3 + 3 blocks: the pool is full
    assert s.block_manager.num_free_blocks == 0
    out = step(s)  # a's 13th token needs a 4th block: b (the newest) is preempted
    assert [q.request_id for q in out.preempted] == ["b"]
    assert plan(out) == [("a", 1)]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and s.waiting[0] is b
    assert b.num_computed_tokens == 0 and s.stats.num_preemptions == 1
    # a took b's last block (freed tail first); b's first two blocks are still cached.
    s.finish(a, "length")
    out = step(s)
    assert plan(out) == [("b", 5)]  # 13 tokens: 8 from the cache, 5 recomputed
    assert b.num_cached_tokens == 0  # its first admission had no hit
    assert s.stats.prefix_cache_hits == 8


def test_a_sequence_that_cannot_grow_preempts_itself_when_alone():
    s = scheduler(num_blocks=3, max_model_len=12)
    a = make_seq(range(8), "a", block_size=BS)
    b = make_seq(range(50, 53), "b", block_size=BS)
    s.add(a)
    s.add(b)
    step(s)
    assert s.block_manager.num_free_blocks == 0
    out = step(s)  # a needs a third block: b (newest) goes first
    assert [q.request_id for q in out.preempted] == ["b"] and plan(out) == [("a", 1)]


def test_finish_and_abort_free_blocks_of_running_and_waiting():
    s = scheduler(max_num_seqs=1)
    a, b = make_seq(range(10), "a", block_size=BS), make_seq(range(10), "b", block_size=BS)
    s.add(a)
    s.add(b)
    step(s)
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
    step(s)
    second = make_seq(range(8), "b", block_size=BS)
    s.add(second)
    out = step(s)
    # 8 tokens = 2 full cached blocks, but the last token's logits are needed: hit 1 block.
    assert ("b", 4) in plan(out)
    assert second.num_cached_tokens == 4


def test_prefix_caching_off_never_hits():
    s = scheduler(enable_prefix_caching=False)
    s.add(make_seq(range(9), "a", block_size=BS))
    step(s)
    s.add(make_seq(range(9), "b", block_size=BS))
    assert ("b", 9) in plan(step(s))
    assert s.stats.prefix_cache_hits == 0
