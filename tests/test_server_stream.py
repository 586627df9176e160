"""A stream's text-only chunks come from a template per choice: the same bytes as building and
serializing each chunk; and a stream whose event loop falls behind loses nothing."""
from __future__ import annotations

import json
import random
import time
import zlib

import pytest

from engine import AsyncLLM
from engine_testing import one_thread  # noqa: F401  (autouse fixture)
from server_testing import BLOCK, GREEDY, MAX_MODEL_LEN, run, sse_events
from tiered_kv.protocol_responses import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
)
from tiered_kv.server_generation import Generation
from tiered_kv.server_stream import _MARK, TextEvents, _chunk_dict, event

PIECES = ["a", " the", "é", "日本", "\U0001f600", '"', "\\", "\n", "\t", "\x00", "\x1f", "\u2028",
          "</s>", "data: ", "\ue000", _MARK, "null", "{}", "\ud7ff", " ", ""]


def texts(seed: int, count: int = 300):
    rng = random.Random(seed)
    for _ in range(count):
        yield "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 6)))


def completion_render(model: str, include_usage: bool):
    def render(k: int, text: str) -> dict:
        chunk = CompletionResponse(id='cmpl-"x"', created=1700000000, model=model,
                                   choices=[CompletionChoice(index=k, text=text)])
        return _chunk_dict(chunk, include_usage)
    return render


def chat_render(model: str, include_usage: bool):
    def render(k: int, text: str) -> dict:
        delta = DeltaMessage(content=text)
        chunk = ChatCompletionChunk(id="chatcmpl-1", created=1700000000, model=model,
                                    choices=[ChatChunkChoice(index=k, delta=delta)])
        d = _chunk_dict(chunk, include_usage)
        d["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
        return d
    return render


@pytest.mark.parametrize("make", [completion_render, chat_render])
@pytest.mark.parametrize("model", ["tiny", 'a "quoted" \\ model \u00e9', "text"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_text_event_is_the_rendered_chunk_byte_for_byte(make, model, include_usage):
    render = make(model, include_usage)
    events = TextEvents(render)
    for i, text in enumerate(texts(seed=zlib.crc32(f"{model}{include_usage}".encode()))):
        k = i % 3
        got = events.event(k, text)
        assert got == event(render(k, text)), text
        assert json.loads(got.removeprefix("data: ").rstrip("\n")) == render(k, text)


def test_a_choice_whose_chunk_holds_the_marker_elsewhere_is_rendered_whole():
    """A model named with the marker itself: the template cannot be split, so every event is
    built and serialized in full (still right, only slower)."""
    render = completion_render(_MARK, False)
    events = TextEvents(render)
    for text in ["one", _MARK, ""]:
        assert events.event(0, text) == event(render(0, text))
    assert events._halves == {0: None}


# ---------------------------------------------------------------- a slow event loop, end to end

@pytest.fixture(scope="module")
def llm():
    llm = AsyncLLM("tiny", max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64, block_size=BLOCK,
                   device="cpu")
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_stream_whose_event_loop_falls_behind_loses_nothing(llm, monkeypatch, route):
    """The event loop stalls after every output, so the engine's outputs wait and arrive
    merged: the stream still carries every token's text and logprob once, and its usage."""
    params = {**GREEDY, "max_tokens": 24}
    if route == "completions":
        path, body = "/v1/completions", {"prompt": "Tell me", "logprobs": 1, **params}
    else:
        path, body = "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Tell me"}], "logprobs": True, "top_logprobs": 1,
            **params}

    async def test(c):
        whole = (await c.post(path, json=body)).json()
        real_next = Generation._next

        async def slow_next(self):
            time.sleep(0.03)  # the loop is busy: the engine steps on meanwhile
            return await real_next(self)

        monkeypatch.setattr(Generation, "_next", slow_next)
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        return whole, (await c.post(path, json=stream)).text

    whole, text = run(llm, test)
    events = sse_events(text)
    usage = events[-1]["usage"]
    assert usage == whole["usage"] and usage["completion_tokens"] == 24
    chunks = [e["choices"][0] for e in events[:-1]]
    if route == "completions":
        assert "".join(ch["text"] for ch in chunks) == whole["choices"][0]["text"]
        tokens = [t for ch in chunks if ch["logprobs"] for t in ch["logprobs"]["tokens"]]
        offsets = [o for ch in chunks if ch["logprobs"] for o in ch["logprobs"]["text_offset"]]
        assert tokens == whole["choices"][0]["logprobs"]["tokens"]
        assert offsets == whole["choices"][0]["logprobs"]["text_offset"]
    else:
        assert "".join(ch["delta"].get("content") or "" for ch in chunks) == \
            whole["choices"][0]["message"]["content"]
        content = [t for ch in chunks if ch.get("logprobs") for t in ch["logprobs"]["content"]]
        assert [t["token"] for t in content] == [t["token"] for t in whole["choices"][0]["logprobs"]["content"]]
    assert len(chunks) < 24  # merged: fewer chunks than tokens


