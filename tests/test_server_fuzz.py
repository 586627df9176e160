"""A property-based fuzz of the server's request handling (tiered_kv/server.py): bodies for
``/v1/completions``, ``/v1/chat/completions``, ``/tokenize`` and ``/detokenize`` that mix
boundary values, wrong types, unknown fields and deep nesting, and bodies that are not JSON
objects at all. Whatever comes in: no 5xx, every error in OpenAI's shape, a 200 consistent
with the request as the server reads it, a stream well-formed SSE ending in ``[DONE]``, and
the server serving normally afterwards. An exception the app leaves unhandled (a 500) reaches
the test through httpx's ASGI transport and fails it too. Generations ask for at most 3
tokens unless a body leaves ``max_tokens`` out, so each example is quick on the CPU."""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
from typing import NamedTuple

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import AsyncLLM
from engine_testing import one_thread  # noqa: F401  (autouse fixture)
from server_testing import BLOCK, GREEDY, MAX_MODEL_LEN, client, sse_events
from tiered_kv.protocol_requests import ChatCompletionRequest, CompletionRequest

FUZZ = settings(
    max_examples=500, derandomize=True, deadline=None, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
REQUEST_TIMEOUT_S = 60  # a request still unanswered after this has hung
FINISH_REASONS = {"stop", "length"}
INT64_EDGES = [2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64]


class Server(NamedTuple):
    llm: AsyncLLM
    loop: asyncio.AbstractEventLoop
    client: httpx.AsyncClient


@pytest.fixture(scope="module")
def server():
    """One app on the tiny model for every example, its client on a loop of its own."""
    llm = AsyncLLM(
        "tiny", max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64, block_size=BLOCK, device="cpu"
    )
    loop = asyncio.new_event_loop()
    stack = contextlib.AsyncExitStack()
    c = loop.run_until_complete(stack.enter_async_context(client(llm)))
    yield Server(llm, loop, c)
    loop.run_until_complete(stack.aclose())
    loop.close()
    llm.shutdown()


def post(server: Server, path: str, content: bytes, content_type: str | None) -> httpx.Response:
    """POST ``content`` as ``content_type`` (None: no Content-Type); a hang fails the test."""
    headers = {"content-type": content_type} if content_type is not None else {}
    sent = server.client.post(path, content=content, headers=headers)
    return server.loop.run_until_complete(asyncio.wait_for(sent, REQUEST_TIMEOUT_S))


# ---------------------------------------------------------------- strategies

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
ODD_TEXT = st.one_of(
    st.sampled_from(["", " ", "\n", "Hi", "é", "你好", "🙂", "\x00", "\u202e", "<|bos|>", "x" * 3000]),
    st.text(max_size=12),
    st.sampled_from(["\ud800", "a\udfffb", "\udc00\ud800"]),  # lone surrogates: JSON carries them, UTF-8 cannot
)
TOKEN_ID = st.integers(-2, 300) | st.sampled_from(INT64_EDGES)
IDS = st.lists(TOKEN_ID, max_size=5)
PROMPT = st.one_of(ODD_TEXT, IDS, st.lists(ODD_TEXT, max_size=3), st.lists(IDS, max_size=3))
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
DEEP_TEXT = "[" * 3000  # a schema as text, nested past what json.loads recurses

SAMPLING = {
    "model": st.sampled_from(["tiny", "gpt-4", ""]),
    "max_tokens": st.sampled_from([0, 1, 2, MAX_MODEL_LEN, -1, 1.5, "2", *INT64_EDGES]),
    "temperature": st.sampled_from([0, 1e-9, 0.8, 1e6, -1, "NaN", "nan", "-inf", "0.5", math.nan, math.inf]),
    "top_p": st.sampled_from([0, 1e-9, 0.5, 1, 1.5, -0.1, "nan", math.nan]),
    "top_k": st.sampled_from([-2, -1, 0, 1, 5, 10**6, *INT64_EDGES]),
    "min_p": st.sampled_from([0, 0.5, 1, 1.1, -1, math.nan]),
    "n": st.sampled_from([None, 0, 1, 2, 3, 321, -1, *INT64_EDGES]),
    "seed": st.sampled_from([0, -1, 7, *INT64_EDGES]),
    "stop": st.one_of(ODD_TEXT, st.lists(ODD_TEXT, max_size=3), st.just(["a"] * 129), st.just([1])),
    "stop_token_ids": st.lists(TOKEN_ID, max_size=3),
    "stream": st.sampled_from([True, False, None]),
    "stream_options": st.sampled_from([None, {}, {"include_usage": True}, {"include_usage": "yes"}, {"bogus": 1}]),
    "presence_penalty": st.sampled_from([-2, 0, 2, 2.5, math.nan]), "frequency_penalty": st.just(math.inf),
    "repetition_penalty": st.sampled_from([0, 0.5, 1.2, -1, math.inf, "inf"]),
    "logit_bias": st.dictionaries(
        st.sampled_from(["0", "5", "263", "264", "-1", "abc", "", " 5", "\u0661", "5.0", "\ud800", str(2**64)]),
        st.sampled_from([-1000, -1, 0, 100, 1e308, math.nan, math.inf, "x", None]), max_size=3,
    ),
    "user": ODD_TEXT, "cache_salt": ODD_TEXT, "min_tokens": st.sampled_from([0, 1, 2, 10**6, -1]),
    "response_format": st.sampled_from([
        {"type": "text"}, {"type": "json_object"}, {"type": "json_schema"}, {"type": "bogus"}, {"type": 5}, {},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        {"type": "json_schema", "json_schema": {"schema": DEEP_TEXT}},
    ]),
    "structured_outputs": st.sampled_from([
        {"regex": "[ab]{1,3}"}, {"regex": "("}, {"choice": ["yes", "no"]}, {"choice": []}, {"json": 5},
        {"json": SCHEMA}, {"grammar": 'root ::= "a" | "b"'}, {"grammar": "root ::="}, {"json_object": True},
        {"json_object": "yes"}, {}, {"regex": "a", "choice": ["a"]}, {"regex": "a", "disable_any_whitespace": 1},
    ]),
    "guided_json": st.sampled_from([SCHEMA, "{", '{"type": "string"}', {"type": "nonsense"}, DEEP_TEXT]),
    "guided_regex": st.sampled_from(["[ab]{1,3}", "(", "", "\ud800", "a{1000000}"]),
    "guided_choice": st.lists(ODD_TEXT, max_size=3),
    "guided_grammar": st.sampled_from(['root ::= "a" | "b"', "root ::=", "nonsense"]),
    "priority": st.sampled_from([0, -1, 5, *INT64_EDGES]), "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(),
    "truncate_prompt_tokens": st.sampled_from([-2, -1, 0, 1, 3, MAX_MODEL_LEN + 1]),
    "prompt_logprobs": st.sampled_from([-1, 0, 2, 21, 10**6]),
    "unknown_field": JSON,
}
COMPLETION = {
    **SAMPLING, "prompt": PROMPT, "logprobs": st.sampled_from([None, 0, 1, 5, 20, 21, -1, True]),
    "echo": st.sampled_from([True, False, None]), "best_of": st.sampled_from([None, 0, 1, 2, 3, 321]),
    "suffix": st.sampled_from(["", "x"]), "add_special_tokens": st.booleans(),
}
PART = st.sampled_from([
    {"type": "text", "text": "Hi"}, {"type": "text"}, {"type": "image_url", "image_url": {"url": "http://x"}},
    {"type": "input_audio"}, {}, {"text": "no type"}, {"type": "text", "text": "\ud800"},
])
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "", "🙂", "\ud800"]),
     "content": st.one_of(ODD_TEXT, st.none(), st.lists(PART, max_size=3))},
    optional={
        "name": ODD_TEXT,
        "tool_calls": st.sampled_from([[], None, [{"id": "1", "type": "function", "function": {"name": "f"}}]]),
        "reasoning_content": st.sampled_from(["", "thinking"]),
        "tool_call_id": st.just("1"),
    },
)
MESSAGES = st.lists(MESSAGE | JSON, max_size=3)
CHAT = {
    **SAMPLING, "messages": MESSAGES, "max_completion_tokens": st.sampled_from([0, 1, 2, MAX_MODEL_LEN, 2**63]),
    "logprobs": st.sampled_from([True, False, None, 1]), "top_logprobs": st.sampled_from([0, 1, 20, 21, -1]),
    "tools": st.sampled_from([[], [{"type": "function", "function": {"name": "f", "parameters": {}}}]]),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]),
    "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
    "chat_template_kwargs": st.dictionaries(  # the template's own variables too
        st.sampled_from(["messages", "add_generation_prompt", "bos_token"]) | st.text(max_size=5), JSON, max_size=2
    ),
    "add_special_tokens": st.booleans(), "parallel_tool_calls": st.sampled_from([True, False, None]),
}
TOKENIZE = {
    "model": SAMPLING["model"], "prompt": ODD_TEXT, "messages": MESSAGES, "add_special_tokens": st.booleans(),
    "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
    "chat_template_kwargs": CHAT["chat_template_kwargs"], "return_token_strs": st.booleans(), "unknown_field": JSON,
}
DETOKENIZE = {"model": SAMPLING["model"], "tokens": IDS, "unknown_field": JSON}
# Values the server takes, for the fields that shape a 200's choices, usage and stream.
ACCEPTED = {
    "n": st.integers(1, 3), "seed": st.integers(-(2**63), 2**63 - 1), "temperature": st.sampled_from([0, 0.7, 2]),
    "top_p": st.sampled_from([0.1, 1]), "top_k": st.sampled_from([-1, 0, 1, 50]), "min_tokens": st.integers(0, 1),
    "presence_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2), "ignore_eos": st.booleans(),
    "stop": st.lists(st.sampled_from(["\n", " ", "é", "🙂", "e", "the"]), max_size=3),
    "stream_options": st.fixed_dictionaries({"include_usage": st.just(True), "continuous_usage_stats": st.booleans()}),
    "include_stop_str_in_output": st.booleans(),
    "logit_bias": st.dictionaries(st.integers(0, 263).map(str), st.floats(-100, 100), max_size=2),
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}]),
    "guided_choice": st.just(["yes", "no"]), "cache_salt": st.text(min_size=1, max_size=5),
}
COMPLETION_ACCEPTED = {
    **ACCEPTED, "logprobs": st.integers(0, 5), "echo": st.booleans(), "best_of": st.integers(1, 3),
    "prompt": st.sampled_from(["Hi", [256, 72], ["a", "b"], [[256], [72, 105]]]),
    "max_tokens": st.integers(0, 3), "prompt_logprobs": st.integers(0, 2),
}
CHAT_ACCEPTED = {**ACCEPTED, "logprobs": st.booleans(), "max_completion_tokens": st.integers(1, 3)}
USER = [{"role": "user", "content": "Hi"}]
GENERATE = {"max_tokens": st.sampled_from([1, 2, 3]), "stream": st.booleans()}
ROUTES = {  # path: (a valid body, the fields to vary, values they take)
    "/v1/completions": (st.fixed_dictionaries({"prompt": st.just("Once upon"), **GENERATE}), COMPLETION,
                        COMPLETION_ACCEPTED),
    "/v1/chat/completions": (st.fixed_dictionaries({"messages": st.just(USER), **GENERATE}), CHAT, CHAT_ACCEPTED),
    "/tokenize": (st.just({"prompt": "Once upon"}), TOKENIZE,
                  {"prompt": ODD_TEXT, "return_token_strs": st.booleans(), "add_special_tokens": st.booleans()}),
    "/detokenize": (st.just({"tokens": [256, 72, 105]}), DETOKENIZE, {"tokens": st.lists(st.integers(0, 263))}),
}
NESTED = "\ue000"  # where a deeply nested value goes in a body's JSON
# The fields that reach the grammar compiler, also fuzzed on their own.
STRUCTURED = ("guided_choice", "guided_grammar", "guided_json", "guided_regex", "response_format", "structured_outputs")


