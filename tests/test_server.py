"""The OpenAI-compatible server in-process: routes, streaming format, errors, auth, admin."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

import engine.sampler
from engine import AsyncLLM
from engine_testing import fail_detokenizing, hold_steps, one_thread  # noqa: F401  (one_thread: autouse fixture)
from storage.lmdb_store import LmdbStore
from server_testing import ADMIN, BLOCK, GREEDY, MAX_MODEL_LEN, assert_error, post_json, run, sse_events
from tiered_kv import TierConfig, TierManager

LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 3  # ~136 tokens: 8 full blocks


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    manager = TierManager(
        TierConfig(kv_cache_dir=tmp_path_factory.mktemp("kv") / "cache", cpu_bytes=4 << 20, disk_bytes=64 << 20)
    )
    llm = AsyncLLM(
        "tiny", kv_connector=manager, max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64,
        block_size=BLOCK, device="cpu"
    )
    yield llm
    llm.shutdown()


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
    choice so far; the last usage-only chunk is the total as before."""
    options = {"include_usage": True, "continuous_usage_stats": True}

    async def test(c):
        completion = await c.post("/v1/completions", json={
            "prompt": "Hi", "stream": True, "stream_options": options, "n": 2, **GREEDY,
        })
        chat = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "stream": True, "stream_options": options, **GREEDY,
        })
        return completion, chat

    completion, chat = run(llm, test)
    for response, n in ((completion, 2), (chat, 1)):
        chunks = sse_events(response.text)
        *choice_chunks, total = chunks
        assert total["choices"] == [] and total["usage"]["completion_tokens"] == 8 * n
        prompt = total["usage"]["prompt_tokens"]
        for k in range(n):
            seen = [c["usage"] for c in choice_chunks if c["choices"][0]["index"] == k]
            counts = [u["completion_tokens"] for u in seen]
            assert counts == sorted(counts) and counts[-1] == 8 and len(set(counts)) > 1
            assert all(u["prompt_tokens"] == prompt and u["total_tokens"] == prompt + u["completion_tokens"] for u in seen)


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


# ---------------------------------------------------------------- errors


def test_invalid_requests_get_400_in_openai_shape(llm):
    async def test(c):
        post = c.post
        return [
            await post("/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"}),
            await post("/v1/completions", json={"prompt": "x", "n": 0}),
            await post("/v1/completions", json={"prompt": "x", "temperature": "hot"}),
            await post("/v1/completions", json={"prompt": "x", "echo": True, "logprobs": 1, "stream": True}),
            await post("/v1/completions", json={"max_tokens": 3}),
            await post("/v1/completions", json={"prompt": "x" * (MAX_MODEL_LEN + 10)}),
            await post("/v1/chat/completions", json={"messages": []}),
            await post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}),
            await post("/v1/completions", json={"prompt": [10**9]}),
            await post("/v1/completions", json={"prompt": "x", "presence_penalty": 2.5}),
            await post("/v1/completions", json={"prompt": "x", "stream": True, "max_tokens": 0}),
            # curl -d without -H: JSON sent as a form
            await post("/v1/completions", content=b'{"prompt": "x"}',
                       headers={"content-type": "application/x-www-form-urlencoded"}),
        ]

    malformed, n, temperature, echo, missing, too_long, empty, role, bad_id, penalty, zero, form = run(llm, test)
    assert_error(malformed, 400)
    assert "JSON" in malformed.json()["error"]["message"]
    assert_error(form, 400)
    assert "Content-Type: application/json" in form.json()["error"]["message"]
    assert_error(n, 400, param="n")
    assert_error(temperature, 400, param="temperature")
    assert_error(echo, 400, param="prompt_logprobs")  # the prompt's logprobs are not streamed
    assert_error(missing, 400, param="prompt")
    assert_error(too_long, 400, param="prompt", code="context_length_exceeded")
    assert_error(empty, 400, param="messages")
    assert_error(role, 400, param="messages")
    assert_error(bad_id, 400)
    assert_error(penalty, 400, param="presence_penalty")
    assert_error(zero, 400, param="max_tokens")


