"""The server-sent events of a streamed response: OpenAI's chunk format, one event per
output that brings something, ending in ``data: [DONE]``. A streamed generation's outputs
are :attr:`~engine.outputs.RequestOutputKind.DELTA` ones: each brings its new tokens, text
and logprobs only, and its :class:`~tiered_kv.server_generation.Generation` counts the
tokens for the usage.

Every streamed output costs the event loop, which shares Python's interpreter lock with the
engine's thread, so the path from an engine output to its bytes is kept short: one async
generator per response (:func:`completion_events`, :func:`chat_events`) reads the
generations and yields each event rendered, and :class:`SSEResponse` writes it.

A chunk that carries only new text (no logprobs, no finish, no running usage), which is
nearly every chunk of a stream, is rendered from a template of its choice: the chunk built
and serialized once, as any other, around a marker, and then each event is the two halves
around the text's JSON string. That is the same bytes as building and serializing the chunk
(tested), at a fraction of the event loop's time.
"""
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from json.encoder import encode_basestring_ascii
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tiered_kv.protocol_errors import RequestError
from tiered_kv.protocol_requests import ChatCompletionRequest, CompletionRequest
from tiered_kv.protocol_responses import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
)
from tiered_kv.server_generation import Generations
from tiered_kv.server_logprobs import chat_logprobs, completion_logprobs
from tiered_kv.server_responses import prompt_usage, usage
from tiered_kv.server_state import ServerState

_MARK = "\ue000tiered-kv text\ue000"  # where a template's text goes (a private-use character)
_DONE = b"data: [DONE]\n\n"


class TextEvents:
    """The events of text-only chunks: ``render(k, text)`` gives choice ``k``'s chunk as a
    dict; ``event(k, text)`` its event, from the choice's template once there is one.

    ``json.dumps`` of a string, with its default arguments, is ``encode_basestring_ascii``
    of it; the halves are around that."""

    def __init__(self, render: Callable[[int, str], dict[str, Any]]) -> None:
        self._render = render
        self._halves: dict[int, tuple[str, str] | None] = {}

    def event(self, k: int, text: str) -> str:
        try:
            halves = self._halves[k]
        except KeyError:
            parts = event(self._render(k, _MARK)).split(json.dumps(_MARK))
            halves = self._halves[k] = (parts[0], parts[1]) if len(parts) == 2 else None  # else: by hand
        if halves is None:
            return event(self._render(k, text))
        return halves[0] + encode_basestring_ascii(text) + halves[1]