@st.composite
def json_bodies(draw, path: str, only: tuple[str, ...] = ()) -> dict:
    """A valid body with some fields set to values the server takes, or else some (of
    ``only``, if given) to boundary values (mostly) or any JSON value; perhaps one of its
    fields dropped."""
    base, fields, accepted = ROUTES[path]
    body = dict(draw(base))
    if not only and draw(st.booleans()):
        for name in draw(st.lists(st.sampled_from(sorted(accepted)), unique=True, max_size=4)):
            body[name] = draw(accepted[name])
        return body
    for name in draw(st.lists(st.sampled_from(only or sorted(fields)), unique=True, max_size=3)):
        body[name] = draw(JSON if draw(st.integers(0, 4)) == 0 else fields[name])
    if draw(st.integers(0, 9)) == 0:
        body.pop(draw(st.sampled_from(sorted(body))))
    return body


RAW = st.sampled_from([
    b"", b"{", b"[]", b"null", b'"prompt"', b"1e999", b"\xff\xfe{}", b"prompt=hi", b'{"prompt": "x"}garbage',
    b'{"prompt": "x", "prompt": 5, "max_tokens": 1}', b'{"max_tokens": 1' + b"1" * 5000 + b', "prompt": "x"}',
    b"[" * 100_000 + b"]" * 100_000, b'{"prompt": "\\ud800", "max_tokens": 1}', b'{"prompt": "\\u00"}',
])
CONTENT_TYPES = st.sampled_from([
    "application/json", None, "text/plain", "application/x-www-form-urlencoded", "application/json; charset=utf-8",
    "multipart/form-data",
])


