"""Prompt logprobs over HTTP: vLLM's ``prompt_logprobs`` on both routes, and completions'
``echo`` with ``logprobs`` (the prompt's tokens first: what scoring harnesses such as
lm-eval send, with ``max_tokens: 0``). The numbers are the engine's, checked against
``transformers`` in tests/test_prompt_logprobs.py; here they must arrive in vLLM's shapes."""
from __future__ import annotations

import pytest

from engine import LLM, AsyncLLM, SamplingParams
from engine_testing import one_thread  # noqa: F401  (autouse fixture)
from server_testing import MAX_MODEL_LEN, assert_error, run

NEUTRAL = {"generation_config": "vllm", "kv_offloading_size": 0, "kv_disk_size": 0}
PROMPT = [256, 79, 110, 99, 101, 32, 117, 112, 111, 110, 32, 97]  # BOS "Once upon a"
ATOL = 1e-5


@pytest.fixture(scope="module")
def llm():
    llm = AsyncLLM("tiny", max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64, device="cpu")
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def reference():
    """The prompt's entries with the whole vocabulary, from a separate engine."""
    with LLM("tiny", max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64, device="cpu") as ref:
        (out,) = ref.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=-1))
    return out.prompt_logprobs


def decoded(llm, token_id: int) -> str:
    return llm.tokenizer.decode([token_id], skip_special_tokens=False)


def assert_vllm_entries(llm, entries, reference, k: int) -> None:
    """Per token: the prompt token with its rank, and the k most likely with ranks 1..k."""
    assert len(entries) == len(reference) and entries[0] is None
    for entry, ref in zip(entries[1:], reference[1:]):
        top = list(ref.top.items())[:k]
        expected = {str(t): (lp, rank) for rank, (t, lp) in enumerate(top, start=1)}
        expected.setdefault(str(ref.token_id), (ref.logprob, ref.rank))
        assert set(entry) == set(expected)
        for token_id, (lp, rank) in expected.items():
            assert entry[token_id]["logprob"] == pytest.approx(lp, abs=ATOL)
            assert entry[token_id]["rank"] == rank
            assert entry[token_id]["decoded_token"] == decoded(llm, int(token_id))


def test_prompt_logprobs_on_both_routes(llm, reference):
    async def test(c):
        completion = await c.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2, "n": 2, "temperature": 0,
        })
        chat = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0,
        })
        plain = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        return completion, chat, plain

    completion, chat, plain = run(llm, test, **NEUTRAL)
    assert completion.status_code == 200, completion.text
    choices = completion.json()["choices"]
    assert len(choices) == 2
    for choice in choices:
        assert_vllm_entries(llm, choice["prompt_logprobs"], reference, 2)
    assert chat.status_code == 200, chat.text
    body = chat.json()
    entries = body["prompt_logprobs"]
    assert len(entries) == body["usage"]["prompt_tokens"] and entries[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in entries[1:])
    assert plain.json()["choices"][0]["prompt_logprobs"] is None


def test_echo_with_logprobs_lists_the_prompt_tokens_first(llm, reference):
    async def test(c):
        return await c.post("/v1/completions", json={
            "prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0,
            "ignore_eos": True,
        })

    response = run(llm, test, **NEUTRAL)
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    n = len(PROMPT)
    assert len(logprobs["tokens"]) == n + 3
    assert logprobs["tokens"][:n] == [decoded(llm, t) for t in PROMPT]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for i, ref in enumerate(reference[1:], start=1):
        assert logprobs["token_logprobs"][i] == pytest.approx(ref.logprob, abs=ATOL)
        top = logprobs["top_logprobs"][i]
        assert logprobs["tokens"][i] in top and 2 <= len(top) <= 3
    assert all(isinstance(lp, float) for lp in logprobs["token_logprobs"][n:])
    lengths = [len(t) for t in logprobs["tokens"]]
    assert logprobs["text_offset"] == [sum(lengths[:i]) for i in range(n + 3)]


def test_echo_with_logprobs_and_max_tokens_0_scores_each_prompt(llm, reference):
    """lm-eval's loglikelihood request: the prompts' logprobs, nothing generated."""

    async def test(c):
        return await c.post("/v1/completions", json={
            "prompt": [PROMPT, PROMPT[:5]], "echo": True, "logprobs": 1, "max_tokens": 0, "n": 2,
        })

    response = run(llm, test, **NEUTRAL)
    assert response.status_code == 200, response.text
    body = response.json()
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert {c["finish_reason"] for c in choices} == {"length"}
    for choice, prompt in zip(choices, [PROMPT, PROMPT, PROMPT[:5], PROMPT[:5]]):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(prompt)
        assert choice["text"] == llm.tokenizer.decode(prompt)
        assert logprobs["token_logprobs"][1:] == pytest.approx(
            [r.logprob for r in reference[1 : len(prompt)]], abs=ATOL
        )
    usage = body["usage"]
    assert usage["completion_tokens"] == 0
    assert usage["prompt_tokens"] == len(PROMPT) + 5 == usage["total_tokens"]  # each prompt once


def test_prompt_logprobs_requests_that_cannot_be_served_get_400(llm):
    async def test(c):
        post = c.post
        return [
            await post("/v1/completions", json={"prompt": "x", "prompt_logprobs": 1, "stream": True}),
            await post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1, "stream": True,
            }),
            await post("/v1/completions", json={"prompt": "x", "prompt_logprobs": 4}),
            await post("/v1/completions", json={"prompt": "x", "prompt_logprobs": -1}),
            await post("/v1/completions", json={"prompt": "x", "prompt_logprobs": -2}),
            await post("/v1/completions", json={"prompt": "x", "echo": True, "logprobs": 4, "max_tokens": 0}),
        ]

    streamed, chat_streamed, too_many, all_of_them, negative, echo_too_many = run(
        llm, test, max_logprobs=3, **NEUTRAL
    )
    assert_error(streamed, 400, param="prompt_logprobs")
    assert_error(chat_streamed, 400, param="prompt_logprobs")
    assert_error(too_many, 400, param="prompt_logprobs")
    assert_error(all_of_them, 400, param="prompt_logprobs")
    assert_error(negative, 400)
    assert_error(echo_too_many, 400, param="logprobs")


def test_the_whole_vocabulary_when_the_server_allows_it(llm):
    async def test(c):
        return await c.post("/v1/completions", json={"prompt": PROMPT[:3], "max_tokens": 1, "prompt_logprobs": -1})

    response = run(llm, test, max_logprobs=-1, **NEUTRAL)
    assert response.status_code == 200, response.text
    entries = response.json()["choices"][0]["prompt_logprobs"]
    vocab = llm.tokenizer.vocab_size
    assert [len(e) for e in entries[1:]] == [vocab, vocab]
