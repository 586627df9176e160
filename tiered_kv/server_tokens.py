"""vLLM's tokenizer routes: ``POST /tokenize`` (a prompt, or chat messages rendered with the
chat template) and ``POST /detokenize``, with vLLM's request and response fields.

Both run the tokenizer on a worker thread, as the generation routes do, and apply the same
limits to a prompt's length.
"""
from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, Field

from engine.tokenizer import Tokenizer
from tiered_kv.protocol_errors import RequestError
from tiered_kv.protocol_requests import (
    ChatMessage, StrictRequest, TokenId, check_continue_final_message,
)
from tiered_kv.server_state import ServerState


class TokenizeRequest(StrictRequest):
    """A ``prompt``, or ``messages`` to render with the chat template (exactly one)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictRequest):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


async def tokenize(state: ServerState, chat: Tokenizer, body: TokenizeRequest) -> TokenizeResponse:
    """``chat`` renders messages: the tokenizer, or it with ``--chat-template``'s template."""
    if (body.prompt is None) == (body.messages is None):
        raise RequestError("give either prompt or messages", param="prompt")
    if body.messages is not None:
        check_continue_final_message(body.continue_final_message, body.add_generation_prompt)
    tokenizer, limit = state.llm.tokenizer, state.prompt_limit

    def encode() -> tuple[list[int], list[str] | None]:
        if body.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            try:
                text = chat.apply_chat_template(
                    messages, body.add_generation_prompt, body.chat_template_kwargs, body.continue_final_message
                )
            except ValueError as e:
                raise RequestError(str(e), param="messages") from None
            limit.check_chars(text, "messages")
            ids = tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
        else:
            limit.check_chars(body.prompt, "prompt")
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = tokenizer.encode(body.prompt, add_special_tokens=special)
        strs = [tokenizer.decode_one(t, skip_special_tokens=False) for t in ids] if body.return_token_strs else None
        return ids, strs

    ids, strs = await asyncio.to_thread(encode)
    return TokenizeResponse(
        count=len(ids), max_model_len=state.llm.config.max_model_len, tokens=ids, token_strs=strs
    )


async def detokenize(state: ServerState, body: DetokenizeRequest) -> DetokenizeResponse:
    tokenizer = state.llm.tokenizer
    vocab = tokenizer.vocab_size
    outside = [t for t in body.tokens if t >= vocab]
    if outside:
        raise RequestError(f"token ids outside the vocabulary [0, {vocab}): {outside[:5]}", param="tokens")
    text = await asyncio.to_thread(tokenizer.decode, body.tokens, False)
    return DetokenizeResponse(prompt=text)
