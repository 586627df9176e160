"""The bodies the generation routes answer with: whole responses, usage and logprobs, and
the server-sent events of a stream (OpenAI's chunk format, ending in ``data: [DONE]``)."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.async_engine import AsyncLLM
from engine.outputs import RequestOutput
from tiered_kv.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    RequestError,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from tiered_kv.server_generation import Generation
from tiered_kv.server_state import ServerState


def completion_response(state: ServerState, gen: Generation, out: RequestOutput, logprobs: bool) -> dict:
    choice = CompletionChoice(
        text=out.text,
        logprobs=completion_logprobs(state.llm, out, 0, 0) if logprobs else None,
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
    )
    response = CompletionResponse(id=gen.id, model=state.config.model_name, choices=[choice], usage=usage(out))
    return response.model_dump()


def chat_response(state: ServerState, gen: Generation, out: RequestOutput, logprobs: bool) -> dict:
    choice = ChatChoice(
        message=ChatMessageOut(content=out.text),
        logprobs=chat_logprobs(state.llm, out, 0) if logprobs else None,
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
    )
    response = ChatCompletionResponse(
        id=gen.id, model=state.config.model_name, choices=[choice], usage=usage(out)
    )
    return response.model_dump()


def usage(out: RequestOutput) -> Usage:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens),
    )


def _token_text(llm: AsyncLLM, token_id: int) -> str:
    return llm.tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(llm: AsyncLLM, out: RequestOutput, start: int, offset: int) -> CompletionLogprobs:
    """Logprobs of tokens ``start:`` of ``out``; ``offset``: text offset of token ``start``."""
    result = CompletionLogprobs()
    logprobs = out.logprobs or []
    for i in range(start, len(logprobs)):
        text = _token_text(llm, out.token_ids[i])
        result.tokens.append(text)
        result.token_logprobs.append(logprobs[i])
        result.text_offset.append(offset)
        offset += len(text)
        if out.top_logprobs is not None:
            top = out.top_logprobs[i]
            result.top_logprobs.append({_token_text(llm, t): lp for t, lp in top.items()})
        else:
            result.top_logprobs.append(None)
    return result


def chat_logprobs(llm: AsyncLLM, out: RequestOutput, start: int) -> ChatLogprobs:
    content = []
    logprobs = out.logprobs or []
    for i in range(start, len(logprobs)):
        text = _token_text(llm, out.token_ids[i])
        top = out.top_logprobs[i] if out.top_logprobs is not None else {}
        content.append(
            TokenLogprob(
                token=text,
                logprob=logprobs[i],
                bytes=list(text.encode()),
                top_logprobs=[
                    TopLogprob(token=(t := _token_text(llm, tid)), logprob=lp, bytes=list(t.encode()))
                    for tid, lp in top.items()
                ],
            )
        )
    return ChatLogprobs(content=content)


class _SSEResponse(StreamingResponse):
    """Closes its body iterator however the response ends (a client that disconnects
    cancels the send, not the iterator), so the request is aborted at once."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def sse(chunks: AsyncIterator[dict[str, Any]]) -> Response:
    """A stream of ``chunks``. An error after the status line went out (the engine failed on
    the request) is sent as a last ``{"error": ...}`` event before ``[DONE]``, as vLLM does."""

    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield _event(chunk)
        except RequestError as e:
            yield _event(e.body())
        finally:
            await chunks.aclose()
        yield "data: [DONE]\n\n"

    return _SSEResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def completion_chunks(state: ServerState, gen: Generation, body: CompletionRequest) -> AsyncIterator[dict]:
    config, llm = state.config, state.llm
    created = int(time.time())
    sent_logprobs = offset = 0
    last = None
    try:
        async for out in gen.outputs():
            last = out
            logprobs = None
            if body.logprobs is not None:
                logprobs = completion_logprobs(llm, out, sent_logprobs, offset)
                sent_logprobs = len(out.logprobs or [])
                offset += sum(len(t) for t in logprobs.tokens)
            if not out.delta_text and not out.finished and not (logprobs and logprobs.tokens):
                continue
            choice = CompletionChoice(
                text=out.delta_text, logprobs=logprobs, finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
            )
            chunk = CompletionResponse(id=gen.id, created=created, model=config.model_name, choices=[choice])
            yield _chunk_dict(chunk, body.include_usage)
        if body.include_usage and last is not None:
            usage_chunk = CompletionResponse(
                id=gen.id, created=created, model=config.model_name, choices=[], usage=usage(last)
            )
            yield usage_chunk.model_dump()
    finally:
        await gen.close()


async def chat_chunks(state: ServerState, gen: Generation, body: ChatCompletionRequest) -> AsyncIterator[dict]:
    config, llm = state.config, state.llm
    created = int(time.time())
    sent_logprobs = 0
    last = None

    def chunk(delta: DeltaMessage, finish_reason: str | None = None, logprobs=None) -> dict:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason, logprobs=logprobs)
        c = ChatCompletionChunk(id=gen.id, created=created, model=config.model_name, choices=[choice])
        d = _chunk_dict(c, body.include_usage)
        d["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
        return d

    try:
        yield chunk(DeltaMessage(role="assistant", content=""))
        async for out in gen.outputs():
            last = out
            logprobs = None
            if body.logprobs:
                logprobs = chat_logprobs(llm, out, sent_logprobs)
                sent_logprobs = len(out.logprobs or [])
            if out.delta_text or (logprobs and logprobs.content):
                yield chunk(DeltaMessage(content=out.delta_text), logprobs=logprobs)
            if out.finished:
                yield chunk(DeltaMessage(), finish_reason=out.finish_reason)
        if body.include_usage and last is not None:
            usage_chunk = ChatCompletionChunk(
                id=gen.id, created=created, model=config.model_name, choices=[], usage=usage(last)
            )
            yield usage_chunk.model_dump()
    finally:
        await gen.close()


def _chunk_dict(chunk: CompletionResponse | ChatCompletionChunk, include_usage: bool) -> dict:
    d = chunk.model_dump()
    if not include_usage:  # with include_usage every chunk has "usage": null, as OpenAI sends
        d.pop("usage")
    return d