def test_extreme_sampling_values_are_clamped_or_refused(llm):
    """As vLLM: temperatures below 1e-5 are greedy, a top_k past the vocabulary is off, the
    most likely token survives any top_p, and values out of range are 400s. None of them
    stops the engine."""
    body = {"prompt": LONG_PROMPT, "max_tokens": 4, "ignore_eos": True}
    accepted = [
        {"temperature": 1e-300}, {"temperature": 1e-40}, {"top_p": 1e-300, "seed": 1},
        {"top_k": 2**63 - 1}, {"top_k": -1}, {"top_k": 0}, {"temperature": 2.5}, {"seed": -1},
    ]
    refused = [
        ("temperature", -0.5), ("temperature", float("inf")), ("top_p", 0), ("top_p", 1.5), ("top_k", -2),
        ("top_k", 2**63), ("max_tokens", 2**64), ("min_tokens", 5), ("seed", 2**63),
        ("stop_token_ids", [2**64]),
    ]

    async def test(c):
        greedy = await c.post("/v1/completions", json={**body, "temperature": 0})
        ok = [await c.post("/v1/completions", json={**body, **extra}) for extra in accepted]
        bad = [await post_json(c, "/v1/completions", {**body, name: value}) for name, value in refused]
        return greedy, ok, bad, await c.get("/health")

    greedy, ok, bad, health = run(llm, test)
    assert all(r.status_code == 200 for r in ok), [r.text for r in ok]
    text = greedy.json()["choices"][0]["text"]
    assert [r.json()["choices"][0]["text"] for r in ok[:3]] == [text] * 3  # all three are greedy
    for response, (name, _) in zip(bad, refused):
        assert_error(response, 400, param=name)
    assert health.status_code == 200 and llm.is_running


def test_a_request_that_fails_in_the_engine_gets_500_and_the_engine_runs_on(llm, monkeypatch):
    """Sampling the requests with seed 13 raises: they get a 500 that does not repeat the
    exception, while a request sampled in the same batch and the ones after succeed."""
    real = engine.sampler.filtered_probs

    def filtered_probs(logits, params):
        if any(p.seed == 13 for p in params):
            raise RuntimeError("secret detail")
        return real(logits, params)

    monkeypatch.setattr(engine.sampler, "filtered_probs", filtered_probs)
    body = {"prompt": LONG_PROMPT, "max_tokens": 8, "ignore_eos": True, "temperature": 1.0}
    messages = [{"role": "user", "content": "Hi"}]

    async def test(c):
        failed, beside = await asyncio.gather(
            c.post("/v1/completions", json={**body, "seed": 13}),
            c.post("/v1/completions", json={**body, "seed": 14}),
        )
        sampling = {k: v for k, v in body.items() if k != "prompt"}
        chat = await c.post("/v1/chat/completions", json={"messages": messages, **sampling, "seed": 13})
        after = await c.post("/v1/completions", json={**body, "seed": 14})
        return failed, chat, beside, after, await c.get("/health"), await c.get("/metrics")

    failed, chat, beside, after, health, metrics = run(llm, test)
    for response in (failed, chat):
        assert_error(response, 500)
        assert response.json()["error"]["type"] == "server_error"
        assert "secret" not in response.text
    assert beside.status_code == after.status_code == health.status_code == 200
    assert beside.json()["choices"][0]["text"] == after.json()["choices"][0]["text"]  # same seed
    assert 'vllm:request_success_total{engine="0",finished_reason="error",model_name="tiny"} 2.0' in metrics.text


def test_a_stream_that_fails_ends_with_an_error_event(llm, monkeypatch):
    """Detokenizing the request with seed 15 raises at its third token, after the 200 went out."""
    fail_detokenizing(monkeypatch, lambda params: params.seed == 15, at_call=3, message="secret detail")

    async def test(c):
        body = {"prompt": "x", **GREEDY}
        streamed = await c.post("/v1/completions", json={**body, "stream": True, "seed": 15})
        return streamed, await c.post("/v1/completions", json={**body, "seed": 16})

    streamed, after = run(llm, test)
    assert streamed.status_code == 200
    *chunks, last = sse_events(streamed.text)
    assert chunks and all(c["object"] == "text_completion" for c in chunks)
    assert last["error"]["type"] == "server_error" and "secret" not in streamed.text
    assert after.status_code == 200 and llm.is_running


def test_unknown_model_is_404(llm):
    async def test(c):
        return await c.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})

    assert_error(run(llm, test), 404, param="model", code="model_not_found")


def test_full_queue_gets_429_with_retry_after(llm, monkeypatch):
    release = hold_steps(monkeypatch, llm.engine)  # the long request holds its place until the 429

    async def test(c):
        state = c.app.state.tiered_kv
        long = asyncio.create_task(
            c.post("/v1/completions", json={"prompt": "x", "max_tokens": 200, "ignore_eos": True})
        )
        while state.inflight < 1:
            await asyncio.sleep(0.005)
        rejected = await c.post("/v1/completions", json={"prompt": "y", "max_tokens": 1})
        release.set()
        long.cancel()  # the client goes away: the request is aborted and its place freed
        with contextlib.suppress(asyncio.CancelledError):
            await long
        while llm.stats().num_running:
            await asyncio.sleep(0.005)
        after = await c.post("/v1/completions", json={"prompt": "y", "max_tokens": 1})
        return rejected, state.inflight, after

    rejected, inflight, after = run(llm, test, max_num_seqs=1, max_queue_len=0)
    assert_error(rejected, 429, code="queue_full")
    assert int(rejected.headers["retry-after"]) >= 1
    assert inflight == 0
    assert after.status_code == 200
    assert llm.stats().num_used_blocks == 0


