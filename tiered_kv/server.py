"""``tiered-kv serve``: the OpenAI-compatible HTTP server over :class:`engine.AsyncLLM`.

Routes (docs/server.md): ``/v1/completions``, ``/v1/chat/completions`` (both with SSE
streaming), ``/v1/models``, ``/health``, ``/metrics``, and the admin routes ``/admin/tiers``,
``/admin/flush``, ``/admin/evict``, ``/admin/clear``. With an API key every route but
``/health`` needs ``Authorization: Bearer KEY``.

A request holds a place in the server from admission until its stream ends; at most
``max_num_seqs + max_queue_len`` requests are held, further ones get 429 with
``Retry-After``. A client that goes away aborts its request, which frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.async_engine import AsyncLLM, EngineDeadError
from engine.outputs import RequestOutput
from engine.sampler import SamplingParams
from storage.base import BlockKey
from storage.remote_store import redact_url
from tiered_kv.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ClearRequest,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    EvictRequest,
    FlushRequest,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    RequestError,
    TokenLogprob,
    TopLogprob,
    Usage,
    error_body,
)
from tiered_kv.serve_config import ServeConfig
from tiered_kv.server_metrics import ServerMetrics
from tiered_kv.tier_manager import TierManager

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a 429 tells the client to wait
GRACEFUL_SHUTDOWN_S = 30  # open streams get this long to finish after SIGTERM
OPEN_ROUTES = frozenset({"/health"})  # reachable without the API key
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
T = TypeVar("T")


class _ClientGone(Exception):
    """The client disconnected before its answer was ready."""


@dataclass
class _State:
    config: ServeConfig
    llm: AsyncLLM
    manager: TierManager | None
    registry: CollectorRegistry
    owns_llm: bool
    started: int = field(default_factory=lambda: int(time.time()))
    inflight: int = 0
    metrics: ServerMetrics | None = None


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
    registry = manager.registry if manager is not None else CollectorRegistry()
    state = _State(config, llm, manager, registry, owns_llm)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.metrics = ServerMetrics(registry, llm.stats, lambda: state.inflight)
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
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if not llm.is_running:
            return JSONResponse(error_body("the engine is not running", "server_error"), 503)
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
        _check_model(config, body.model)
        params = body.to_sampling_params()
        prompt = body.single_prompt()
        ids = llm.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        gen = await _Generation.start(state, request, "cmpl", ids, params, body.cache_salt)
        if body.stream:
            return _sse(_completion_chunks(state, gen, body))
        out = await gen.final(request)
        choice = CompletionChoice(
            text=out.text,
            logprobs=_completion_logprobs(llm, out, 0, 0) if params.wants_logprobs else None,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
        )
        response = CompletionResponse(
            id=gen.id, model=config.model_name, choices=[choice], usage=_usage(out)
        )
        return JSONResponse(response.model_dump())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(config, body.model)
        params = body.to_sampling_params()
        try:
            text = llm.tokenizer.apply_chat_template(body.messages_as_dicts())
        except ValueError as e:
            raise RequestError(str(e), param="messages") from None
        # The template already holds the special tokens (bos) the model expects.
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        gen = await _Generation.start(state, request, "chatcmpl", ids, params, body.cache_salt)
        if body.stream:
            return _sse(_chat_chunks(state, gen, body))
        out = await gen.final(request)
        choice = ChatChoice(
            message=ChatMessageOut(content=out.text),
            logprobs=_chat_logprobs(llm, out, 0) if params.wants_logprobs else None,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
        )
        response = ChatCompletionResponse(
            id=gen.id, model=config.model_name, choices=[choice], usage=_usage(out)
        )
        return JSONResponse(response.model_dump())

    @app.get("/admin/tiers")
    async def admin_tiers() -> dict[str, Any]:
        return await asyncio.to_thread(_tier_report, state)

    @app.post("/admin/flush")
    async def admin_flush(body: FlushRequest | None = None) -> dict[str, Any]:
        timeout = (body or FlushRequest()).timeout
        if manager is None:
            return {"flushed": True}
        return {"flushed": await asyncio.to_thread(manager.flush, timeout)}

    @app.post("/admin/evict")
    async def admin_evict(body: EvictRequest | None = None) -> dict[str, Any]:
        body = body or EvictRequest()
        tiers = ("cpu", "disk") if body.tier == "all" else (body.tier,)
        evicted = await asyncio.to_thread(_evict, state, tiers, body.namespace)
        return {"namespace": _namespace_hex(state, body.namespace), "evicted": evicted}

    @app.post("/admin/clear")
    async def admin_clear(body: ClearRequest | None = None) -> dict[str, Any]:
        body = body or ClearRequest()

        def clear() -> dict[str, int]:
            if manager is not None:  # blocks still queued for disk would come back otherwise
                manager.flush(manager.config.flush_timeout_s)
            return _evict(state, ("cpu", "disk"), body.namespace)

        evicted = await asyncio.to_thread(clear)
        return {"namespace": _namespace_hex(state, body.namespace), "evicted": evicted}

    paths = frozenset(route.path for route in app.routes)
    app.add_middleware(_HttpMiddleware, state=state, api_key=config.api_key, paths=paths)
    return app


def run(config: ServeConfig) -> None:
    """Load the model, open the tiers, and serve until SIGINT/SIGTERM; then finish open
    requests (up to ``GRACEFUL_SHUTDOWN_S``), stop the engine and flush the tiers."""
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = create_app(config)
    state: _State = app.state.tiered_kv
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
        uvicorn.run(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _shutdown(state)  # a no-op after a normal lifespan shutdown


def _shutdown(state: _State) -> None:
    if not state.owns_llm:
        return
    state.llm.shutdown()
    if state.manager is not None:
        state.manager.close()  # idempotent; covers an engine thread that did not stop in time


# ---------------------------------------------------------------- generation


class _Generation:
    """One admitted request: its engine stream, primed with the first output, and its place
    in the server (released when the stream is closed)."""

    def __init__(self, state: _State, request_id: str, arrival: float, stream: AsyncIterator[RequestOutput]):
        self.state = state
        self.id = request_id
        self.arrival = arrival
        self.stream = stream
        self.first: RequestOutput | None = None
        self._last_time = arrival
        self._num_tokens = 0
        self._finished = False
        self._released = False

    @classmethod
    async def start(
        cls,
        state: _State,
        request: Request,
        prefix: str,
        prompt_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None,
    ) -> _Generation:
        arrival = time.perf_counter()
        max_model_len = state.llm.config.max_model_len
        if len(prompt_ids) >= max_model_len:
            raise RequestError(
                f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                f"{len(prompt_ids)} tokens and at least one token must be generated.",
                param="messages" if prefix == "chatcmpl" else "prompt",
                code="context_length_exceeded",
            )
        if state.inflight >= state.config.max_inflight:
            raise RequestError(
                f"the server is at capacity ({state.inflight} requests); retry later",
                status=429,
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        stream = state.llm.generate(prompt_ids, params, request_id=request_id, cache_salt=cache_salt)
        gen = cls(state, request_id, arrival, stream)
        state.inflight += 1
        try:
            gen.first = await _unless_disconnected(request, gen._next())
        except BaseException as e:
            gen._finished = isinstance(e, (ValueError, RequestError))  # refused, not aborted
            await gen.close()
            if isinstance(e, ValueError):
                raise RequestError(str(e)) from None
            raise
        return gen

    async def _next(self) -> RequestOutput:
        try:
            out = await self.stream.__anext__()
        except EngineDeadError as e:
            raise RequestError(str(e), status=503, type="server_error", code="engine_dead") from None
        self._observe(out)
        return out

    def _observe(self, out: RequestOutput) -> None:
        metrics = self.state.metrics
        now = time.perf_counter()
        new = len(out.token_ids) - self._num_tokens
        if metrics is not None and new > 0:
            if self._num_tokens == 0:
                metrics.ttft.observe(now - self.arrival)
            else:
                for _ in range(new):
                    metrics.itl.observe((now - self._last_time) / new)
        if new > 0:
            self._num_tokens, self._last_time = len(out.token_ids), now
        self._finished = out.finished
        if metrics is not None and out.finished:
            metrics.e2e.observe(now - self.arrival)
            metrics.finished.labels(finish_reason=out.finish_reason).inc()
            metrics.cached_prompt_tokens.inc(out.num_cached_tokens)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The first output, then the rest until the request finishes."""
        out = self.first
        yield out
        while not out.finished:
            out = await self._next()
            yield out

    async def final(self, request: Request) -> RequestOutput:
        """The finished output (non-streaming); aborts if the client disconnects first."""

        async def collect() -> RequestOutput:
            last = None
            async for last in self.outputs():
                pass
            return last

        try:
            return await _unless_disconnected(request, collect())
        finally:
            await self.close()

    async def close(self) -> None:
        """Abort the request if it is still running and give its place back. Idempotent."""
        if self._released:
            return
        self._released = True
        self.state.inflight -= 1
        if not self._finished and self.state.metrics is not None:
            self.state.metrics.finished.labels(finish_reason="abort").inc()
        await self.stream.aclose()


