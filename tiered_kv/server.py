"""``tiered-kv serve``: the OpenAI-compatible HTTP server over :class:`engine.AsyncLLM`.

Routes (docs/server.md): ``/v1/completions``, ``/v1/chat/completions`` (both with SSE
streaming), ``/v1/models``, ``/health``, ``/metrics``, and the admin routes ``/admin/tiers``,
``/admin/flush``, ``/admin/evict``, ``/admin/clear``. With an API key every route but
``/health`` needs ``Authorization: Bearer KEY``.

This module builds the app and its routes; the rest of the server lives beside it:
``server_limits`` (what is refused up front), ``server_generation`` (an admitted request),
``server_responses`` (response bodies and streams), ``server_admin``, ``server_errors``,
``server_middleware`` (API key, response counts) and ``server_state``.

Tokenizing (and rendering a chat template) runs on a worker thread, so a long prompt does
not stall the event loop: other requests and ``/health`` are answered meanwhile.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from engine.async_engine import AsyncLLM
from tiered_kv import server_admin, server_responses
from tiered_kv.protocol import (
    ChatCompletionRequest,
    ClearRequest,
    CompletionRequest,
    EvictRequest,
    FlushRequest,
    ModelCard,
    ModelList,
    RequestError,
    error_body,
)
from tiered_kv.serve_config import ServeConfig
from tiered_kv.server_errors import install_error_handlers
from tiered_kv.server_generation import Generation
from tiered_kv.server_limits import BodyLimitMiddleware, PromptLimit, check_unicode
from tiered_kv.server_metrics import ServerMetrics
from tiered_kv.server_middleware import HttpMiddleware
from tiered_kv.server_state import ServerState
from tiered_kv.tier_manager import TierManager

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 30  # open streams get this long to finish after SIGTERM
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def build_async_llm(config: ServeConfig) -> AsyncLLM:
    """The engine ``config`` describes, with a :class:`TierManager` unless both tier sizes are 0.

    Raises ``storage.base.StoreError`` when the cache directory cannot be used.
    """
    tier_config = config.tier_config()
    manager = TierManager(tier_config) if tier_config is not None else None
    try:
        return AsyncLLM(config.model, kv_connector=manager, **config.engine_kwargs())
    except BaseException:
        if manager is not None:
            manager.close()
        raise


def create_app(config: ServeConfig, llm: AsyncLLM | None = None) -> FastAPI:
    """The server's app. Without ``llm`` it builds the engine (and its tiers) now and shuts
    them down (flushing the tiers) when the app's lifespan ends; a given ``llm`` is left
    running for its owner to shut down."""
    owns_llm = llm is None
    if llm is None:
        llm = build_async_llm(config)
    manager = llm.engine.connector if isinstance(llm.engine.connector, TierManager) else None
    registry = CollectorRegistry()
    state = ServerState(config, llm, manager, registry, owns_llm, PromptLimit.of(llm))
    prompt_limit = state.prompt_limit

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.metrics = ServerMetrics(
            registry, config.model_name, llm.stats, lambda: state.inflight,
            manager.metrics if manager is not None else None,
        )
        try:
            yield
        finally:
            state.metrics.close()
            if state.owns_llm:
                logger.info("shutting down the engine and flushing the KV tiers")
                await asyncio.to_thread(_shutdown, state)

    app = FastAPI(
        title="tiered-kv",
        summary="OpenAI-compatible server with a tiered, persistent KV cache",
        lifespan=lifespan,
    )
    app.state.tiered_kv = state
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if not llm.is_running:
            return JSONResponse(error_body("the engine is not running", "server_error"), 503)
        degraded = manager.degraded_tiers() if manager is not None else []
        if degraded:  # still serving: a tier below cannot keep what it is given
            return JSONResponse({"status": "degraded", "degraded": degraded}, 200)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        card = ModelCard(
            id=config.model_name,
            created=state.started,
            root=config.model,
            max_model_len=llm.config.max_model_len,
        )
        return ModelList(data=[card])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_unicode(body)
        _check_model(config, body.model)
        params = body.to_sampling_params()
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            prompt_limit.check_chars(prompt, "prompt")
            ids = await asyncio.to_thread(llm.tokenizer.encode, prompt)
        else:
            ids = list(prompt)
        prompt_limit.check_tokens(len(ids), "prompt")
        gen = await Generation.start(state, request, "cmpl", ids, params, body.cache_salt)
        if body.stream:
            return server_responses.sse(server_responses.completion_chunks(state, gen, body))
        out = await gen.final(request)
        return JSONResponse(server_responses.completion_response(state, gen, out, params.wants_logprobs))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_unicode(body)
        _check_model(config, body.model)
        params = body.to_sampling_params()
        messages = body.messages_as_dicts()

        def render_and_encode() -> list[int]:
            try:
                text = llm.tokenizer.apply_chat_template(messages)
            except ValueError as e:
                raise RequestError(str(e), param="messages") from None
            prompt_limit.check_chars(text, "messages")
            # The template already holds the special tokens (bos) the model expects.
            return llm.tokenizer.encode(text, add_special_tokens=False)

        ids = await asyncio.to_thread(render_and_encode)
        prompt_limit.check_tokens(len(ids), "messages")
        gen = await Generation.start(state, request, "chatcmpl", ids, params, body.cache_salt)
        if body.stream:
            return server_responses.sse(server_responses.chat_chunks(state, gen, body))
        out = await gen.final(request)
        return JSONResponse(server_responses.chat_response(state, gen, out, params.wants_logprobs))

    @app.get("/admin/tiers")
    async def admin_tiers() -> dict[str, Any]:
        return await asyncio.to_thread(server_admin.tier_report, state)

    @app.post("/admin/flush")
    async def admin_flush(body: FlushRequest | None = None) -> dict[str, Any]:
        timeout = (body or FlushRequest()).timeout
        if manager is None:
            return {"flushed": True, "degraded": []}
        flushed = await asyncio.to_thread(manager.flush, timeout)
        return {"flushed": flushed, "degraded": manager.degraded_tiers()}

    @app.post("/admin/evict")
    async def admin_evict(body: EvictRequest | None = None) -> dict[str, Any]:
        body = body or EvictRequest()
        tiers = ("cpu", "disk") if body.tier == "all" else (body.tier,)
        evicted = await asyncio.to_thread(server_admin.evict, state, tiers, body.namespace)
        return {"namespace": server_admin.namespace_hex(state, body.namespace), "evicted": evicted}

    @app.post("/admin/clear")
    async def admin_clear(body: ClearRequest | None = None) -> dict[str, Any]:
        body = body or ClearRequest()
        evicted = await asyncio.to_thread(server_admin.clear, state, body.namespace)
        return {"namespace": server_admin.namespace_hex(state, body.namespace), "evicted": evicted}

    paths = frozenset(route.path for route in app.routes)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_body_bytes)
    app.add_middleware(  # outermost
        HttpMiddleware, state=state, api_key=config.api_key, admin_api_key=config.admin_api_key,
        paths=paths,
    )
    return app


def run(config: ServeConfig) -> None:
    """Load the model, open the tiers, and serve until SIGINT/SIGTERM; then finish open
    requests (up to ``GRACEFUL_SHUTDOWN_S``), stop the engine and flush the tiers."""
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # The port first: a busy one is an error at once, not after the model has loaded.
    listener = _listen(config.host, config.port)
    try:
        app = create_app(config)
    except BaseException:
        listener.close()
        raise
    state: ServerState = app.state.tiered_kv
    logger.info(
        "serving %s as %r on http://%s:%d (tiers: %s)",
        config.model,
        config.model_name,
        config.host,
        config.port,
        ", ".join(state.manager.metrics.tiers) if state.manager is not None else "none",
    )
    # uvicorn shuts down gracefully on SIGTERM/SIGINT and then raises the signal again for
    # the handler it found; no-op handlers make that a clean exit (code 0), which is what
    # process managers expect from an orderly stop.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {}
    if main_thread:
        previous = {sig: signal.signal(sig, lambda signum, frame: None) for sig in _STOP_SIGNALS}
    try:
        uvicorn.Server(uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )).run(sockets=[listener])
    finally:
        listener.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _shutdown(state)  # a no-op after a normal lifespan shutdown


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` and listening; ``OSError`` naming both if it cannot."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _shutdown(state: ServerState) -> None:
    if not state.owns_llm:
        return
    state.llm.shutdown()
    if state.manager is not None:
        state.manager.close()  # idempotent; covers an engine thread that did not stop in time


def _check_model(config: ServeConfig, model: str | None) -> None:
    if model is not None and model != config.model_name:
        raise RequestError(
            f"The model {model!r} does not exist; this server serves {config.model_name!r}.",
            status=404,
            param="model",
            code="model_not_found",
        )