# ------------------------------------------------- a whole stream, event by event, against pydantic

SAMPLED = {"temperature": 1.0, "seed": 3, "max_tokens": 24, "ignore_eos": True}  # varied text
USAGE = {"include_usage": True}
RUNNING_USAGE = {"include_usage": True, "continuous_usage_stats": True}


def rebuilt_completion_event(payload: dict, include_usage: bool) -> str:
    return event(_chunk_dict(CompletionResponse.model_validate(payload), include_usage))


def rebuilt_chat_event(payload: dict, include_usage: bool) -> str:
    chunk = ChatCompletionChunk.model_validate(payload)
    d = _chunk_dict(chunk, include_usage)
    if chunk.choices:  # a delta shows only the fields it has, as the server builds it
        d["choices"][0]["delta"] = chunk.choices[0].delta.model_dump(exclude_none=True)
    return event(d)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Hi", "n": 2, "stream_options": USAGE}),
    ("/v1/completions", {"prompt": "Hi", "n": 2}),
    ("/v1/completions", {"prompt": 'Say "hi" \\ é', "echo": True, "stream_options": RUNNING_USAGE}),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 2, "stream_options": RUNNING_USAGE}),
    ("/v1/completions", {"prompt": "Hi", "stop": ["a", "e"], "stream_options": USAGE}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "stream_options": USAGE}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
                              "top_logprobs": 2, "stream_options": RUNNING_USAGE}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stop": ["a", "e"]}),
], ids=["completion-n2-usage", "completion-n2", "completion-echo-running-usage", "completion-logprobs",
        "completion-stop", "chat-n2-usage", "chat-logprobs-running-usage", "chat-stop"])
def test_every_event_of_a_stream_is_its_chunk_built_by_pydantic(llm, path, body):
    """Each event, text-only ones from their template included, is byte for byte what
    building the chunk it holds with the response models and serializing it gives; the
    stream is those events and ``data: [DONE]``, nothing else."""
    async def test(c):
        return (await c.post(path, json={**body, **SAMPLED, "stream": True})).text

    text = run(llm, test)
    raw = text.split("\n\n")
    assert raw[-2:] == ["data: [DONE]", ""]
    include_usage = "stream_options" in body
    rebuilt = rebuilt_completion_event if path == "/v1/completions" else rebuilt_chat_event
    payloads = []
    for e in raw[:-2]:
        payload = json.loads(e.removeprefix("data: "))
        assert e + "\n\n" == rebuilt(payload, include_usage)
        payloads.append(payload)
    choices = [ch for p in payloads for ch in p["choices"]]
    assert {ch["index"] for ch in choices} == set(range(body.get("n", 1)))
    assert all(ch["finish_reason"] in ("length", "stop") for ch in choices if ch["finish_reason"])
    assert sum(1 for ch in choices if ch["finish_reason"]) == body.get("n", 1)
    assert ("usage" in payloads[-1] and payloads[-1]["choices"] == []) == include_usage