# ---------------------------------------------------------------- auth


def test_each_key_guards_its_own_routes_and_health_and_metrics_are_open(llm):
    keys = {"api": "Bearer s3cret", "admin": "Bearer adm1n", "wrong": "Bearer nope"}

    async def test(c):
        results = []
        for route in c.app.routes:
            methods = sorted(route.methods - {"HEAD"}) if getattr(route, "methods", None) else ["GET"]
            for method in methods:
                got = {"none": await c.request(method, route.path)}
                for name, value in keys.items():
                    got[name] = await c.request(method, route.path, headers={"Authorization": value})
                results.append((route.path, method, got))
        return results

    results = run(llm, test, api_key="s3cret", admin_api_key="adm1n")
    paths = {path for path, *_ in results}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics", "/health",
            "/admin/tiers", "/admin/flush", "/admin/evict", "/admin/clear"} <= paths
    for path, method, got in results:
        if path in ("/health", "/ping", "/version", "/metrics"):  # open, as vLLM's are
            assert {r.status_code for r in got.values()} == {200}, path
            continue
        own = "admin" if path.startswith("/admin/") else "api"
        for name, response in got.items():
            if name == own:
                assert response.status_code != 401, (method, path)
            else:  # no key, a wrong one, or the other route family's key
                assert_error(response, 401, code="invalid_api_key")


def test_admin_routes_are_off_without_an_admin_key(llm):
    async def test(c):
        return [await c.get("/admin/tiers"), await c.post("/admin/flush")]

    for response in run(llm, test, api_key="s3cret", headers={"Authorization": "Bearer s3cret"}):
        assert_error(response, 404, code="not_found")
        assert "--admin-api-key" in response.json()["error"]["message"]


def test_valid_key_reaches_the_model(llm):
    async def test(c):
        headers = {"Authorization": "Bearer s3cret"}
        return await c.post("/v1/completions", json={"prompt": "x", **GREEDY}, headers=headers)

    assert run(llm, test, api_key="s3cret").status_code == 200


# ---------------------------------------------------------------- admin


def test_admin_routes(llm):
    prompt = "An admin test prompt that fills a few blocks of KV. " * 3

    async def test(c):
        await c.post("/v1/completions", json={"prompt": prompt, **GREEDY})
        flushed = await c.post("/admin/flush")
        before = await c.get("/admin/tiers")
        evicted = await c.post("/admin/evict", json={"tier": "cpu"})
        after_evict = await c.get("/admin/tiers")
        bad = await c.post("/admin/clear", json={"namespace": "zz"})
        other = await c.post("/admin/clear", json={"namespace": "ab" * 32})
        cleared = await c.post("/admin/clear")
        after_clear = await c.get("/admin/tiers")
        return flushed, before, evicted, after_evict, bad, other, cleared, after_clear

    flushed, before, evicted, after_evict, bad, other, cleared, after_clear = run(llm, test, **ADMIN)
    assert flushed.json() == {"flushed": True, "degraded": []}
    report = before.json()
    assert set(report["tiers"]) == {"cpu", "disk"}
    assert report["engine"]["num_running"] == 0 and report["engine"]["num_blocks"] == 64
    cpu, disk = report["tiers"]["cpu"]["entries"], report["tiers"]["disk"]["entries"]
    assert cpu > 0 and disk > 0
    assert evicted.json() == {"namespace": report["namespace"], "evicted": {"cpu": cpu}}
    assert after_evict.json()["tiers"]["cpu"]["entries"] == 0
    assert after_evict.json()["tiers"]["disk"]["entries"] == disk
    assert_error(bad, 400, param="namespace")
    assert other.json()["evicted"] == {"cpu": 0, "disk": 0}
    assert cleared.json()["evicted"] == {"cpu": 0, "disk": disk}
    assert after_clear.json()["tiers"]["disk"]["entries"] == 0


def test_a_degraded_disk_shows_on_health_and_flush(llm, monkeypatch):
    """The store's own tests drive a full disk into the degraded state; here, the server
    must say so: /health stays 200 (it still serves) with the tier named, and so does flush."""
    monkeypatch.setattr(LmdbStore, "degraded", property(lambda self: True))

    async def test(c):
        return await c.get("/health"), await c.post("/admin/flush")

    health, flushed = run(llm, test, **ADMIN)
    assert health.status_code == 200
    assert health.json() == {"status": "degraded", "degraded": ["disk"]}
    assert flushed.json()["degraded"] == ["disk"]