class SSEResponse(StreamingResponse):
    """Writes ``events`` (rendered events) as they come, then ``data: [DONE]`` with the end
    of the body. An error after the status line went out (the engine failed on the request)
    is sent as a last ``{"error": ...}`` event before ``[DONE]``, as vLLM does. The events
    are closed however the response ends (a client that disconnects cancels the send, not
    the iterator), so the request is aborted at once."""

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for text in self.body_iterator:
                await send({"type": "http.response.body", "body": text.encode(), "more_body": True})
        except RequestError as e:
            await send({"type": "http.response.body", "body": event(e.body()).encode(), "more_body": True})
        await send({"type": "http.response.body", "body": _DONE, "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def completion_events(
    state: ServerState, group: Generations, body: CompletionRequest, prompt_texts: list[str]
) -> AsyncIterator[str]:
    """Events of every choice as they come (``best_of > n`` is not streamed: all are sent)."""
    config, llm = state.config, state.llm
    created = int(time.time())
    generations = group.generations
    count = len(generations)
    offsets, last = [0] * count, [None] * count
    echo = [body.echo] * count

    def render(k: int, text: str, out=None, logprobs=None) -> dict:
        choice = CompletionChoice(
            index=k, text=text, logprobs=logprobs,
            finish_reason=out.finish_reason if out is not None else None,
            stop_reason=out.stop_reason if out is not None else None,
        )
        running = None
        if body.continuous_usage and out is not None:
            running = usage([[out]], generations[k].num_tokens)
        chunk = CompletionResponse(
            id=group.id, created=created, model=config.model_name, choices=[choice], usage=running,
        )
        return _chunk_dict(chunk, body.include_usage)

    text_event = TextEvents(render).event
    plain = body.logprobs is None and not body.continuous_usage  # text-only chunks
    try:
        async with contextlib.aclosing(group.outputs()) as outputs:
            async for k, out in outputs:
                last[k] = out
                if plain and out.finish_reason is None and not echo[k]:
                    if out.delta_text:
                        yield text_event(k, out.delta_text)
                    continue
                logprobs = None
                if body.logprobs is not None:
                    logprobs = completion_logprobs(llm, out, 0, offsets[k])
                    offsets[k] += sum(len(t) for t in logprobs.tokens)
                text = out.delta_text
                if echo[k]:
                    text, echo[k] = prompt_texts[k // body.n] + text, False
                if not text and not out.finished and not (logprobs and logprobs.tokens):
                    continue
                yield event(render(k, text, out, logprobs))
        if body.include_usage and all(last):
            usage_chunk = CompletionResponse(
                id=group.id, created=created, model=config.model_name, choices=[],
                usage=usage([last[i : i + body.n] for i in range(0, count, body.n)],
                            sum(g.num_tokens for g in generations)),
            )
            yield event(usage_chunk.model_dump())
    finally:
        await group.close()


async def chat_events(state: ServerState, group: Generations, body: ChatCompletionRequest) -> AsyncIterator[str]:
    config, llm = state.config, state.llm
    created = int(time.time())
    generations = group.generations
    count = len(generations)
    last = [None] * count

    def chunk(
        k: int, delta: DeltaMessage, finish_reason: str | None = None, logprobs=None, stop_reason=None
    ) -> dict:
        choice = ChatChunkChoice(
            index=k, delta=delta, finish_reason=finish_reason, logprobs=logprobs, stop_reason=stop_reason
        )
        running = None
        if body.continuous_usage:  # before the first output (the role chunk): no tokens yet
            running = (usage([[last[k]]], generations[k].num_tokens) if last[k] is not None
                       else prompt_usage(generations[k].first))
        c = ChatCompletionChunk(
            id=group.id, created=created, model=config.model_name, choices=[choice], usage=running
        )
        d = _chunk_dict(c, body.include_usage)
        d["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
        return d

    text_event = TextEvents(lambda k, text: chunk(k, DeltaMessage(content=text))).event
    plain = not body.logprobs and not body.continuous_usage  # text-only chunks
    try:
        for k in range(count):
            yield event(chunk(k, DeltaMessage(role="assistant", content="")))
        async with contextlib.aclosing(group.outputs()) as outputs:
            async for k, out in outputs:
                last[k] = out
                if plain and out.finish_reason is None:
                    if out.delta_text:
                        yield text_event(k, out.delta_text)
                    continue
                logprobs = None
                if body.logprobs:
                    logprobs = chat_logprobs(llm, out, 0)
                if out.delta_text or (logprobs and logprobs.content):
                    yield event(chunk(k, DeltaMessage(content=out.delta_text), logprobs=logprobs))
                if out.finished:
                    yield event(chunk(
                        k, DeltaMessage(), finish_reason=out.finish_reason, stop_reason=out.stop_reason
                    ))
        if body.include_usage and all(last):
            usage_chunk = ChatCompletionChunk(
                id=group.id, created=created, model=config.model_name, choices=[],
                usage=usage([last], sum(g.num_tokens for g in generations)),
            )
            yield event(usage_chunk.model_dump())
    finally:
        await group.close()


def _chunk_dict(chunk: CompletionResponse | ChatCompletionChunk, include_usage: bool) -> dict:
    d = chunk.model_dump()
    if not include_usage:  # with include_usage every chunk has "usage": null, as OpenAI sends
        d.pop("usage")
    return d
