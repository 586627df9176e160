"""``LLM.generate(priority=...)``: one value or one per prompt, honoured only under the
``priority`` policy."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine_testing import one_thread  # noqa: F401  (autouse fixture)

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
PROMPTS = ["one", "two", "three"]


def test_fcfs_refuses_a_priority_and_takes_zero():
    with LLM(max_model_len=64, num_gpu_blocks_override=16, device="cpu") as llm:
        with pytest.raises(ValueError, match="Priority scheduling is not enabled"):
            llm.generate(PROMPTS, GREEDY, priority=[0, 1, 0])
        assert len(llm.generate(PROMPTS, GREEDY, priority=0)) == 3
        assert not llm.engine.has_unfinished_requests()  # the refused batch was aborted


def test_requests_are_served_by_priority_then_arrival():
    with LLM(
        max_model_len=64, num_gpu_blocks_override=16, device="cpu",
        scheduling_policy="priority", max_num_seqs=1,
    ) as llm:
        engine = llm.engine
        for prompt, priority in zip(PROMPTS + ["four"], [3, -1, 0, -1]):
            engine.add_request(prompt, GREEDY, request_id=prompt, priority=priority)
        finished = []
        while engine.has_unfinished_requests():
            finished += [out.request_id for out in engine.step() if out.finished]
        assert finished == ["two", "four", "three", "one"]
        assert len(llm.generate(PROMPTS, GREEDY, priority=[3, -1, 0])) == 3
        with pytest.raises(ValueError, match="priority: 2 values for 3 prompts"):
            llm.generate(PROMPTS, GREEDY, priority=[1, 2])
        with pytest.raises(ValueError, match="priority must be an integer"):
            engine.add_request("x", GREEDY, priority=1.5)


def test_a_request_preempted_for_its_own_growth_lets_the_ones_after_it_run():
    """Under the priority policy the victim may be the very request that needs a block, ahead
    of others in the running list: they still run that step (the step was empty, and raised)."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with LLM(
        max_model_len=32, num_gpu_blocks_override=8, block_size=4, device="cpu",
        scheduling_policy="priority", async_scheduling=False,
    ) as llm:
        engine = llm.engine
        engine.add_request(list(range(1, 16)), params, request_id="A", priority=1)  # 4 blocks
        engine.step()
        engine.add_request(list(range(20, 34)), params, request_id="B", priority=0)  # 4 blocks
        engine.step()  # the pool is full
        engine.step()  # A needs a 5th block and is the last by priority: B runs alone
        assert [s.request_id for s in engine.scheduler.running] == ["B"]
        finished = {}
        while engine.has_unfinished_requests():
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
        assert {k: len(o.token_ids) for k, o in finished.items()} == {"A": 10, "B": 10}
        assert engine.stats().num_preemptions >= 1
        assert engine.block_manager.num_free_blocks == 8
