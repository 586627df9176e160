"""The engine against Hugging Face ``transformers`` on a tiny random Llama written by it.

Greedy tokens must match token for token, and the log-probabilities of the chosen tokens
(and the top 5) must match within fp32 tolerance — with prefix-cache hits, chunked prefill
and preemption. fp8 KV is measured against the auto dtype and reported.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, RequestOutput, SamplingParams
from engine_testing import one_thread, random_prompts, reference_llama  # noqa: F401  (fixtures)

transformers = pytest.importorskip("transformers")

PROMPT_LENS = (5, 17, 33, 50, 70)
MAX_TOKENS = 24
ATOL = 1e-4  # fp32 logprobs; the two implementations differ only in summation order
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def checkpoint(reference_llama):
    return reference_llama


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(PROMPT_LENS, seed=1)


@pytest.fixture(scope="module")
def reference(checkpoint, prompts):
    """Per prompt (no padding): greedy tokens and the log-softmax of every step's logits."""
    _, model = checkpoint
    model.generation_config.eos_token_id = None  # generate exactly MAX_TOKENS, like ignore_eos
    refs = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)  # [T, vocab]
            refs.append((tokens, logprobs))
    return refs


def assert_matches(outs: list[RequestOutput], reference) -> None:
    for out, (tokens, logprobs) in zip(outs, reference, strict=True):
        assert out.token_ids == tokens
        chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
        torch.testing.assert_close(torch.tensor(out.logprobs), chosen, atol=ATOL, rtol=0)
        for step, top in enumerate(out.top_logprobs):
            values, ids = logprobs[step].topk(5)
            assert list(top) == ids.tolist()
            torch.testing.assert_close(torch.tensor(list(top.values())), values, atol=ATOL, rtol=0)


def test_batch_matches_transformers_and_again_from_the_prefix_cache(checkpoint, prompts, reference):
    with LLM(checkpoint[0], max_model_len=128, num_gpu_blocks_override=64, device="cpu") as llm:
        first = llm.generate(prompts, PARAMS)
        assert_matches(first, reference)
        assert all(o.num_cached_tokens == 0 for o in first)
        second = llm.generate(prompts, PARAMS)
        assert_matches(second, reference)
        assert [o.num_cached_tokens for o in second] == [(n - 1) // 16 * 16 for n in PROMPT_LENS]
        assert llm.engine.stats().prefix_cache_hits > 0


def test_chunked_prefill_matches_transformers(checkpoint, prompts, reference):
    with LLM(
        checkpoint[0], device="cpu", max_model_len=128, num_gpu_blocks_override=64,
        max_num_batched_tokens=16,
    ) as llm:
        assert_matches(llm.generate(prompts, PARAMS), reference)


def test_preemption_matches_transformers(checkpoint, prompts, reference):
    with LLM(checkpoint[0], max_model_len=128, num_gpu_blocks_override=8, device="cpu") as llm:
        assert_matches(llm.generate(prompts, PARAMS), reference)
        assert llm.engine.stats().num_preemptions > 0


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("chunked", [True, False])
def test_greedy_is_the_same_with_caching_and_chunking_on_or_off(
    checkpoint, prompts, reference, caching, chunked
):
    budget = 32 if chunked else 128
    with LLM(
        checkpoint[0],
        max_model_len=128,
        num_gpu_blocks_override=64,
        enable_prefix_caching=caching,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=budget,
        device="cpu",
    ) as llm:
        llm.generate(prompts[:2], PARAMS)  # warm the prefix cache (when on)
        outs = llm.generate(prompts, PARAMS)
        assert [o.token_ids for o in outs] == [tokens for tokens, _ in reference]
        assert (sum(o.num_cached_tokens for o in outs) > 0) == caching


def test_fp8_kv_runs_and_stays_close(checkpoint, prompts, reference):
    """fp8 (e4m3, per-layer power-of-two scales) is lossy: measure, report, bound loosely."""
    with LLM(
        checkpoint[0], device="cpu", max_model_len=128, num_gpu_blocks_override=64,
        kv_cache_dtype="fp8",
    ) as llm:
        assert llm.engine.model_runner.kv_cache.dtype == torch.float8_e4m3fn
        outs = llm.generate(prompts, PARAMS)
    report = []
    for out, (tokens, logprobs) in zip(outs, reference):
        diverge = next((i for i, (a, b) in enumerate(zip(out.token_ids, tokens)) if a != b), None)
        same = len(tokens) if diverge is None else diverge
        # Compare log-probabilities on the common prefix, where both saw the same context.
        chosen = logprobs[torch.arange(same), torch.tensor(tokens[:same])]
        max_diff = (torch.tensor(out.logprobs[:same]) - chosen).abs().max().item() if same else 0.0
        report.append((len(out.prompt_token_ids), diverge, max_diff))
    print("\nfp8 vs transformers (prompt len, first differing token, max |Δ logprob| before it):")
    for row in report:
        print("  ", row)
    assert all(max_diff < 0.5 for _, _, max_diff in report)
    assert all(diverge is None or diverge > 0 for _, diverge, _ in report)  # first tokens agree
