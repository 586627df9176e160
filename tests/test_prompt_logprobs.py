"""Prompt logprobs against Hugging Face ``transformers``: for each prompt token after the
first, its log-probability, rank and top-k must equal a log-softmax of the reference's
logits within fp32 tolerance, however the prompt is computed (one step, chunks, after a
preemption) and whatever the caches hold (a request that asks recomputes its prompt)."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, PromptLogprob, RequestOutput, SamplingParams
from engine_testing import (  # noqa: F401  (fixtures)
    MemoryConnector, one_thread, random_prompts, reference_llama,
)

transformers = pytest.importorskip("transformers")

PROMPT_LENS = (2, 17, 33, 70)
ATOL = 1e-4  # fp32; the two implementations differ only in summation order
TOP = 3


def params(prompt_logprobs: int = TOP, max_tokens: int = 1) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=prompt_logprobs
    )


@pytest.fixture(scope="module")
def checkpoint(reference_llama):
    return reference_llama


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(PROMPT_LENS, seed=2)


@pytest.fixture(scope="module")
def reference(checkpoint, prompts):
    """Per prompt: the log-softmax of the logits at each position but the last."""
    _, model = checkpoint
    with torch.inference_mode():
        return [
            torch.log_softmax(model(torch.tensor([p])).logits[0, :-1].float(), dim=-1)
            for p in prompts
        ]


def assert_matches(out: RequestOutput, prompt: list[int], logprobs: torch.Tensor, top: int) -> None:
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0] is None
    for pos, (entry, token) in enumerate(zip(entries[1:], prompt[1:])):
        ref = logprobs[pos]
        assert isinstance(entry, PromptLogprob) and entry.token_id == token
        assert entry.logprob == pytest.approx(ref[token].item(), abs=ATOL)
        assert entry.rank == int((ref >= ref[token]).sum())
        k = ref.numel() if top < 0 else top
        values, ids = ref.topk(k)
        assert list(entry.top) == ids.tolist()
        torch.testing.assert_close(torch.tensor(list(entry.top.values())), values, atol=ATOL, rtol=0)


def assert_all_match(outs, prompts, reference, top: int = TOP) -> None:
    for out, prompt, logprobs in zip(outs, prompts, reference, strict=True):
        assert_matches(out, prompt, logprobs, top)


@pytest.mark.parametrize(
    "engine",
    [
        dict(),  # every prompt in one step
        dict(max_num_batched_tokens=16),  # chunks of up to 16 tokens, several per prompt
    ],
    ids=["one-step", "chunked"],
)
def test_prompt_logprobs_match_transformers(checkpoint, prompts, reference, engine):
    with LLM(checkpoint[0], device="cpu", max_model_len=128, num_gpu_blocks_override=64, **engine) as llm:
        outs = llm.generate(prompts, params())
    assert_all_match(outs, prompts, reference)
    assert all(len(o.token_ids) == 1 for o in outs)


def test_a_request_preempted_mid_prompt_gives_each_entry_once(checkpoint, prompts, reference):
    with LLM(
        checkpoint[0], device="cpu", max_model_len=128, num_gpu_blocks_override=8,
        max_num_batched_tokens=16,
    ) as llm:
        outs = llm.generate(prompts, params(max_tokens=16))
        assert llm.engine.stats().num_preemptions > 0
    assert_all_match(outs, prompts, reference)


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(checkpoint, prompts, reference):
    with LLM(checkpoint[0], device="cpu", max_model_len=128, num_gpu_blocks_override=64) as llm:
        plain = SamplingParams(temperature=0.0, max_tokens=1)
        assert sum(o.num_cached_tokens for o in llm.generate(prompts, plain)) == 0
        assert sum(o.num_cached_tokens for o in llm.generate(prompts, plain)) > 0  # cached
        outs = llm.generate(prompts, params())
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert_all_match(outs, prompts, reference)


def test_blocks_below_the_gpu_are_not_looked_up_for_prompt_logprobs(checkpoint, prompts, reference):
    store: dict = {}
    engine = dict(device="cpu", max_model_len=128, num_gpu_blocks_override=64)
    with LLM(checkpoint[0], kv_connector=MemoryConnector(store), **engine) as llm:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))
    assert store  # the prompts' full blocks were saved
    connector = MemoryConnector(store)
    with LLM(checkpoint[0], kv_connector=connector, **engine) as llm:
        plain = llm.generate(prompts[-1:], SamplingParams(temperature=0.0, max_tokens=1))
        outs = llm.generate(prompts[:-1], params())
    assert [load[0] for load in connector.loads] == [plain[0].request_id]  # the store serves
    assert plain[0].num_cached_tokens > 0
    asked = {o.request_id for o in outs}
    assert not [q for q in connector.queries if q[0] in asked]
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert_all_match(outs, prompts[:-1], reference[:-1])


@pytest.mark.parametrize("top", [0, -1])
def test_no_alternatives_or_the_whole_vocabulary(checkpoint, prompts, reference, top):
    with LLM(checkpoint[0], device="cpu", max_model_len=128, num_gpu_blocks_override=64) as llm:
        outs = llm.generate(prompts[1:2], params(top))
    assert_all_match(outs, prompts[1:2], reference[1:2], top)
    assert {len(e.top) for e in outs[0].prompt_logprobs[1:]} == {0 if top == 0 else 264}


def test_a_one_token_prompt_has_only_the_leading_none(checkpoint):
    with LLM(checkpoint[0], device="cpu", max_model_len=128, num_gpu_blocks_override=64) as llm:
        out, plain = llm.generate([[7], [7, 8]], [params(), SamplingParams(max_tokens=1)])
    assert out.prompt_logprobs == [None]
    assert plain.prompt_logprobs is None


def test_every_output_of_a_request_shares_its_prompt_logprobs(checkpoint, prompts):
    with LLM(checkpoint[0], device="cpu", max_model_len=128, num_gpu_blocks_override=64) as llm:
        engine = llm.engine
        engine.add_request(prompts[2], params(max_tokens=3), request_id="r")
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.request_id == "r"]
    assert len(outs) == 3
    assert all(o.prompt_logprobs is outs[0].prompt_logprobs for o in outs)
    assert len(outs[0].prompt_logprobs) == len(prompts[2])


@pytest.mark.parametrize("bad", [-2, 1.5, True, "3"])
def test_invalid_prompt_logprobs_are_refused(bad):
    with pytest.raises(ValueError, match="prompt_logprobs must be"):
        SamplingParams(prompt_logprobs=bad)
