"""What the server refuses up front (tiered_kv/server_limits.py), driven over HTTP: bodies
over the limit, prompts that cannot fit, text that is not Unicode; and tokenizing leaves the
event loop free."""
from __future__ import annotations

import asyncio
import threading

import pytest

from engine import AsyncLLM
from engine_testing import one_thread  # noqa: F401  (autouse fixture)
from tiered_kv.protocol_requests import MAX_STOP_STRINGS
from server_testing import BLOCK, GREEDY, MAX_MODEL_LEN, assert_error, post_json, run


@pytest.fixture(scope="module")
def llm():
    llm = AsyncLLM(
        "tiny", max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64, block_size=BLOCK, device="cpu"
    )
    yield llm
    llm.shutdown()


def test_bodies_over_the_limit_get_413(llm):
    padded = b'{"prompt": "x", "max_tokens": 1' + b" " * 2000 + b"}"

    async def chunked():  # no Content-Length: the server counts the bytes as they come
        for i in range(0, len(padded), 500):
            yield padded[i : i + 500]

    async def test(c):
        declared = await c.post("/v1/completions", json={"prompt": "x" * 2000})
        streamed = await c.post(
            "/v1/completions", content=chunked(), headers={"content-type": "application/json"}
        )
        small = await c.post("/v1/completions", json={"prompt": "x", **GREEDY})
        return declared, streamed, small, await c.get("/metrics")

    declared, streamed, small, metrics = run(llm, test, max_request_body_mib=1 / 1024)
    assert "content-length" not in streamed.request.headers
    for response in (declared, streamed):
        assert_error(response, 413)
        assert "1.0 KiB" in response.json()["error"]["message"]
    assert small.status_code == 200
    assert 'tiered_kv_requests_total{model_name="tiny",route="/v1/completions",status="413"} 2.0' in metrics.text


def test_a_prompt_that_cannot_fit_is_refused_naming_max_model_len(llm, monkeypatch):
    tokenized = []
    encode = llm.tokenizer.encode

    def counting_encode(text, *args, **kwargs):
        tokenized.append(len(text))
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(llm.tokenizer, "encode", counting_encode)

    async def test(c):
        chars = "x" * (c.app.state.tiered_kv.prompt_limit.max_chars + 1)
        return [
            await c.post("/v1/completions", json={"prompt": chars}),
            await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": chars}]}),
            await c.post("/v1/completions", json={"prompt": [5] * MAX_MODEL_LEN}),
            await c.post("/v1/completions", json={"prompt": "x" * (MAX_MODEL_LEN + 10)}),  # tokenized first
        ]

    responses = run(llm, test)
    for response, param in zip(responses, ["prompt", "messages", "prompt", "prompt"]):
        assert_error(response, 400, param=param, code="context_length_exceeded")
        assert f"(max_model_len) is {MAX_MODEL_LEN} tokens" in response.json()["error"]["message"]
    assert tokenized == [MAX_MODEL_LEN + 10]  # only the last one was worth tokenizing


def test_health_answers_while_a_prompt_is_tokenized(llm, monkeypatch):
    tokenizing, release, tokenized = threading.Event(), threading.Event(), threading.Event()
    encode = llm.tokenizer.encode

    def slow_encode(text, *args, **kwargs):
        if text.startswith("slow"):
            tokenizing.set()
            release.wait(2)  # on the event loop this would stall /health for 2 s
            tokenized.set()
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(llm.tokenizer, "encode", slow_encode)

    async def test(c):
        slow = asyncio.create_task(c.post("/v1/completions", json={"prompt": "slow prompt", **GREEDY}))
        while not tokenizing.is_set():
            assert not slow.done(), slow.result()  # it failed before tokenizing
            await asyncio.sleep(0.005)
        health = await c.get("/health")
        during = not tokenized.is_set()
        release.set()
        return health, during, await slow

    health, during, slow = run(llm, test)
    assert health.status_code == 200 and during
    assert slow.status_code == 200


