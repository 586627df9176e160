"""The two generation routes, from a validated body to the response: prompts tokenized (on a
worker thread) and checked against ``max_model_len``, one engine request per choice started,
and the answer built whole or streamed.

- ``n`` choices per prompt (``best_of`` generated and ranked when it is more): choice ``k``
  of a seeded request gets seed ``seed + k``, as vLLM's parallel sampling does, so the
  choices differ and the same seed gives the same ones again.
- ``/v1/completions`` takes a list of prompts (text or token ids); choices are numbered
  across them (prompt ``i``'s choices are ``i*n`` to ``i*n + n - 1``). ``echo`` puts the
  prompt's text before each choice's.
- ``max_tokens``: a prompt plus ``max_tokens`` past ``max_model_len`` is a 400, as in vLLM;
  without one (chat) a choice may run to ``max_model_len``, or to the generation config's
  ``max_new_tokens`` if smaller.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.sampling_params import SamplingParams
from tiered_kv import server_responses, server_stream
from tiered_kv.generation_defaults import GenerationDefaults
from tiered_kv.protocol_errors import RequestError
from tiered_kv.protocol_requests import ChatCompletionRequest, CompletionRequest
from tiered_kv.server_generation import Generations, Job, check_generations
from tiered_kv.server_state import ServerState



class ChatTemplate(Protocol):
    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None, continue_final_message: bool = False,
    ) -> str: ...


async def completions(
    state: ServerState, defaults: GenerationDefaults, body: CompletionRequest, request: Request
) -> Response:
    _check_logprobs(state, body.logprobs, "logprobs")
    _check_logprobs(state, body.prompt_logprobs, "prompt_logprobs")
    if body.max_tokens == 0:
        return await _echo_only(state, defaults, body, request)
    params = body.to_sampling_params(defaults)
    prompts = body.prompts()
    check_generations(state, len(prompts) * body.num_generated)
    jobs = []
    prompt_ids = await _encode_prompts(state, body)
    for ids in prompt_ids:
        jobs += _choices(state, defaults, ids, params, body.max_tokens, "max_tokens", body.num_generated)
    group = await Generations.start(state, request, "cmpl", jobs, body.cache_salt, body.priority)
    _observe_params(state, jobs, body.num_generated)
    texts = _echo_texts(state, body, prompts, prompt_ids) if body.echo else []
    if body.stream:
        return server_stream.SSEResponse(server_stream.completion_events(state, group, body, texts))
    outs = await group.final(request)
    return JSONResponse(server_responses.completion_response(state, group, outs, body, texts))


async def _encode_prompts(state: ServerState, body: CompletionRequest) -> list[list[int]]:
    """Each prompt's token ids (text is tokenized on a worker thread), truncated as asked,
    within the limits."""
    tokenizer, limit = state.llm.tokenizer, state.prompt_limit
    keep = _truncation(state, body.truncate_prompt_tokens)
    prompts = body.prompts()
    vocab = state.llm.engine.model_config.vocab_size
    for prompt in prompts:
        if isinstance(prompt, str) and keep is None:  # a truncated text may be long
            limit.check_chars(prompt, "prompt")
        # as the engine checks them; an echo that generates nothing decodes them here
        if not isinstance(prompt, str) and not all(0 <= t < vocab for t in prompt):
            raise RequestError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")

    def encode() -> list[list[int]]:
        return [
            tokenizer.encode(p, add_special_tokens=body.add_special_tokens) if isinstance(p, str) else list(p)
            for p in prompts
        ]

    prompt_ids = [_truncated(ids, keep) for ids in await asyncio.to_thread(encode)]
    for ids in prompt_ids:
        limit.check_tokens(len(ids), "prompt")
    return prompt_ids


def _truncation(state: ServerState, asked: int | None) -> int | None:
    """How many of a prompt's last tokens ``truncate_prompt_tokens`` keeps (None: all), with
    vLLM's rules: -1 is ``max_model_len``, more than that is refused."""
    if asked is None:
        return None
    max_model_len = state.llm.config.max_model_len
    if asked == 0:
        raise RequestError("truncate_prompt_tokens must be -1 or at least 1", param="truncate_prompt_tokens")
    if asked > max_model_len:
        raise RequestError(
            f"truncate_prompt_tokens ({asked}) is more than max_model_len ({max_model_len}); "
            f"ask for fewer, or -1 for max_model_len", param="truncate_prompt_tokens",
        )
    return max_model_len if asked == -1 else asked


def _truncated(ids: list[int], keep: int | None) -> list[int]:
    return ids if keep is None or len(ids) <= keep else ids[-keep:]


def _echo_texts(
    state: ServerState, body: CompletionRequest, prompts: list[str | list[int]], prompt_ids: list[list[int]]
) -> list[str]:
    """What ``echo`` puts first: each prompt as sent, or the text of the tokens kept of it."""
    if body.truncate_prompt_tokens is None:
        return [_prompt_text(state, p) for p in prompts]
    return [state.llm.tokenizer.decode(ids) for ids in prompt_ids]


