"""The bodies the generation routes answer with: whole responses, usage and logprobs, and
the server-sent events of a stream (OpenAI's chunk format, ending in ``data: [DONE]``).

A request's generations are prompt-major: generation ``k`` is choice ``k`` of prompt
``k // per_prompt``. With ``best_of`` above ``n``, each prompt's generations are ranked by
cumulative logprob and its best ``n`` become choices ``prompt * n + rank``, as vLLM did.
"""
from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.outputs import RequestOutput
from tiered_kv.protocol_errors import RequestError
from tiered_kv.protocol_requests import ChatCompletionRequest, CompletionRequest
from tiered_kv.protocol_responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    Usage,
)
from tiered_kv.server_generation import Generations
from tiered_kv.server_logprobs import chat_logprobs, completion_logprobs, echo_logprobs, prompt_logprobs
from tiered_kv.server_state import ServerState


def completion_response(
    state: ServerState, group: Generations, outs: list[RequestOutput], body: CompletionRequest,
    prompt_texts: list[str],
) -> dict:
    per_prompt = body.num_generated
    by_prompt = [_best(outs[i : i + per_prompt], body.n) for i in range(0, len(outs), per_prompt)]
    llm, choices = state.llm, []
    for p, prompt_outs in enumerate(by_prompt):
        echo = prompt_texts[p] if body.echo else ""
        for rank, out in enumerate(prompt_outs):
            logprobs = None
            if body.logprobs is not None:
                logprobs = echo_logprobs(llm, out, True) if body.echo else completion_logprobs(llm, out, 0, 0)
            choices.append(CompletionChoice(
                index=p * body.n + rank,
                text=echo + out.text,
                logprobs=logprobs,
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
                prompt_logprobs=prompt_logprobs(llm, out),
            ))
    response = CompletionResponse(
        id=group.id, model=state.config.model_name, choices=choices, usage=usage(by_prompt)
    )
    return response.model_dump()


def echo_response(
    state: ServerState, prompt_texts: list[str], prompt_lengths: list[int], n: int,
    scored: list[RequestOutput] | None = None, with_logprobs: bool = False,
) -> dict:
    """``n`` choices per prompt, each the prompt's text, and no token generated. ``scored``:
    one output per prompt that computed its prompt logprobs (its generated token is left
    out); ``with_logprobs``: they are also the choices' ``logprobs``."""
    llm = state.llm
    choices = [
        CompletionChoice(
            index=p * n + k, text=text, finish_reason="length",
            logprobs=echo_logprobs(llm, scored[p], False) if with_logprobs else None,
            prompt_logprobs=prompt_logprobs(llm, scored[p]) if scored else None,
        )
        for p, text in enumerate(prompt_texts) for k in range(n)
    ]
    prompt = sum(prompt_lengths)
    response = CompletionResponse(
        id=f"cmpl-{uuid.uuid4().hex}", model=state.config.model_name, choices=choices,
        usage=Usage(
            prompt_tokens=prompt, completion_tokens=0, total_tokens=prompt,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=0),
        ),
    )
    return response.model_dump()


def chat_response(
    state: ServerState, group: Generations, outs: list[RequestOutput], body: ChatCompletionRequest
) -> dict:
    choices = [
        ChatChoice(
            index=k,
            message=ChatMessageOut(content=out.text),
            logprobs=chat_logprobs(state.llm, out, 0) if body.logprobs else None,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
        )
        for k, out in enumerate(outs)
    ]
    response = ChatCompletionResponse(
        id=group.id, model=state.config.model_name, choices=choices, usage=usage([outs]),
        prompt_logprobs=prompt_logprobs(state.llm, outs[0]),
    )
    return response.model_dump()


def _best(outs: list[RequestOutput], n: int) -> list[RequestOutput]:
    """The ``n`` outputs of highest cumulative logprob, best first (all of them, in order,
    when there are only ``n``)."""
    if len(outs) == n:
        return outs
    return sorted(outs, key=lambda out: sum(out.logprobs or ()), reverse=True)[:n]


def _prompt_usage(out: RequestOutput) -> Usage:
    """The usage of a choice that has no token yet: its prompt's."""
    prompt = len(out.prompt_token_ids)
    return Usage(
        prompt_tokens=prompt, completion_tokens=0, total_tokens=prompt,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens),
    )