# ---------------------------------------------------------------- properties


def check_answer(server: Server, path: str, body: dict | None, response: httpx.Response) -> None:
    """The properties every answer has; those of a 200 when ``body`` is known."""
    assert response.status_code < 500, response.text
    assert server.llm.is_running
    if response.status_code != 200:
        assert 400 <= response.status_code < 500, response.text
        check_error(response)
    elif body is not None:
        CHECKS[path](body, response)


def check_error(response: httpx.Response) -> None:
    assert response.headers["content-type"] == "application/json", response.headers
    answer = response.json()
    assert set(answer) == {"error"}, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"].strip()
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)


def check_usage(usage: dict, num_choices: int, max_tokens: int) -> None:
    assert 0 <= usage["completion_tokens"] <= num_choices * max_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 0 < usage["prompt_tokens"] and 0 <= usage["prompt_tokens_details"]["cached_tokens"]


def check_choices(choices: list[dict], num_choices: int) -> None:
    assert [c["index"] for c in choices] == list(range(num_choices))
    assert all(c["finish_reason"] in FINISH_REASONS for c in choices)


def check_stream(response: httpx.Response, obj: str, num_choices: int, include_usage: bool, max_tokens: int) -> None:
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)  # ends in [DONE]
    assert not any("error" in e for e in events), events
    assert all(e["object"] == obj for e in events) and len({e["id"] for e in events}) == 1
    finished = [c["index"] for e in events for c in e["choices"] if c["finish_reason"] is not None]
    assert sorted(finished) == list(range(num_choices))
    assert {c["finish_reason"] for e in events for c in e["choices"]} <= FINISH_REASONS | {None}
    if include_usage:
        assert events[-1]["choices"] == []
        check_usage(events[-1]["usage"], num_choices, max_tokens)


