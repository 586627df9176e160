"""What the server refuses before it spends work on a request.

- A body over ``--max-request-body-mib``: 413, at once when ``Content-Length`` says so, else
  as soon as the bytes received pass the limit (a chunked body declares no length).
- Text that is not valid Unicode: JSON can carry a lone surrogate (``"\\ud800"``), UTF-8 and
  so the tokenizer and every response cannot. 400 naming the field.
- A prompt that cannot fit ``max_model_len``: 400 before it is tokenized when it has more
  characters than that many tokens can stand for, and after, when it has too many tokens.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.async_engine import AsyncLLM
from tiered_kv.protocol_errors import RequestError, error_body
from tiered_kv.units import format_size

# Normalizers may fold several characters into one (NFC composes a letter and its accents),
# so a token can stand for more characters of the request than of its own text.
CHARS_PER_TOKEN_SLACK = 4
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class PromptLimit:
    """A prompt must leave room for one generated token in ``max_model_len``; one of more than
    ``max_chars`` characters cannot, whatever its tokens."""

    max_model_len: int
    max_chars: int

    @classmethod
    def of(cls, llm: AsyncLLM) -> PromptLimit:
        max_model_len = llm.config.max_model_len
        chars_per_token = llm.tokenizer.max_token_chars * CHARS_PER_TOKEN_SLACK
        return cls(max_model_len, max_model_len * chars_per_token)

    def check_chars(self, text: str, param: str) -> None:
        if len(text) > self.max_chars:
            raise self._exceeded(
                f"the prompt has {len(text)} characters, more than {self.max_model_len} tokens "
                f"can hold (at most {self.max_chars} characters)",
                param,
            )

    def check_tokens(self, num_tokens: int, param: str) -> None:
        if num_tokens >= self.max_model_len:
            raise self._exceeded(
                f"the prompt has {num_tokens} tokens and at least one token must be generated", param
            )

    def _exceeded(self, detail: str, param: str) -> RequestError:
        return RequestError(
            f"This model's maximum context length (max_model_len) is {self.max_model_len} tokens; {detail}.",
            param=param,
            code="context_length_exceeded",
        )


def check_unicode(body: BaseModel) -> None:
    """Refuse a body with a lone surrogate in any of its strings (keys too), naming the field."""
    for name, value in body:
        if _has_surrogate(value):
            raise RequestError(
                f"{name} is not valid Unicode: it holds a lone surrogate (U+D800 to U+DFFF)", param=name
            )


def _has_surrogate(value: object) -> bool:
    """A walk with a stack of its own, not recursion: JSON nested a few hundred levels deep
    (which the parser accepts) would pass Python's recursion limit, a 500."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item) is not None:
                return True
        elif isinstance(item, BaseModel):
            pending.extend(v for _, v in item)
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):  # skipping numbers keeps a long list of token ids cheap
            pending.extend(v for v in item if not isinstance(v, (int, float)))
    return False


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` once a body passes the limit; the error handlers answer it."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, _too_large_message(max_bytes))


class BodyLimitMiddleware:
    """Answers 413 to a request whose body is over ``max_bytes``."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            body = error_body(_too_large_message(self.max_bytes), "invalid_request_error")
            await JSONResponse(body, 413)(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counting_receive, send)


def _too_large_message(max_bytes: int) -> str:
    return f"the request body is larger than {format_size(max_bytes)} (--max-request-body-mib)"


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
