from __future__ import annotations

import math

import pytest
import torch

from engine import LLM
import engine.sampler
from engine.penalties import TokenCounts, apply_penalties
from engine.sampler import Sample, SampleError, Sampler, SamplingRow
from engine.sampling_params import SamplingParams
from engine_testing import one_thread  # noqa: F401  (autouse fixture)

VOCAB = 50


def logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def row(params: SamplingParams, seed: int = 0, suppressed=()) -> SamplingRow:
    return SamplingRow(params, torch.Generator().manual_seed(seed), suppressed)


def draw(params: SamplingParams, x: torch.Tensor, n: int, seed: int = 0) -> list[int]:
    r = row(params, seed)
    return [Sampler()(x.clone(), [r])[0].token_id for _ in range(n)]


def test_greedy_is_argmax():
    x = logits(4)
    out = Sampler()(x.clone(), [row(SamplingParams(temperature=0.0))] * 4)
    assert [s.token_id for s in out] == x.argmax(-1).tolist()
    assert all(s.logprob is None and s.top_logprobs is None for s in out)


def test_top_k_keeps_only_the_k_most_likely():
    x = logits()
    top3 = set(x[0].topk(3).indices.tolist())
    seen = set(draw(SamplingParams(temperature=5.0, top_k=3), x, 300))
    assert seen == top3  # high temperature: all three show up, nothing else does


def test_top_p_keeps_the_smallest_set_reaching_p():
    x = torch.full((1, VOCAB), -30.0)
    x[0, [3, 9, 27]] = torch.tensor([0.6, 0.3, 0.1]).log()
    probs = torch.softmax(x[0], -1)
    assert math.isclose(probs[3].item(), 0.6, rel_tol=1e-5)
    assert set(draw(SamplingParams(top_p=0.5), x, 200)) == {3}
    assert set(draw(SamplingParams(top_p=0.8), x, 300)) == {3, 9}
    assert set(draw(SamplingParams(top_p=1.0), x, 600)) == {3, 9, 27}


def test_top_k_then_top_p():
    x = torch.full((1, VOCAB), -30.0)
    x[0, [1, 2, 3]] = torch.tensor([0.5, 0.3, 0.2]).log()
    # top_k=2 renormalizes to 0.625/0.375; top_p=0.6 then keeps only the first.
    assert set(draw(SamplingParams(top_k=2, top_p=0.6), x, 100)) == {1}


def test_seeded_sampling_does_not_depend_on_the_batch():
    x = logits(3, seed=1)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=42)
    alone = [Sampler()(x[1:2].clone(), [row(params, 42)])[0].token_id for _ in range(1)]
    gen = torch.Generator().manual_seed(42)
    batch_rows = [
        row(SamplingParams(temperature=0.7), 1), SamplingRow(params, gen), row(SamplingParams(), 3)
    ]
    in_batch = Sampler()(x.clone(), batch_rows)[1].token_id
    assert alone == [in_batch]
    seq_a = draw(params, x[1:2], 20, seed=42)
    seq_b = draw(params, x[1:2], 20, seed=42)
    assert seq_a == seq_b and len(set(seq_a)) > 1


def test_suppressed_tokens_are_never_chosen():
    x = logits()
    best = x[0].argmax().item()
    out = Sampler()(x.clone(), [row(SamplingParams(temperature=0.0), suppressed=[best])])
    assert out[0].token_id != best
    assert out[0].token_id == x[0].topk(2).indices[1].item()


def test_logprobs_are_raw_log_softmax_of_the_chosen_token():
    x = logits(2)
    params = [
        SamplingParams(temperature=0.0, logprobs=True), SamplingParams(temperature=2.0, logprobs=3)
    ]
    out = Sampler()(x.clone(), [row(p) for p in params])
    ref = torch.log_softmax(x, -1)
    for i, s in enumerate(out):
        assert s.logprob == pytest.approx(ref[i, s.token_id].item(), abs=1e-6)
    assert out[0].top_logprobs is None
    top = out[1].top_logprobs
    assert list(top) == ref[1].topk(3).indices.tolist()
    assert list(top.values()) == pytest.approx(ref[1].topk(3).values.tolist(), abs=1e-6)


@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 9e-6])
def test_temperatures_below_1e_5_are_greedy(temperature):
    x = logits(3)
    params = SamplingParams(temperature=temperature, top_p=0.5, top_k=3)
    assert params.is_greedy
    out = Sampler()(x.clone(), [row(params)] * 3)
    assert [s.token_id for s in out] == x.argmax(-1).tolist()


def test_extreme_filters_keep_the_most_likely_token():
    x = logits()
    best = x[0].argmax().item()
    assert set(draw(SamplingParams(top_p=1e-300), x, 20)) == {best}  # 0.0 in float32
    assert len(set(draw(SamplingParams(temperature=5.0, top_k=2**63), x, 100))) > 10  # as if off


def test_a_row_with_every_token_suppressed_gets_its_argmax():
    x = logits(2)
    everything = range(VOCAB)
    rows = [row(SamplingParams(), suppressed=everything), row(SamplingParams(temperature=0.0))]
    out = Sampler()(x.clone(), rows)
    assert out[0] == Sample(0, None, None)  # argmax of all -inf, as for a greedy row
    assert out[1].token_id == x[1].argmax().item()


