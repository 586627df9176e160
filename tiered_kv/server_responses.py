"""The bodies the generation routes answer with when they are not streamed: whole responses,
with their usage and logprobs (a stream's events: :mod:`tiered_kv.server_stream`).

A request's generations are prompt-major: generation ``k`` is choice ``k`` of prompt
``k // per_prompt``. With ``best_of`` above ``n``, each prompt's generations are ranked by
cumulative logprob and its best ``n`` become choices ``prompt * n + rank``, as vLLM did.
"""
from __future__ import annotations

import uuid

from engine.outputs import RequestOutput
from tiered_kv.protocol_requests import ChatCompletionRequest, CompletionRequest
from tiered_kv.protocol_responses import (
    ChatChoice,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
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


def prompt_usage(out: RequestOutput) -> Usage:
    """The usage of a choice that has no token yet: its prompt's."""
    prompt = len(out.prompt_token_ids)
    return Usage(
        prompt_tokens=prompt, completion_tokens=0, total_tokens=prompt,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens),
    )


def usage(by_prompt: list[list[RequestOutput]], completion: int | None = None) -> Usage:
    """Each prompt counted once (its cached tokens as its first choice found them), every
    choice's tokens counted (or ``completion`` tokens, for outputs that bring only their
    new ones)."""
    prompt = sum(len(outs[0].prompt_token_ids) for outs in by_prompt)
    if completion is None:
        completion = sum(len(out.token_ids) for outs in by_prompt for out in outs)
    cached = sum(outs[0].num_cached_tokens for outs in by_prompt)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


