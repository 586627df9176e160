"""A stream's text-only chunks come from a template per choice: the same bytes as building and
serializing each chunk."""
from __future__ import annotations

import json
import random
import zlib

import pytest

from tiered_kv.protocol_responses import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
)
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
