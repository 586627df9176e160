"""The middleware every request passes first: the key checks and the count of responses by
route and status code.

Keys: with ``--api-key``, every route but ``/admin/*`` and the open ones (``/health``,
``/ping``, ``/version``, ``/metrics``, as vLLM's) needs one of its keys; ``/admin/*`` needs
``--admin-api-key``, and does not exist without one (404). Keys are compared in constant time."""
from __future__ import annotations

import hmac
from collections.abc import Awaitable

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tiered_kv.protocol_errors import error_body
from tiered_kv.server_state import ServerState

OPEN_ROUTES = frozenset({"/health", "/ping", "/version", "/metrics"})  # reachable without a key
ADMIN_PREFIX = "/admin/"

class HttpMiddleware:
    """Checks the keys (see the module docstring) and counts responses by route and status."""

    def __init__(
        self, app: ASGIApp, *, state: ServerState, api_keys: tuple[str, ...],
        admin_api_key: str | None, paths: frozenset[str],
    ) -> None:
        self.app = app
        self.state = state
        self.expected = tuple(_bearer(key) for key in api_keys) or None
        self.admin_expected = (_bearer(admin_api_key),) if admin_api_key is not None else None
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in self.paths else "unmatched"
        status = 500

        def counting_send(message: Message) -> Awaitable[None]:
            # send's own awaitable, not a coroutine around it: a frame fewer per streamed event
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            return send(message)

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
                if route == "unmatched" and "route" in scope:  # one with a parameter: its template
                    route = scope["route"].path
                metrics.requests.labels(route=route, status=str(status)).inc()



def _bearer(key: str) -> bytes:
    return f"Bearer {key}".encode()


def _authorized(scope: Scope, expected: tuple[bytes, ...]) -> bool:
    """Whether the request's first Authorization header is one of ``expected``; every key is
    compared, in constant time, whichever matches."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            return sum(hmac.compare_digest(value, key) for key in expected) > 0
    return False
