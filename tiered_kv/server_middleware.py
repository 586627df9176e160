"""The middleware every request passes first: the key checks and the count of responses by
route and status code.

Keys: ``/v1/*`` (and the API docs) need ``--api-key`` when one is set; ``/admin/*`` needs
``--admin-api-key``, and does not exist without one (404); ``/health`` and ``/metrics`` are
open, as vLLM's are. Keys are compared in constant time."""
from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tiered_kv.protocol import error_body
from tiered_kv.server_state import ServerState

OPEN_ROUTES = frozenset({"/health", "/metrics"})  # reachable without a key
ADMIN_PREFIX = "/admin/"

class HttpMiddleware:
    """Checks the keys (see the module docstring) and counts responses by route and status."""

    def __init__(
        self, app: ASGIApp, *, state: ServerState, api_key: str | None,
        admin_api_key: str | None, paths: frozenset[str],
    ) -> None:
        self.app = app
        self.state = state
        self.expected = _bearer(api_key)
        self.admin_expected = _bearer(admin_api_key)
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
            if path.startswith(ADMIN_PREFIX) and self.admin_expected is None:
                response = JSONResponse(
                    error_body("the admin routes are off: start the server with --admin-api-key",
                               "invalid_request_error", code="not_found"),
                    404,
                )
                await response(scope, receive, counting_send)
                return
            expected = self.admin_expected if path.startswith(ADMIN_PREFIX) else self.expected
            if expected is not None and path not in OPEN_ROUTES and not _authorized(scope, expected):
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



def _bearer(key: str | None) -> bytes | None:
    return None if key is None else f"Bearer {key}".encode()


def _authorized(scope: Scope, expected: bytes) -> bool:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return hmac.compare_digest(value, expected)
    return False