def check_completion(body: dict, response: httpx.Response) -> None:
    request = CompletionRequest.model_validate(body)  # the request as the server read it
    num_choices = len(request.prompts()) * request.n
    max_tokens = request.max_tokens if request.max_tokens is not None else MAX_MODEL_LEN
    if request.stream:
        check_stream(response, "text_completion", num_choices, request.include_usage, max_tokens)
        return
    answer = response.json()
    assert answer["object"] == "text_completion"
    check_choices(answer["choices"], num_choices)
    assert all(isinstance(c["text"], str) for c in answer["choices"])
    check_usage(answer["usage"], num_choices, max_tokens)


def check_chat(body: dict, response: httpx.Response) -> None:
    request = ChatCompletionRequest.model_validate(body)
    max_tokens = request.max_completion_tokens or request.max_tokens or MAX_MODEL_LEN
    if request.stream:
        check_stream(response, "chat.completion.chunk", request.n, request.include_usage, max_tokens)
        return
    answer = response.json()
    assert answer["object"] == "chat.completion"
    check_choices(answer["choices"], request.n)
    assert all(c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str)
               for c in answer["choices"])
    check_usage(answer["usage"], request.n, max_tokens)


def check_tokenize(body: dict, response: httpx.Response) -> None:
    answer = response.json()
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == MAX_MODEL_LEN
    assert all(isinstance(t, int) and t >= 0 for t in answer["tokens"])