async def _echo_only(
    state: ServerState, defaults: GenerationDefaults, body: CompletionRequest, request: Request
) -> Response:
    """``max_tokens: 0`` with ``echo``, as vLLM takes it (scoring a prompt): each choice is its
    prompt, and nothing is generated. With ``logprobs`` (or ``prompt_logprobs``) each prompt
    is computed once, for one token that is left out, to give the prompt's logprobs."""
    if not body.echo:
        raise RequestError(
            "max_tokens must be at least 1 (0 only with echo: the prompt back, nothing generated)",
            param="max_tokens",
        )
    if body.stream:
        raise RequestError("max_tokens 0 with echo is not streamed; leave out stream", param="stream")
    check_generations(state, len(body.prompts()) * body.n)  # each is a choice to build
    one = body.model_copy(update={"max_tokens": 1, "best_of": None})
    params = one.to_sampling_params(defaults)  # every other field's checks
    prompts = body.prompts()
    prompt_ids = await _encode_prompts(state, body)
    texts = _echo_texts(state, body, prompts, prompt_ids)
    scored = None
    if params.prompt_logprobs is not None:
        params = dataclasses.replace(params, logprobs=None)
        jobs = [job for ids in prompt_ids for job in _choices(state, defaults, ids, params, 1, "max_tokens", 1)]
        group = await Generations.start(state, request, "cmpl", jobs, body.cache_salt, body.priority)
        scored = await group.final(request)
    response = server_responses.echo_response(
        state, texts, [len(ids) for ids in prompt_ids], body.n, scored, body.logprobs is not None
    )
    return JSONResponse(response)


async def chat_completions(
    state: ServerState,
    defaults: GenerationDefaults,
    chat: ChatTemplate,
    body: ChatCompletionRequest,
    request: Request,
) -> Response:
    """``chat`` renders the messages: the tokenizer, or it with ``--chat-template``'s template."""
    _check_logprobs(state, body.top_logprobs, "top_logprobs")
    _check_logprobs(state, body.prompt_logprobs, "prompt_logprobs")
    params = body.to_sampling_params(defaults)
    check_generations(state, body.n)
    messages = body.messages_as_dicts()
    tokenizer, limit = state.llm.tokenizer, state.prompt_limit
    keep = _truncation(state, body.truncate_prompt_tokens)

    def render_and_encode() -> list[int]:
        try:
            text = chat.apply_chat_template(
                messages, body.add_generation_prompt, body.chat_template_kwargs, body.continue_final_message
            )
        except ValueError as e:
            raise RequestError(str(e), param="messages") from None
        if keep is None:
            limit.check_chars(text, "messages")
        return _truncated(tokenizer.encode(text, add_special_tokens=body.add_special_tokens), keep)

    ids = await asyncio.to_thread(render_and_encode)
    limit.check_tokens(len(ids), "messages")
    requested, name = body.max_completion_tokens, "max_completion_tokens"
    if requested is None:
        requested, name = body.max_tokens, "max_tokens"
    jobs = _choices(state, defaults, ids, params, requested, name, body.n)
    group = await Generations.start(state, request, "chatcmpl", jobs, body.cache_salt, body.priority)
    _observe_params(state, jobs, body.n)
    if body.stream:
        return server_stream.SSEResponse(server_stream.chat_events(state, group, body))
    outs = await group.final(request)
    return JSONResponse(server_responses.chat_response(state, group, outs, body))


def _check_logprobs(state: ServerState, asked: int | None, param: str) -> None:
    """At most ``--max-logprobs`` (-1: the vocabulary's size, which also bounds any limit),
    as vLLM refuses more; ``asked`` -1 is the vocabulary's size."""
    vocab, limit = state.llm.tokenizer.vocab_size, state.config.max_logprobs
    limit = vocab if limit < 0 else min(limit, vocab)
    if asked is not None and (vocab if asked < 0 else asked) > limit:
        raise RequestError(f"{param} ({asked}) is more than this server's --max-logprobs ({limit})", param=param)


def _observe_params(state: ServerState, jobs: list[Job], per_prompt: int) -> None:
    """vLLM's request parameter histograms, once per admitted prompt."""
    if state.metrics is None:
        return
    for job in jobs[::per_prompt]:
        state.metrics.params_n.observe(per_prompt)
        state.metrics.params_max_tokens.observe(job.params.max_tokens)


def _choices(
    state: ServerState,
    defaults: GenerationDefaults,
    prompt_ids: list[int],
    params: SamplingParams,
    requested: int | None,
    param: str,
    count: int,
) -> list[Job]:
    """``count`` jobs for one prompt: its ``max_tokens``, and seeds ``seed + k``."""
    max_model_len = state.llm.config.max_model_len
    num_prompt = len(prompt_ids)
    if requested is not None and num_prompt + requested > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt + requested} tokens ({num_prompt} in the messages, "
            f"{requested} in the completion). Please reduce the length of the messages or completion.",
            param=param,
            code="context_length_exceeded",
        )
    limits = (max_model_len - num_prompt, requested, defaults.max_tokens)
    try:
        params = dataclasses.replace(params, max_tokens=min(v for v in limits if v is not None))
    except ValueError as e:  # min_tokens above what is left
        raise RequestError(str(e), param="min_tokens") from None
    jobs = []
    for k in range(count):
        seed = params.seed
        child = params if seed is None or k == 0 else dataclasses.replace(params, seed=_int64(seed + k))
        jobs.append(Job(prompt_ids, child))
    return jobs


def _int64(value: int) -> int:
    """``value`` wrapped into the seeds' range, [-2**63, 2**63)."""
    return (value + 2**63) % 2**64 - 2**63


def _prompt_text(state: ServerState, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else state.llm.tokenizer.decode(prompt)
