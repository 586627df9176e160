"""``tiered-kv serve``: the OpenAI-compatible HTTP server over :class:`engine.AsyncLLM`.

Routes (docs/server.md): ``/v1/completions``, ``/v1/chat/completions`` (both with SSE
streaming), ``/v1/models`` (and ``/v1/models/{model}``), ``/tokenize``, ``/detokenize``,
``/health`` (and ``/ping``), ``/version``, ``/metrics``, and the admin routes
``/admin/tiers``, ``/admin/flush``, ``/admin/evict``, ``/admin/clear``. With an API key
every route but ``/health``, ``/ping``, ``/version`` and ``/metrics`` needs
``Authorization: Bearer KEY``.

This module builds the app and its routes; the rest of the server lives beside it:
``server_limits`` (what is refused up front), ``server_completions`` (the generation routes:
prompts, choices, ``max_tokens``), ``server_generation`` (an admitted request),
``server_responses`` (response bodies and streams), ``server_admin``, ``server_errors``,
``server_middleware`` (API key, response counts), ``server_tokens`` (``/tokenize``,
``/detokenize``) and ``server_state``.

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
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from engine.async_engine import AsyncLLM
from tiered_kv import __version__, server_admin, server_completions, server_tokens
from tiered_kv.protocol_errors import RequestError, error_body
from tiered_kv.protocol_requests import (
    ChatCompletionRequest,
    ClearRequest,
    CompletionRequest,
    EvictRequest,
    FlushRequest,
)
from tiered_kv.protocol_responses import ModelCard, ModelList
from tiered_kv.generation_defaults import GenerationDefaults
from tiered_kv.model_source import load_chat_template, resolve_model
from tiered_kv.serve_config import ServeConfig
from tiered_kv.server_errors import install_error_handlers
from tiered_kv.server_limits import BodyLimitMiddleware, PromptLimit, check_unicode
from tiered_kv.server_metrics import ServerMetrics
from tiered_kv.server_startup import AnnouncingServer, log_serving, startup_lines
from tiered_kv.server_middleware import HttpMiddleware
from tiered_kv.server_state import ServerState
from tiered_kv.server_tokens import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from tiered_kv.tier_manager import TierManager
from tiered_kv.vllm_compat import IGNORED_FLAGS

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
        model = resolve_model(config.model, download_dir=config.download_dir, revision=config.revision)
        tokenizer = None
        if config.tokenizer is not None:  # another repository's: its main revision
            tokenizer = resolve_model(config.tokenizer, download_dir=config.download_dir)
        return AsyncLLM(model, kv_connector=manager, tokenizer=tokenizer, **config.engine_kwargs())
    except BaseException:
        if manager is not None:
            manager.close()
        raise


def create_app(config: ServeConfig, llm: AsyncLLM | None = None) -> FastAPI:
    """The server's app. Without ``llm`` it builds the engine (and its tiers) now and shuts
    them down (flushing the tiers) when the app's lifespan ends; a given ``llm`` is left
    running for its owner to shut down."""
    owns_llm = llm is None
    chat_template = load_chat_template(config.chat_template) if config.chat_template else None
    if llm is None:
        llm = build_async_llm(config)
    try:
        chat = llm.tokenizer if chat_template is None else llm.tokenizer.with_chat_template(chat_template)
    except ValueError as e:
        if owns_llm:
            llm.shutdown()
            if isinstance(llm.engine.connector, TierManager):
                llm.engine.connector.close()
        raise ValueError(f"--chat-template: {e}") from None
    try:
        generation_defaults = GenerationDefaults.load(
            config.generation_config, llm.engine.model_path, config.override_generation_config
        )
    except ValueError:
        if owns_llm:
            llm.shutdown()
            if isinstance(llm.engine.connector, TierManager):
                llm.engine.connector.close()
        raise
    manager = llm.engine.connector if isinstance(llm.engine.connector, TierManager) else None
    registry = CollectorRegistry()
    state = ServerState(config, llm, manager, registry, owns_llm, PromptLimit.of(llm))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.metrics = ServerMetrics(
            registry, config.model_name, llm.stats, lambda: state.inflight,
            manager.metrics if manager is not None else None, llm.config,
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

    @app.get("/ping")
    @app.post("/ping", operation_id="ping_post")
    async def ping() -> Response:  # vLLM's (SageMaker's) health check
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    def model_card(name: str) -> ModelCard:
        return ModelCard(
            id=name, created=state.started, root=config.model, max_model_len=llm.config.max_model_len
        )

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[model_card(name) for name in config.model_names])

    @app.get("/v1/models/{model:path}")  # OpenAI's retrieve; ids such as "org/name" hold a "/"
    async def retrieve_model(model: str) -> ModelCard:
        _check_model(config, model)
        return model_card(model)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        check_unicode(body)
        _check_model(config, body.model)
        return await server_tokens.tokenize(state, chat, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        _check_model(config, body.model)
        return await server_tokens.detokenize(state, body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_unicode(body)
        _check_model(config, body.model)
        return await server_completions.completions(state, generation_defaults, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_unicode(body)
        _check_model(config, body.model)
        return await server_completions.chat_completions(state, generation_defaults, chat, body, request)

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
        HttpMiddleware, state=state, api_keys=config.api_key, admin_api_key=config.admin_api_key,
        paths=paths,
    )
    if config.allowed_origins:  # outermost: preflights are answered before the API key is asked
        app.add_middleware(
            CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=config.allowed_methods,
            allow_headers=config.allowed_headers, allow_credentials=config.allow_credentials,
        )
    return app


def run(config: ServeConfig, ignored_flags: Sequence[str] = ()) -> None:
    """Load the model, open the tiers, and serve until SIGINT/SIGTERM; then finish open
    requests (up to ``GRACEFUL_SHUTDOWN_S``), stop the engine and flush the tiers.
    ``ignored_flags``: vLLM flags given that have no effect here, logged once."""
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if ignored_flags:
        logger.warning("ignored vLLM flags (no effect here): %s", "; ".join(
            f"{flag} ({IGNORED_FLAGS[flag].reason})" for flag in ignored_flags
        ))
    began = time.monotonic()
    # The port first: a busy one is an error at once, not after the model has loaded.
    listener = _listen(config.host, config.port)
    try:
        app = create_app(config)
    except BaseException:
        listener.close()
        raise
    state: ServerState = app.state.tiered_kv
    for line in startup_lines(config, state.llm, state.manager, time.monotonic() - began):
        logger.info("%s", line)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT and then raises the signal again for
    # the handler it found; no-op handlers make that a clean exit (code 0), which is what
    # process managers expect from an orderly stop.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {}
    if main_thread:
        previous = {sig: signal.signal(sig, lambda signum, frame: None) for sig in _STOP_SIGNALS}
    try:
        AnnouncingServer(uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            access_log=not config.disable_uvicorn_access_log,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        ), lambda: log_serving(config.model_name, config.host, listener.getsockname()[1])).run(
            sockets=[listener]
        )
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
    if model is not None and model not in config.model_names:
        served = " or ".join(repr(name) for name in config.model_names)
        raise RequestError(
            f"The model {model!r} does not exist; this server serves {served}.",
            status=404,
            param="model",
            code="model_not_found",
        )
