"""Every error the server answers, in OpenAI's shape: ``{"error": {"message", "type", "param",
"code"}}``. An unexpected exception is logged and answered with a 500 that does not repeat it."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tiered_kv.protocol_errors import RequestError, error_body
from tiered_kv.server_generation import ClientGone

logger = logging.getLogger(__name__)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def request_error(request: Request, e: RequestError) -> Response:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> Response:
        errors = e.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
            return JSONResponse(error_body(message.rstrip(": "), "invalid_request_error"), 400)
        if first.get("loc") == ("body",) and isinstance(first.get("input"), bytes):
            # FastAPI reads a body as JSON only when its Content-Type says so (curl -d does not)
            content_type = request.headers.get("content-type", "none")
            message = f"the request body must be JSON, with Content-Type: application/json (got {content_type})"
            return JSONResponse(error_body(message, "invalid_request_error"), 400)
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = "; ".join(
            f"{'.'.join(str(p) for p in err.get('loc', ()) if p != 'body') or 'body'}: {err.get('msg')}"
            for err in errors
        )
        return JSONResponse(error_body(message, "invalid_request_error", loc[0] if loc else None), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(e.detail), kind), e.status_code, headers=e.headers)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, e: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; counted in the metrics

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> Response:
        logger.exception("request failed")
        message = "internal server error (the cause is in the server's log)"
        return JSONResponse(error_body(message, "server_error"), 500)