def check_detokenize(body: dict, response: httpx.Response) -> None:
    assert isinstance(response.json()["prompt"], str)


CHECKS = {
    "/v1/completions": check_completion, "/v1/chat/completions": check_chat,
    "/tokenize": check_tokenize, "/detokenize": check_detokenize,
}


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("path, fields", [(path, "any") for path in sorted(ROUTES)] + [
    (path, "structured") for path in ("/v1/chat/completions", "/v1/completions")
])
@FUZZ
@given(data=st.data())
def test_valid_bodies_with_odd_fields(server, path, fields, data):
    body = data.draw(json_bodies(path, STRUCTURED if fields == "structured" else ()))
    check_answer(server, path, body, post(server, path, json.dumps(body).encode(), "application/json"))


@FUZZ
@given(path=st.sampled_from(sorted(ROUTES)), data=st.data(), depth=st.integers(1, 1200) | st.just(10**5),
       bracket=st.sampled_from(["[", '{"a":']))
def test_deeply_nested_values(server, path, data, depth, bracket):
    """One field of a valid body holds a value nested up to past the depth JSON parses to."""
    base, fields, _ = ROUTES[path]
    body = dict(data.draw(base))
    body[data.draw(st.sampled_from(sorted(fields)))] = NESTED
    nested = '{"a":' + bracket * depth + "1" + ("]" if bracket == "[" else "}") * depth + "}"
    content = json.dumps(body).replace(json.dumps(NESTED), nested).encode()
    check_answer(server, path, None, post(server, path, content, "application/json"))


@FUZZ
@given(path=st.sampled_from(sorted(ROUTES)), data=st.data(), content_type=CONTENT_TYPES)
def test_bodies_that_are_not_json_objects_or_not_sent_as_json(server, path, data, content_type):
    as_json = json_bodies(path).map(lambda body: json.dumps(body).encode())
    content = data.draw(RAW | st.binary(max_size=20) | as_json)
    check_answer(server, path, None, post(server, path, content, content_type))


def test_the_server_still_serves_after_the_fuzz(server):
    """Runs last in this module: the fuzz above left the engine and the app as they were."""
    assert server.loop.run_until_complete(server.client.get("/health")).status_code == 200
    body = {"prompt": "Once upon", **GREEDY}
    response = post(server, "/v1/completions", json.dumps(body).encode(), "application/json")
    assert response.status_code == 200, response.text
    check_completion(body, response)
    assert response.json()["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    assert server.loop.run_until_complete(server.client.get("/metrics")).status_code == 200