def test_lone_surrogates_get_400_naming_the_field(llm):
    parts = [{"type": "text", "text": "\udc00"}]

    async def test(c):
        refused = [
            await post_json(c, "/v1/completions", {"prompt": "\ud800"}),
            await post_json(c, "/v1/completions", {"prompt": ["fine", "\udfff"]}),
            await post_json(c, "/v1/completions", {"prompt": "x", "stop": ["\ud800"]}),
            await post_json(c, "/v1/chat/completions", {"messages": [{"role": "\ud800", "content": "x"}]}),
            await post_json(c, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}),
            await post_json(c, "/v1/chat/completions", {"messages": [{"role": "user", "content": parts}]}),
            await post_json(c, "/tokenize", {"prompt": "a\ud800"}),  # was a 500 from the tokenizer
            await post_json(c, "/tokenize", {"messages": [{"role": "user", "content": "\udfff"}]}),
        ]
        # a validation error whose location holds the surrogate (a key) is still clean JSON
        bad_key = await post_json(c, "/v1/completions", {"prompt": "x", "logit_bias": {"\ud800": "high"}})
        return refused, bad_key, await c.post("/v1/completions", json={"prompt": "x", **GREEDY})

    refused, bad_key, after = run(llm, test)
    params = ["prompt", "prompt", "stop", "messages", "messages", "messages", "prompt", "messages"]
    for response, param in zip(refused, params, strict=True):
        assert_error(response, 400, param=param)
        assert "lone surrogate" in response.json()["error"]["message"]
    assert_error(bad_key, 400, param="logit_bias")
    assert after.status_code == 200


def test_lone_surrogates_are_found_in_values_nested_hundreds_deep(llm):
    """The check walks a value nested deeper than Python recurses, as JSON allows (it
    recursed, and such a body was a 500)."""

    def nested(leaf: str) -> dict:
        value: object = leaf
        for _ in range(600):
            value = {"a": value}
        return {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "chat_template_kwargs": value}

    async def test(c):
        return [await post_json(c, "/v1/chat/completions", nested(leaf)) for leaf in ("fine", "\ud800")]

    fine, refused = run(llm, test)
    assert fine.status_code == 200, fine.text
    assert_error(refused, 400, param="chat_template_kwargs")
    assert "lone surrogate" in refused.json()["error"]["message"]


def test_more_generations_than_the_server_holds_are_refused_before_any_is_built(llm, monkeypatch):
    """prompts × n (or best_of) past max_num_seqs + max_queue_len: a 400 naming n before the
    prompt is tokenized (a huge n used to build every job first, on the event loop)."""
    tokenized = []
    encode = llm.tokenizer.encode
    monkeypatch.setattr(llm.tokenizer, "encode", lambda *a, **k: tokenized.append(1) or encode(*a, **k))
    huge = 10**6  # the old path built them all first (and then refused them)

    async def test(c):
        return [
            await c.post("/v1/completions", json={"prompt": "x", "n": huge}),
            await c.post("/v1/completions", json={"prompt": "x", "best_of": huge}),
            await c.post("/v1/completions", json={"prompt": ["x", "y", "z"], "n": 2}),
            await c.post("/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": "x"}], "n": huge}),
        ]

    responses = run(llm, test, max_num_seqs=2, max_queue_len=3)  # holds 5
    for response in responses:
        assert_error(response, 400, param="n")
        assert "at most 5 at once" in response.json()["error"]["message"]
    assert not tokenized


def test_structured_output_requests_take_their_places_before_their_grammar_compiles(llm, monkeypatch):
    """Six requests arrive while the first grammars compile: two places, so four get 429 (all
    six used to pass the check while the compile was awaited)."""
    grammars = llm.engine.grammars
    compile_ = grammars.compile
    release = threading.Event()

    def slow_compile(spec):
        release.wait(10)  # until the other four are refused (10 s at most, if they got in)
        return compile_(spec)

    monkeypatch.setattr(grammars, "compile", slow_compile)
    body = {"prompt": "x", "response_format": {"type": "json_object"}, **GREEDY}

    async def test(c):
        posts = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(6)]
        while sum(p.done() for p in posts) < 4:
            await asyncio.sleep(0.005)
        release.set()
        return await asyncio.gather(*posts), c.app.state.tiered_kv.inflight

    responses, inflight = run(llm, test, max_num_seqs=1, max_queue_len=1)
    codes = sorted(r.status_code for r in responses)
    assert codes == [200, 200, 429, 429, 429, 429]
    assert inflight == 0


def test_more_stop_strings_than_allowed_are_a_400(llm):
    async def test(c):
        many = [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]
        return (await c.post("/v1/completions", json={"prompt": "x", "stop": many, **GREEDY}),
                await c.post("/v1/completions", json={"prompt": "x", "stop": many[:-1], **GREEDY}))

    refused, allowed = run(llm, test)
    assert_error(refused, 400, param="stop")
    assert allowed.status_code == 200
