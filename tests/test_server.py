"""The OpenAI-compatible server in-process: completions, chat, streaming format, logprobs and
the utility routes (errors: test_server_errors.py; auth and admin: test_server_admin.py)."""
from __future__ import annotations

import pytest

from engine_testing import one_thread  # noqa: F401  (autouse fixture)
from server_testing import BLOCK, GREEDY, LONG_PROMPT, MAX_MODEL_LEN, assert_error, run, sse_events, tiered_llm


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    yield from tiered_llm(tmp_path_factory)


# ---------------------------------------------------------------- completions and chat


def test_completion_and_cached_tokens_on_a_repeated_prompt(llm):
    async def test(c):
        first = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG_PROMPT, **GREEDY})
        second = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG_PROMPT, **GREEDY})
        return first, second

    first, second = run(llm, test)
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "tiny"
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["text"]
    usage = body["usage"]
    assert usage["completion_tokens"] == 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + 8
    again = second.json()
    assert again["choices"][0]["text"] == choice["text"]  # greedy
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= usage["prompt_tokens"] - 2 * BLOCK and cached % BLOCK == 0


def test_token_id_prompts_and_prompt_lists(llm):
    async def test(c):
        ids = await c.post("/v1/completions", json={"prompt": [256, 72, 105], **GREEDY})
        nested = await c.post("/v1/completions", json={"prompt": [[256, 72, 105]], **GREEDY})
        batch = await c.post("/v1/completions", json={"prompt": ["Once upon", "Hi"], "n": 2, **GREEDY})
        id_batch = await c.post("/v1/completions", json={"prompt": [[256, 72, 105], [256, 72]], **GREEDY})
        alone = [await c.post("/v1/completions", json={"prompt": p, **GREEDY}) for p in ("Once upon", "Hi")]
        return ids, nested, batch, id_batch, alone

    ids, nested, batch, id_batch, alone = run(llm, test)
    assert ids.status_code == nested.status_code == batch.status_code == id_batch.status_code == 200
    assert ids.json()["usage"]["prompt_tokens"] == 3
    assert ids.json()["choices"][0]["text"] == nested.json()["choices"][0]["text"]
    assert id_batch.json()["choices"][0]["text"] == ids.json()["choices"][0]["text"]
    assert id_batch.json()["usage"]["prompt_tokens"] == 5
    choices = batch.json()["choices"]  # OpenAI's numbering: prompt i has choices i*n .. i*n+n-1
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    texts = [c["text"] for c in choices]
    assert texts == [a.json()["choices"][0]["text"] for a in alone for _ in range(2)]  # greedy
    usage = batch.json()["usage"]
    assert usage["prompt_tokens"] == sum(a.json()["usage"]["prompt_tokens"] for a in alone)
    assert usage["completion_tokens"] == 4 * GREEDY["max_tokens"]


def test_chat_completion(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]

    async def test(c):
        plain = await c.post("/v1/chat/completions", json={"messages": messages, **GREEDY})
        parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
        by_parts = await c.post("/v1/chat/completions", json={"messages": [messages[0], *parts], **GREEDY})
        new_name = await c.post(
            "/v1/chat/completions",
            json={"messages": messages, "max_completion_tokens": 3, "temperature": 0, "ignore_eos": True},
        )
        # several text parts are one text, joined by newlines as vLLM joins them
        two = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
        joined = [await c.post("/tokenize", json={"messages": [{"role": "user", "content": content}]})
                  for content in (two, "Hi\nthere")]
        return plain, by_parts, new_name, joined

    plain, by_parts, new_name, joined = run(llm, test)
    body = plain.json()
    assert plain.status_code == 200 and body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    assert by_parts.json()["choices"][0]["message"] == message
    assert new_name.json()["usage"]["completion_tokens"] == 3
    assert joined[0].json()["tokens"] == joined[1].json()["tokens"]


