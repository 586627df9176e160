from __future__ import annotations

import math

import pytest
import torch

from engine import LLM
import engine.sampler
from engine.sampler import Sample, SampleError, Sampler, SamplingParams, SamplingRow
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
    real = engine.sampler._filtered_probs

    def filtered_probs(logits, params):
        if cursed in params:
            raise RuntimeError("cursed row")
        return real(logits, params)

    monkeypatch.setattr(engine.sampler, "_filtered_probs", filtered_probs)
    x = logits(3)
    out = Sampler()(x.clone(), [row(SamplingParams()), row(cursed), row(SamplingParams(temperature=0.0))])
    assert isinstance(out[0], Sample) and out[2].token_id == x[2].argmax().item()
    assert isinstance(out[1], SampleError) and str(out[1].error) == "cursed row"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": 0},
        {"top_k": -1},
        {"max_tokens": 0},
        {"min_tokens": 5, "max_tokens": 4},
        {"stop": [""]},
        {"stop_token_ids": [-1]},
        {"seed": -1},
        {"logprobs": -1},
        {"ignore_eos": "yes"},
    ],
)
def test_invalid_params_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_params_normalize_stop_arguments():
    p = SamplingParams(stop="\n", stop_token_ids=[5, 6])
    assert p.stop == ("\n",) and p.stop_token_ids == (5, 6)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    hash(p)


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
