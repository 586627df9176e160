"""The OpenAI-compatible server in-process: bad requests, failures in the engine, a full queue."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

import engine.sampler
from engine_testing import fail_detokenizing, hold_steps, one_thread  # noqa: F401  (one_thread: autouse fixture)
from server_testing import GREEDY, LONG_PROMPT, MAX_MODEL_LEN, assert_error, post_json, run, sse_events, tiered_llm


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    yield from tiered_llm(tmp_path_factory)


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