async def _unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` unless the client disconnects first (then cancel it: a cancelled
    engine stream aborts its request)."""
    task = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled: stop the work before anyone closes the stream
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise _ClientGone
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---------------------------------------------------------------- responses


def _check_model(config: ServeConfig, model: str | None) -> None:
    if model is not None and model != config.model_name:
        raise RequestError(
            f"The model {model!r} does not exist; this server serves {config.model_name!r}.",
            status=404,
            param="model",
            code="model_not_found",
        )


def _usage(out: RequestOutput) -> Usage:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens),
    )


def _token_text(llm: AsyncLLM, token_id: int) -> str:
    return llm.tokenizer.decode([token_id], skip_special_tokens=False)


def _completion_logprobs(llm: AsyncLLM, out: RequestOutput, start: int, offset: int) -> CompletionLogprobs:
    """Logprobs of tokens ``start:`` of ``out``; ``offset``: text offset of token ``start``."""
    result = CompletionLogprobs()
    logprobs = out.logprobs or []
    for i in range(start, len(logprobs)):
        text = _token_text(llm, out.token_ids[i])
        result.tokens.append(text)
        result.token_logprobs.append(logprobs[i])
        result.text_offset.append(offset)
        offset += len(text)
        if out.top_logprobs is not None:
            top = out.top_logprobs[i]
            result.top_logprobs.append({_token_text(llm, t): lp for t, lp in top.items()})
        else:
            result.top_logprobs.append(None)
    return result


def _chat_logprobs(llm: AsyncLLM, out: RequestOutput, start: int) -> ChatLogprobs:
    content = []
    logprobs = out.logprobs or []
    for i in range(start, len(logprobs)):
        text = _token_text(llm, out.token_ids[i])
        top = out.top_logprobs[i] if out.top_logprobs is not None else {}
        content.append(
            TokenLogprob(
                token=text,
                logprob=logprobs[i],
                bytes=list(text.encode()),
                top_logprobs=[
                    TopLogprob(token=(t := _token_text(llm, tid)), logprob=lp, bytes=list(t.encode()))
                    for tid, lp in top.items()
                ],
            )
        )
    return ChatLogprobs(content=content)


class _SSEResponse(StreamingResponse):
    """Closes its body iterator however the response ends (a client that disconnects
    cancels the send, not the iterator), so the request is aborted at once."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _sse(chunks: AsyncIterator[dict[str, Any]]) -> Response:
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await chunks.aclose()

    return _SSEResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _completion_chunks(state: _State, gen: _Generation, body: CompletionRequest) -> AsyncIterator[dict]:
    config, llm = state.config, state.llm
    created = int(time.time())
    sent_logprobs = offset = 0
    last = None
    try:
        async for out in gen.outputs():
            last = out
            logprobs = None
            if body.logprobs is not None:
                logprobs = _completion_logprobs(llm, out, sent_logprobs, offset)
                sent_logprobs = len(out.logprobs or [])
                offset += sum(len(t) for t in logprobs.tokens)
            if not out.delta_text and not out.finished and not (logprobs and logprobs.tokens):
                continue
            choice = CompletionChoice(
                text=out.delta_text, logprobs=logprobs, finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
            )
            chunk = CompletionResponse(id=gen.id, created=created, model=config.model_name, choices=[choice])
            yield _chunk_dict(chunk, body.include_usage)
        if body.include_usage and last is not None:
            usage = CompletionResponse(
                id=gen.id, created=created, model=config.model_name, choices=[], usage=_usage(last)
            )
            yield usage.model_dump()
    finally:
        await gen.close()


async def _chat_chunks(state: _State, gen: _Generation, body: ChatCompletionRequest) -> AsyncIterator[dict]:
    config, llm = state.config, state.llm
    created = int(time.time())
    sent_logprobs = 0
    last = None

    def chunk(delta: DeltaMessage, finish_reason: str | None = None, logprobs=None) -> dict:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason, logprobs=logprobs)
        c = ChatCompletionChunk(id=gen.id, created=created, model=config.model_name, choices=[choice])
        d = _chunk_dict(c, body.include_usage)
        d["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
        return d

    try:
        yield chunk(DeltaMessage(role="assistant", content=""))
        async for out in gen.outputs():
            last = out
            logprobs = None
            if body.logprobs:
                logprobs = _chat_logprobs(llm, out, sent_logprobs)
                sent_logprobs = len(out.logprobs or [])
            if out.delta_text or (logprobs and logprobs.content):
                yield chunk(DeltaMessage(content=out.delta_text), logprobs=logprobs)
            if out.finished:
                yield chunk(DeltaMessage(), finish_reason=out.finish_reason)
        if body.include_usage and last is not None:
            usage = ChatCompletionChunk(
                id=gen.id, created=created, model=config.model_name, choices=[], usage=_usage(last)
            )
            yield usage.model_dump()
    finally:
        await gen.close()


def _chunk_dict(chunk: CompletionResponse | ChatCompletionChunk, include_usage: bool) -> dict:
    d = chunk.model_dump()
    if not include_usage:  # with include_usage every chunk has "usage": null, as OpenAI sends
        d.pop("usage")
    return d


# ---------------------------------------------------------------- admin


def _namespace_hex(state: _State, namespace: str | None) -> str | None:
    if namespace is not None:
        return namespace.lower()
    return state.manager.namespace.hex() if state.manager is not None else None


def _evict(state: _State, tiers: tuple[str, ...], namespace: str | None) -> dict[str, int]:
    """Delete ``namespace``'s blocks (default: the server's own) from ``tiers``.

    The engine's own prefix cache is not touched. A block being loaded concurrently simply
    misses (the engine recomputes it)."""
    manager = state.manager
    if manager is None:
        return {}
    target = bytes.fromhex(namespace) if namespace is not None else manager.namespace
    stores = manager.stores()
    evicted: dict[str, int] = {}
    for tier in tiers:
        store = stores.get(tier)
        if store is None:
            continue
        keys: list[BlockKey] = list(store.keys(target))
        if tier == "disk":
            evicted[tier] = store.delete_many(keys)
        else:
            evicted[tier] = sum(store.delete(key) for key in keys)
    return evicted


def _tier_report(state: _State) -> dict[str, Any]:
    s = state.llm.stats()
    engine = {
        "num_blocks": s.num_blocks,
        "num_used_blocks": s.num_used_blocks,
        "num_cached_blocks": s.num_cached_blocks,
        "kv_usage": s.kv_usage,
        "num_running": s.num_running,
        "num_waiting": s.num_waiting,
        "prefix_cache_queries": s.prefix_cache_queries,
        "prefix_cache_hits": s.prefix_cache_hits,
        "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
        "connector_hits": s.connector_hits,
        "connector_load_failures": s.connector_load_failures,
        "num_preemptions": s.num_preemptions,
        "num_prompt_tokens": s.num_prompt_tokens,
        "num_generated_tokens": s.num_generated_tokens,
        "num_finished_requests": s.num_finished_requests,
    }
    manager = state.manager
    return {
        "model": state.config.model_name,
        "namespace": manager.namespace.hex() if manager is not None else None,
        "kv_cache_dir": manager.config.kv_cache_dir if manager is not None else None,
        "kv_remote_url": (
            redact_url(manager.config.remote_url)
            if manager is not None and manager.config.remote_url is not None else None
        ),
        "tiers": manager.stats() if manager is not None else {},
        "engine": engine,
        "server": {"inflight": state.inflight, "max_inflight": state.config.max_inflight},
    }


# ---------------------------------------------------------------- errors and middleware


def _install_error_handlers(app: FastAPI) -> None:
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

    @app.exception_handler(_ClientGone)
    async def client_gone(request: Request, e: _ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; counted in the metrics

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> Response:
        logger.exception("request failed")
        return JSONResponse(error_body(f"internal error: {e!r}", "server_error"), 500)


class _HttpMiddleware:
    """Checks the API key (every path but ``OPEN_ROUTES``) and counts responses by route
    and status code."""

    def __init__(self, app: ASGIApp, *, state: _State, api_key: str | None, paths: frozenset[str]) -> None:
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
