"""A client error and OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
from __future__ import annotations

from typing import Any


class RequestError(Exception):
    """A client error: HTTP ``status`` with OpenAI's ``{"error": {...}}`` body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape. A lone surrogate (from the request) in ``message`` or ``param`` is
    written as its escape: the body must encode as UTF-8."""
    param = _utf8(param) if param is not None else None
    return {"error": {"message": _utf8(message), "type": type, "param": param, "code": code}}


def _utf8(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
