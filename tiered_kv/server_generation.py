"""One admitted request: its engine stream, its place in the server, its latency metrics, and
the client's connection, whose loss aborts it.

A request holds a place from admission until its stream is closed; at most
``max_num_seqs + max_queue_len`` are held, further ones get 429 with ``Retry-After``.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request

from engine.async_engine import EngineDeadError, RequestFailedError
from engine.outputs import RequestOutput
from engine.sampler import SamplingParams
from tiered_kv.protocol import RequestError
from tiered_kv.server_state import ServerState

RETRY_AFTER_S = 1  # what a 429 tells the client to wait
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class Generation:
    """One admitted request: its engine stream, primed with the first output, and its place
    in the server (released when the stream is closed)."""

    def __init__(
        self, state: ServerState, request_id: str, arrival: float, stream: AsyncIterator[RequestOutput]
    ) -> None:
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
        state: ServerState,
        request: Request,
        prefix: str,
        prompt_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None,
    ) -> Generation:
        """Admit the request (or refuse it with 429) and wait for its first output, so that
        errors the engine finds are still a plain error response."""
        arrival = time.perf_counter()
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
            gen.first = await unless_disconnected(request, gen._next())
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
        except RequestFailedError as e:
            self._finish("error")
            message = f"{e} (the cause is in the server's log)"
            raise RequestError(message, status=500, type="server_error") from None
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
        if out.finished:
            self._finish(out.finish_reason)
            if metrics is not None:
                metrics.cached_prompt_tokens.inc(out.num_cached_tokens)

    def _finish(self, reason: str) -> None:
        self._finished = True
        metrics = self.state.metrics
        if metrics is not None:
            metrics.e2e.observe(time.perf_counter() - self.arrival)
            metrics.finished.labels(finish_reason=reason).inc()

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
            return await unless_disconnected(request, collect())
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


async def unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
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
        raise ClientGone
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