def test_a_row_that_raises_fails_alone(monkeypatch):
    cursed = SamplingParams(temperature=0.5, seed=13)
    real = engine.sampler.filtered_probs

    def filtered_probs(logits, params):
        if cursed in params:
            raise RuntimeError("cursed row")
        return real(logits, params)

    monkeypatch.setattr(engine.sampler, "filtered_probs", filtered_probs)
    x = logits(3)
    out = Sampler()(x.clone(), [row(SamplingParams()), row(cursed), row(SamplingParams(temperature=0.0))])
    assert isinstance(out[0], Sample) and out[2].token_id == x[2].argmax().item()
    assert isinstance(out[1], SampleError) and str(out[1].error) == "cursed row"


# Penalties, min_p and logit_bias, on hand-made logits.


def counts(prompt: list[int], generated: list[int], vocab: int = VOCAB) -> TokenCounts:
    c = TokenCounts(prompt, vocab, torch.device("cpu"))
    for t in generated:
        c.add(t)
    return c


def reference_penalties(row, prompt, generated, presence, frequency, repetition):
    """vLLM's definitions, one logit at a time."""
    out = []
    for token, logit in enumerate(row):
        if token in prompt or token in generated:
            logit = logit / repetition if logit > 0 else logit * repetition
        logit -= frequency * generated.count(token)
        logit -= presence * (token in generated)
        out.append(logit)
    return out


def test_penalties_change_the_logits_as_vllm_defines_them():
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5, 0.0]])
    by_hand = apply_penalties(x, [counts([0], [1, 3, 3], 6)], [0.25], [0.5], [2.0])
    # token 0: prompt, 2/2; 1: generated once, -1*2 - 0.5 - 0.25; 2, 4, 5: untouched;
    # 3: generated twice, 3/2 - 2*0.5 - 0.25
    assert by_hand.tolist() == [[1.0, -2.75, 0.5, 0.25, -0.5, 0.0]]

    x = logits(3, seed=4)
    cases = [([1, 2, 2], [7, 7, 7, 9], 0.5, 0.0, 1.0), ([], [5, 11], 0.0, -1.5, 1.0), ([4, 40], [4, 8], 0.0, 0.0, 1.3)]
    out = apply_penalties(
        x, [counts(p, g) for p, g, *_ in cases], *[[c[i] for c in cases] for i in (2, 3, 4)]
    )
    for i, (prompt, generated, presence, frequency, repetition) in enumerate(cases):
        expected = reference_penalties(x[i].tolist(), prompt, generated, presence, frequency, repetition)
        assert out[i].tolist() == pytest.approx(expected, abs=1e-6)


def test_penalized_rows_in_a_batch_leave_the_others_alone():
    x = logits(3, seed=5)
    top = x[1].argmax().item()
    greedy = SamplingParams(temperature=0.0)
    rows = [
        row(greedy),
        SamplingRow(SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0), torch.Generator(), (), token_counts=counts([], [top] * 10)),
        row(greedy),
    ]
    out = Sampler()(x.clone(), rows)
    assert [out[0].token_id, out[2].token_id] == [x[0].argmax().item(), x[2].argmax().item()]
    penalized = x[1].clone()
    penalized[top] -= 2.0 + 2.0 * 10
    assert out[1].token_id == penalized.argmax().item() != top


def test_repetition_penalty_counts_the_prompt_and_is_greedy_too():
    x = torch.full((1, VOCAB), -5.0)
    x[0, [3, 4]] = torch.tensor([2.0, 1.5])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    seen_in_prompt = SamplingRow(params, torch.Generator(), (), token_counts=counts([3], []))
    assert Sampler()(x.clone(), [seen_in_prompt])[0].token_id == 4  # 2.0/2 < 1.5
    assert Sampler()(x.clone(), [row(params)])[0].token_id == 3  # no counts: nothing to penalize


def test_min_p_keeps_tokens_at_least_min_p_times_the_most_likely():
    x = torch.full((1, VOCAB), -30.0)
    x[0, [2, 5, 8, 9]] = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert set(draw(SamplingParams(min_p=0.2), x, 400)) == {2, 5, 8}  # threshold 0.1
    assert set(draw(SamplingParams(min_p=0.5), x, 300)) == {2, 5}  # threshold 0.25
    assert set(draw(SamplingParams(min_p=1.0, temperature=2.0), x, 50)) == {2}
    assert set(draw(SamplingParams(min_p=0.0), x, 800)) == {2, 5, 8, 9}


def test_logit_bias_is_added_to_the_logits():
    x = logits(2, seed=6)
    first, second = x[0].topk(2).indices.tolist()
    greedy = SamplingParams(temperature=0.0)
    down = SamplingParams(temperature=0.0, logit_bias={first: -100.0})
    gap = (x[0, first] - x[0, second]).item()
    just_below = SamplingParams(temperature=0.0, logit_bias={second: gap - 1e-3})
    just_above = SamplingParams(temperature=0.0, logit_bias={second: gap + 1e-3})
    out = Sampler()(x.clone(), [row(down), row(greedy)])
    assert out[0].token_id == second and out[1].token_id == x[1].argmax().item()
    assert Sampler()(x[:1].clone(), [row(just_below)])[0].token_id == first
    assert Sampler()(x[:1].clone(), [row(just_above)])[0].token_id == second
    up = SamplingParams(temperature=1.0, logit_bias={17: 100.0})
    assert set(draw(up, x[:1], 50)) == {17}


