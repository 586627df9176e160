"""The prefill cost model (engine/prefill_cost.py) and the overlapped-load head it sizes."""
from __future__ import annotations

import types

import pytest

from engine import LLM, startup_probes
from engine.prefill_cost import PrefillCost, fit
from engine.scheduler_loads import MIN_OVERLAP_BLOCKS, Loads

BS = 16


def test_a_step_pays_its_fixed_cost_its_tokens_and_attention_over_what_came_before():
    cost = PrefillCost(fixed_s=2.0, per_token_s=0.5, per_token_context_s=0.01)
    # 4 tokens after 10: each reads the 10 and the ones before it in the step (0+1+2+3)
    assert cost.step_seconds(10, 4) == pytest.approx(2.0 + 4 * 0.5 + 0.01 * (40 + 6))
    assert cost.step_seconds(0, 1) == pytest.approx(2.5)


def test_work_past_one_steps_budget_takes_several_steps_each_later_in_the_sequence():
    cost = PrefillCost(1.0, 0.25, 0.001)
    want = cost.step_seconds(100, 8) + cost.step_seconds(108, 8) + cost.step_seconds(116, 4)
    assert cost.seconds(100, 20, budget=8) == pytest.approx(want)
    assert cost.seconds(100, 0, budget=8) == 0.0


def test_fit_recovers_the_coefficients_that_gave_the_timings():
    truth = PrefillCost(0.003, 2e-5, 4e-9)
    small, big = 128, 2048
    got = fit(small, big, truth.step_seconds(0, small), truth.step_seconds(0, big),
              truth.step_seconds(big, small))
    assert got == pytest.approx(truth, rel=1e-9)


def test_fit_never_returns_a_negative_coefficient():
    # the continued step timed faster than the fresh one, and big barely dearer than small
    got = fit(16, 256, small_s=0.010, big_s=0.0101, after_big_s=0.009)
    assert got.per_token_context_s == 0.0 and got.per_token_s >= 0 and got.fixed_s >= 0
    with pytest.raises(ValueError, match="small < big"):
        fit(64, 64, 1.0, 1.0, 1.0)


class _Connector:
    def __init__(self, seconds_per_block: float) -> None:
        self.seconds_per_block = seconds_per_block

    def estimate_load_seconds(self, request_id: str, num_blocks: int) -> float:
        return self.seconds_per_block * num_blocks


def _loads(cost: PrefillCost, seconds_per_block: float, budget: int) -> Loads:
    loads = Loads()
    loads.prefill_cost = cost
    loads.running, loads.loading, loads.tail_loads = [], {}, {}
    loads.connector = _Connector(seconds_per_block)
    loads.block_size = BS
    loads.config = types.SimpleNamespace(max_num_batched_tokens=budget)
    return loads


def _best_head(cost: PrefillCost, first: int, n: int, per_block: float, budget: int) -> int:
    """The most blocks whose recompute after the GPU hit takes no longer than loading the
    rest, found by trying every split."""
    fits = [k for k in range(n) if cost.seconds(first * BS, k * BS, budget) <= per_block * (n - k)]
    return max(fits)


SEQ = types.SimpleNamespace(request_id="r", num_preemptions=0)


@pytest.mark.parametrize("first", [0, 64, 512])
@pytest.mark.parametrize("budget", [256, 2048])
def test_the_head_is_the_longest_whose_recompute_fits_in_the_rests_load(first, budget):
    # a 1B-like step on a GPU: 4 ms fixed, 40 us a token, 10 ns a token per token before it
    cost = PrefillCost(4e-3, 40e-6, 10e-9)
    n, per_block = 512, 1.5e-3
    head = _loads(cost, per_block, budget)._head_to_recompute(SEQ, first, n)
    assert head == _best_head(cost, first, n, per_block, budget) >= MIN_OVERLAP_BLOCKS


def test_attention_over_a_long_context_shortens_the_head():
    # without the context term the head of a hit after 1,024 GPU blocks is longer than the
    # time its recompute really takes allows
    with_context = PrefillCost(4e-3, 40e-6, 10e-9)
    linear = with_context._replace(per_token_context_s=0.0)
    n, per_block, first = 512, 1.5e-3, 1024
    long_head = _loads(linear, per_block, 2048)._head_to_recompute(SEQ, first, n)
    head = _loads(with_context, per_block, 2048)._head_to_recompute(SEQ, first, n)
    assert MIN_OVERLAP_BLOCKS <= head < long_head
    assert with_context.seconds(first * BS, long_head * BS, 2048) > per_block * (n - long_head)


def test_no_head_below_the_minimum_or_while_anything_else_runs():
    cost = PrefillCost(0.0, 1.0 / BS)  # a block computes in 1 s
    assert _loads(cost, 1.0, 2048)._head_to_recompute(SEQ, 0, 2 * MIN_OVERLAP_BLOCKS) == MIN_OVERLAP_BLOCKS
    assert _loads(cost, 1.0, 2048)._head_to_recompute(SEQ, 0, 2 * MIN_OVERLAP_BLOCKS - 1) == 0
    busy = _loads(cost, 1.0, 2048)
    busy.running = [object()]
    assert busy._head_to_recompute(SEQ, 0, 64) == 0


def test_the_runner_fits_its_cost_from_three_timed_steps(monkeypatch):
    truth = PrefillCost(2e-3, 3e-5, 5e-9)
    calls = []

    def timed(tokens, after, kv_scales):
        calls.append((tokens, after))
        slow = 3.0 if len(calls) <= 2 else 1.0  # the first run compiles
        return (slow * truth.step_seconds(0, tokens),
                slow * truth.step_seconds(tokens, after) if after else 0.0)

    with LLM(device="cpu", max_model_len=256, num_gpu_blocks_override=64) as llm:
        runner = llm.engine.model_runner
        # the real steps run on any device: a fresh prefill, then more tokens over it
        small_s, nothing = startup_probes.timed_prefill(runner, 15, 0, None)
        big_s, after_s = startup_probes.timed_prefill(runner, 240, 15, None)
        assert min(small_s, big_s, after_s) > 0 and nothing == 0.0
        monkeypatch.setattr(startup_probes, "timed_prefill", lambda _, *args: timed(*args))
        got = startup_probes.time_prefill(runner, None, repeats=2)
    # 240 tokens (what fits 256 with a sixteenth more), 15, and 15 after the 240
    assert calls == [(15, 0), (240, 15)] * 3
    assert got == pytest.approx(truth, rel=1e-9)