def usage(by_prompt: list[list[RequestOutput]]) -> Usage:
    """Each prompt counted once (its cached tokens as its first choice found them), every
    choice's tokens counted."""
    prompt = sum(len(outs[0].prompt_token_ids) for outs in by_prompt)
    completion = sum(len(out.token_ids) for outs in by_prompt for out in outs)
    cached = sum(outs[0].num_cached_tokens for outs in by_prompt)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


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


async def completion_chunks(
    state: ServerState, group: Generations, body: CompletionRequest, prompt_texts: list[str]
) -> AsyncIterator[dict]:
    """Chunks of every choice as they come (``best_of > n`` is not streamed: all are sent)."""
    config, llm = state.config, state.llm
    created = int(time.time())
    count = len(group.generations)
    sent_logprobs, offsets, last = [0] * count, [0] * count, [None] * count
    echo = [body.echo] * count
    try:
        async with contextlib.aclosing(group.outputs()) as outputs:
            async for k, out in outputs:
                last[k] = out
                logprobs = None
                if body.logprobs is not None:
                    logprobs = completion_logprobs(llm, out, sent_logprobs[k], offsets[k])
                    sent_logprobs[k] = len(out.logprobs or [])
                    offsets[k] += sum(len(t) for t in logprobs.tokens)
                text = out.delta_text
                if echo[k]:
                    text, echo[k] = prompt_texts[k // body.n] + text, False
                if not text and not out.finished and not (logprobs and logprobs.tokens):
                    continue
                choice = CompletionChoice(
                    index=k, text=text, logprobs=logprobs, finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                )
                chunk = CompletionResponse(
                    id=group.id, created=created, model=config.model_name, choices=[choice],
                    usage=usage([[out]]) if body.continuous_usage else None,
                )
                yield _chunk_dict(chunk, body.include_usage)
        if body.include_usage and all(last):
            usage_chunk = CompletionResponse(
                id=group.id, created=created, model=config.model_name, choices=[],
                usage=usage([last[i : i + body.n] for i in range(0, count, body.n)]),
            )
            yield usage_chunk.model_dump()
    finally:
        await group.close()


async def chat_chunks(state: ServerState, group: Generations, body: ChatCompletionRequest) -> AsyncIterator[dict]:
    config, llm = state.config, state.llm
    created = int(time.time())
    count = len(group.generations)
    sent_logprobs, last = [0] * count, [None] * count

    def chunk(
        k: int, delta: DeltaMessage, finish_reason: str | None = None, logprobs=None, stop_reason=None
    ) -> dict:
        choice = ChatChunkChoice(
            index=k, delta=delta, finish_reason=finish_reason, logprobs=logprobs, stop_reason=stop_reason
        )
        running = None
        if body.continuous_usage:  # before the first output (the role chunk): no tokens yet
            running = usage([[last[k]]]) if last[k] is not None else _prompt_usage(group.generations[k].first)
        c = ChatCompletionChunk(
            id=group.id, created=created, model=config.model_name, choices=[choice], usage=running
        )
        d = _chunk_dict(c, body.include_usage)
        d["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
        return d

    try:
        for k in range(count):
            yield chunk(k, DeltaMessage(role="assistant", content=""))
        async with contextlib.aclosing(group.outputs()) as outputs:
            async for k, out in outputs:
                last[k] = out
                logprobs = None
                if body.logprobs:
                    logprobs = chat_logprobs(llm, out, sent_logprobs[k])
                    sent_logprobs[k] = len(out.logprobs or [])
                if out.delta_text or (logprobs and logprobs.content):
                    yield chunk(k, DeltaMessage(content=out.delta_text), logprobs=logprobs)
                if out.finished:
                    yield chunk(k, DeltaMessage(), finish_reason=out.finish_reason, stop_reason=out.stop_reason)
        if body.include_usage and all(last):
            usage_chunk = ChatCompletionChunk(
                id=group.id, created=created, model=config.model_name, choices=[], usage=usage([last])
            )
            yield usage_chunk.model_dump()
    finally:
        await group.close()


def _chunk_dict(chunk: CompletionResponse | ChatCompletionChunk, include_usage: bool) -> dict:
    d = chunk.model_dump()
    if not include_usage:  # with include_usage every chunk has "usage": null, as OpenAI sends
        d.pop("usage")
    return d