def test_logprobs_stay_those_of_the_model_under_bias_and_penalties():
    x = logits(seed=7)
    params = SamplingParams(temperature=0.0, logprobs=2, logit_bias={11: 100.0}, presence_penalty=1.0)
    out = Sampler()(x.clone(), [SamplingRow(params, torch.Generator(), (), token_counts=counts([], [11]))])[0]
    raw = torch.log_softmax(x[0], -1)
    assert out.token_id == 11 and out.logprob == pytest.approx(raw[11].item())
    assert set(out.top_logprobs) == set(raw.topk(2).indices.tolist())


# End to end on the tiny model: stop conditions are applied by the engine.

@pytest.fixture(scope="module")
def llm():
    with LLM(max_model_len=128, num_gpu_blocks_override=64, device="cpu") as llm:
        yield llm


PROMPT = "The quick brown fox"


def test_stop_string_cuts_the_text_before_it(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = llm.generate(PROMPT, greedy)[0]
    text = full.text
    stop = text[5:8]
    assert stop and text.find(stop) == 5
    params = SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop, "\x00never"]
    )
    out = llm.generate(PROMPT, params)[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:5]
    assert full.token_ids[: len(out.token_ids)] == out.token_ids
    assert len(out.token_ids) < len(full.token_ids)


def test_stop_token_ends_generation_and_is_kept_in_token_ids(llm):
    greedy = dict(temperature=0.0, max_tokens=16, ignore_eos=True)
    full = llm.generate(PROMPT, SamplingParams(**greedy))[0]
    stop_id = full.token_ids[4]
    out = llm.generate(PROMPT, SamplingParams(**greedy, stop_token_ids=[stop_id]))[0]
    first = full.token_ids.index(stop_id)
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # min_tokens suppresses the stop token until enough tokens exist.
    params = SamplingParams(**greedy, stop_token_ids=[stop_id], min_tokens=first + 2)
    late = llm.generate(PROMPT, params)[0]
    assert stop_id not in late.token_ids[: first + 1] and len(late.token_ids) > first + 1


def test_max_tokens_gives_length(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_engine_logprobs_match_the_chosen_tokens(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=5, logprobs=2))[0]
    assert len(out.logprobs) == len(out.token_ids) == len(out.top_logprobs)
    for token, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert lp <= 0 and lp == pytest.approx(max(top.values()))
        assert top[token] == lp  # greedy: the chosen token is the most likely one


def test_seeded_requests_do_not_depend_on_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPT, params)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(["zzz", PROMPT, "another prompt"], [others, params, others])
    assert batch[1].token_ids == alone
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    unseeded = llm.generate([PROMPT, PROMPT], params)
    assert unseeded[0].token_ids != unseeded[1].token_ids  # each request has its own generator


def test_engine_counts_the_generated_tokens_for_the_penalties(llm, monkeypatch):
    """The counts a penalized sequence keeps match its prompt and its output at every step."""
    seen = []
    real = engine.sampler.apply_penalties

    def spy(logits, counts, **kwargs):
        seen.append((counts[0].prompt_mask.nonzero().flatten().tolist(), counts[0].output_counts.clone()))
        return real(logits, counts, **kwargs)

    monkeypatch.setattr(engine.sampler, "apply_penalties", spy)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, frequency_penalty=1.0)
    (out,) = llm.generate([PROMPT], params)
    assert len(seen) == 6
    for step, (prompt_tokens, output_counts) in enumerate(seen):
        assert prompt_tokens == sorted(set(out.prompt_token_ids))
        expected = torch.bincount(torch.tensor(out.token_ids[:step], dtype=torch.long), minlength=output_counts.numel())
        assert output_counts.tolist() == expected.tolist()


@pytest.mark.cuda
def test_on_a_gpu_the_draws_reach_the_host_without_waiting_for_work_queued_after_them():
    """What a forward launched a step ahead relies on (engine/lookahead.py): samples()
    waits for the draws' copy, not for the whole stream."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    x = logits(3).cuda()
    rows = [row(SamplingParams(temperature=0.0)), row(SamplingParams(temperature=0.0, logprobs=2)),
            row(SamplingParams(temperature=0.0, logprobs=0))]
    expected = Sampler()(x.clone(), rows)
    pending = Sampler().launch(x.clone(), rows)
    torch.cuda._sleep(2_000_000_000)  # a long kernel queued after the draws (~1 s)
    samples = pending.samples()
    assert not torch.cuda.current_stream().query()  # returned while that kernel still runs
    torch.cuda.synchronize()
    assert [s.token_id for s in samples] == [int(t) for t in x.argmax(dim=-1).tolist()]
    assert samples == expected
