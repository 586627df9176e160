"""The middleware every request passes first: the API key check and the count of responses
by route and status code."""
from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tiered_kv.protocol import error_body
from tiered_kv.server_state import ServerState

OPEN_ROUTES = frozenset({"/health"})  # reachable without the API key

class HttpMiddleware:
    """Checks the API key (every path but ``OPEN_ROUTES``) and counts responses by route
    and status code."""

    def __init__(self, app: ASGIApp, *, state: ServerState, api_key: str | None, paths: frozenset[str]) -> None:
        self.app = app
        self.state = state
        self.expected = f"Bearer {api_key}".encode() if api_key is not None else None
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in self.paths else "unmatched"
        status = 500

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if self.expected is not None and path not in OPEN_ROUTES and not self._authorized(scope):
                response = JSONResponse(
                    error_body("Incorrect or missing API key (Authorization: Bearer KEY)",
                               "invalid_request_error", code="invalid_api_key"),
                    401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await response(scope, receive, counting_send)
                return
            await self.app(scope, receive, counting_send)
        finally:
            metrics = self.state.metrics
            if metrics is not None:
                metrics.requests.labels(route=route, status=str(status)).inc()

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return hmac.compare_digest(value, self.expected)
        return False