def test_chat_stream_format_and_usage(llm):
    messages = [{"role": "user", "content": "Stream please"}]

    async def test(c):
        streamed = await c.post(
            "/v1/chat/completions",
            json={"messages": messages, "stream": True, "stream_options": {"include_usage": True}, **GREEDY},
        )
        whole = await c.post("/v1/chat/completions", json={"messages": messages, **GREEDY})
        return streamed, whole

    streamed, whole = run(llm, test)
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    chunks = sse_events(streamed.text)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    *content, final, usage = chunks
    assert final["choices"][0]["finish_reason"] == "length" and final["choices"][0]["delta"] == {}
    assert all(c["choices"][0]["finish_reason"] is None for c in content)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
    assert text == whole.json()["choices"][0]["message"]["content"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8


def test_completion_stream_without_usage(llm):
    async def test(c):
        streamed = await c.post("/v1/completions", json={"prompt": "Once upon", "stream": True, **GREEDY})
        whole = await c.post("/v1/completions", json={"prompt": "Once upon", **GREEDY})
        return streamed, whole

    streamed, whole = run(llm, test)
    chunks = sse_events(streamed.text)
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole.json()["choices"][0]["text"]


def test_continuous_usage_stats_put_each_choices_usage_in_every_chunk(llm):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage of its
    choice so far (counted here by the tokens' logprobs the chunks brought: a loop that
    fell behind the engine sends several tokens in one chunk); the last usage-only chunk
    is the total as before."""
    options = {"include_usage": True, "continuous_usage_stats": True}

    async def test(c):
        completion = await c.post("/v1/completions", json={
            "prompt": "Hi", "stream": True, "stream_options": options, "n": 2, "logprobs": 0,
            **GREEDY,
        })
        chat = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "stream": True, "stream_options": options,
            "logprobs": True, **GREEDY,
        })
        return completion, chat

    completion, chat = run(llm, test)
    for response, n, tokens_of in (
        (completion, 2, lambda choice: choice["logprobs"]["tokens"]),
        (chat, 1, lambda choice: choice["logprobs"]["content"]),
    ):
        chunks = sse_events(response.text)
        *choice_chunks, total = chunks
        assert total["choices"] == [] and total["usage"]["completion_tokens"] == 8 * n
        prompt = total["usage"]["prompt_tokens"]
        for k in range(n):
            sent = 0
            for chunk in (c for c in choice_chunks if c["choices"][0]["index"] == k):
                choice, used = chunk["choices"][0], chunk["usage"]
                sent += len(tokens_of(choice)) if choice.get("logprobs") else 0
                assert used["completion_tokens"] == sent
                assert used["prompt_tokens"] == prompt and used["total_tokens"] == prompt + sent
            assert sent == 8


def test_a_streamed_chat_names_its_stop_reason_on_the_last_chunk(llm):
    messages = [{"role": "user", "content": "Hi"}]

    async def test(c):
        whole = await c.post("/v1/chat/completions", json={"messages": messages, **GREEDY})
        stop = whole.json()["choices"][0]["message"]["content"][3:5]
        streamed = await c.post(
            "/v1/chat/completions", json={"messages": messages, "stream": True, "stop": [stop], **GREEDY}
        )
        return stop, streamed

    stop, streamed = run(llm, test)
    last = sse_events(streamed.text)[-1]["choices"][0]
    assert last["finish_reason"] == "stop" and last["stop_reason"] == stop


def test_logprobs(llm):
    async def test(c):
        completion = await c.post("/v1/completions", json={"prompt": "Hi", "logprobs": 2, **GREEDY})
        chat = await c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 2, **GREEDY},
        )
        return completion, chat

    completion, chat = run(llm, test)
    lp = completion.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 8
    assert all(x <= 0 for x in lp["token_logprobs"])
    assert all(len(top) <= 2 for top in lp["top_logprobs"])
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 8 and all(len(t["top_logprobs"]) == 2 for t in content)
    # greedy: the chosen token is the most likely one
    assert all(t["logprob"] == pytest.approx(max(x["logprob"] for x in t["top_logprobs"])) for t in content)


def test_a_completions_top_logprobs_hold_the_sampled_token(llm):
    """As vLLM's: the k most likely tokens and the one sampled, which a sampled request
    often draws from outside the top k."""
    body = {"prompt": "Hi", "logprobs": 1, "max_tokens": 24, "temperature": 1.5, "seed": 3, "ignore_eos": True}

    async def test(c):
        return await c.post("/v1/completions", json=body)

    lp = run(llm, test).json()["choices"][0]["logprobs"]
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert token in top and 1 <= len(top) <= 2
        if len(top) == 2:  # (texts are keys: two byte tokens may both read as U+FFFD)
            assert top[token] == pytest.approx(logprob)
    assert any(len(top) == 2 for top in lp["top_logprobs"])  # one drawn outside the top 1


def test_logprobs_0_lists_each_token_alone_in_its_top_logprobs(llm):
    """As vLLM's: no other token is asked for, and the sampled one (with ``echo``, each
    prompt token after the first) is still there."""
    body = {"prompt": "Hi", "logprobs": 0, **GREEDY}

    async def test(c):
        return [
            await c.post("/v1/completions", json=body),
            await c.post("/v1/completions", json={**body, "stream": True}),
            await c.post("/v1/completions", json={**body, "echo": True}),
        ]

    def alone(lp):
        return [None if x is None else {t: x} for t, x in zip(lp["tokens"], lp["token_logprobs"])]

    whole, streamed, echoed = run(llm, test)
    lp = whole.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 8 and lp["top_logprobs"] == alone(lp)
    chunks = [e["choices"][0]["logprobs"] for e in sse_events(streamed.text)]
    assert sum(len(c["tokens"]) for c in chunks) == 8
    assert all(c["top_logprobs"] == alone(c) for c in chunks)
    echo = echoed.json()["choices"][0]["logprobs"]
    assert echo["top_logprobs"][0] is None and echo["top_logprobs"] == alone(echo)


def test_seed_stop_and_cache_salt(llm):
    async def test(c):
        body = {"prompt": LONG_PROMPT, "temperature": 1.0, "seed": 7, "max_tokens": 8, "ignore_eos": True}
        a = await c.post("/v1/completions", json=body)
        b = await c.post("/v1/completions", json=body)
        salted = await c.post("/v1/completions", json={**body, "cache_salt": "tenant-x"})
        text = a.json()["choices"][0]["text"]
        stop = await c.post("/v1/completions", json={**body, "stop": text[2:4]})
        return a, b, salted, stop

    a, b, salted, stop = run(llm, test)
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
    assert salted.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    choice = stop.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and len(choice["text"]) <= 2


def test_several_served_names_and_keys(llm):
    """vLLM's `--served-model-name a b` and `--api-key k1 k2`: a request may name either model
    and carry either key; /v1/models lists both names; the first names the responses."""

    async def test(c):
        out = []
        for model, key in (("alpha", "k1"), ("beta", "k2"), ("gamma", "k1"), ("alpha", "k3")):
            out.append(await c.post(
                "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2},
                headers={"Authorization": f"Bearer {key}"},
            ))
        out.append(await c.get("/v1/models", headers={"Authorization": "Bearer k2"}))
        return out

    alpha, beta, gamma, wrong_key, models = run(
        llm, test, served_model_name=("alpha", "beta"), api_key=("k1", "k2")
    )
    assert alpha.status_code == beta.status_code == 200
    assert alpha.json()["model"] == beta.json()["model"] == "alpha"
    assert_error(gamma, 404, param="model", code="model_not_found")
    assert_error(wrong_key, 401, code="invalid_api_key")
    assert [m["id"] for m in models.json()["data"]] == ["alpha", "beta"]


def test_tokenize_detokenize_version_and_ping(llm):
    """vLLM's utility routes, with its fields."""
    tokenizer = llm.tokenizer
    messages = [{"role": "user", "content": "Hi there"}]

    async def test(c):
        return [
            await c.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}),
            await c.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}),
            await c.post("/tokenize", json={"messages": messages}),
            await c.post("/tokenize", json={"prompt": "x", "messages": messages}),
            await c.post("/detokenize", json={"tokens": tokenizer.encode("Hello world", add_special_tokens=False)}),
            await c.post("/detokenize", json={"tokens": [tokenizer.vocab_size]}),
            await c.get("/version"),
            await c.get("/ping"),
            await c.post("/ping"),
        ]

    prompt, plain, chat, both, text, outside, version, ping, ping_post = run(llm, test)
    ids = tokenizer.encode("Hello world")
    assert prompt.json() == {
        "count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
        "token_strs": [tokenizer.decode([t], skip_special_tokens=False) for t in ids],
    }
    assert plain.json()["tokens"] == tokenizer.encode("Hello world", add_special_tokens=False)
    rendered = tokenizer.apply_chat_template(messages)
    assert chat.json()["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert_error(both, 400, param="prompt")
    assert text.json() == {"prompt": "Hello world"}
    assert_error(outside, 400, param="tokens")
    assert version.status_code == 200 and version.json()["version"]
    assert ping.status_code == ping_post.status_code == 200


def test_models_health_and_metrics(llm):
    async def test(c):
        await c.post("/v1/completions", json={"prompt": LONG_PROMPT, **GREEDY})
        # OpenAI's retrieve, as `client.models.retrieve(id)` asks; ids such as "org/name" hold a "/"
        card, unknown = await c.get("/v1/models/my-model"), await c.get("/v1/models/org/other-model")
        return await c.get("/v1/models"), card, unknown, await c.get("/health"), await c.get("/metrics")

    models, card, unknown, health, metrics = run(llm, test, served_model_name="my-model")
    assert models.json()["data"][0]["id"] == "my-model"
    assert models.json()["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert card.json() == models.json()["data"][0]
    assert_error(unknown, 404, param="model", code="model_not_found")
    assert health.status_code == 200
    text = metrics.text
    for name in (
        'tiered_kv_requests_total{model_name="my-model",route="/v1/models/{model:path}",status="404"}',
        'tiered_kv_stored_blocks_total{model_name="my-model",tier="cpu"}',  # tiers
        'tiered_kv_lookups_total{model_name="my-model",tier="disk"}',
        "vllm:time_to_first_token_seconds_bucket",  # server
        "vllm:inter_token_latency_seconds_count",
        'tiered_kv_requests_total{model_name="my-model",route="/v1/completions",status="200"}',
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="my-model"}',
        'vllm:num_requests_running{engine="0",model_name="my-model"}',  # engine
        "vllm:num_requests_waiting",
        "tiered_kv_num_requests_loading",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
    ):
        assert name in text, name
