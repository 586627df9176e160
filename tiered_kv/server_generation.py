"""One admitted request: its engine streams (one per choice it generates), their places in
the server, their latency metrics, and the client's connection, whose loss aborts them.

Each generation holds a place from admission until its stream is closed; at most
``max_num_seqs + max_queue_len`` are held, further requests get 429 with ``Retry-After``.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import NamedTuple, TypeVar

from fastapi import Request

from engine.async_engine import EngineDeadError, RequestFailedError
from engine.outputs import RequestOutput, RequestOutputKind
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputSpec
from tiered_kv.protocol_errors import RequestError
from tiered_kv.server_state import ServerState

RETRY_AFTER_S = 1  # what a 429 tells the client to wait
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class Generation:
    """One admitted request: its engine stream, primed with the first output, and its place
    in the server (released when the stream is closed)."""

    def __init__(
        self, state: ServerState, request_id: str, arrival: float, stream: AsyncIterator[RequestOutput],
        delta: bool = False,
    ) -> None:
        self.state = state
        self.id = request_id
        self.arrival = arrival
        self.stream = stream
        self.delta = delta  # its outputs bring only their new tokens (streamed)
        self.first: RequestOutput | None = None
        self.num_tokens = 0  # generated so far, in the outputs read
        self._last_time = arrival
        self._finished = False
        self._released = False

    async def _prime(self) -> None:
        self.first = await self._next()

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
        """Time to first token from the engine's step that gave it (a request not streamed
        gets one output, its last); each later token's share of the time since the last."""
        metrics = self.state.metrics
        now = time.perf_counter()
        total = self.num_tokens + len(out.token_ids) if self.delta else len(out.token_ids)
        new = total - self.num_tokens
        if new > 0 and self.num_tokens == 0:
            stamped = out.times.first_token if out.times is not None else None
            first = stamped if stamped is not None else now
            if metrics is not None:
                metrics.ttft.observe(max(0.0, first - self.arrival))
            self._last_time, new = first, new - 1
        if metrics is not None and new > 0:
            metrics.itl.observe(max(0.0, now - self._last_time) / new, new)
        if new > 0:
            self._last_time = now
        self.num_tokens = total
        if out.finished:
            self._finish(out.finish_reason)
            if metrics is not None:
                metrics.cached_prompt_tokens.inc(out.num_cached_tokens)
                metrics.observe_finished(out, total)

    def _finish(self, reason: str) -> None:
        self._finished = True
        metrics = self.state.metrics
        if metrics is not None:
            metrics.e2e.observe(time.perf_counter() - self.arrival)
            metrics.finished.labels(finished_reason=reason).inc()

    async def outputs(self, k: int) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``(k, output)`` for the first output, then the rest until the request finishes."""
        out = self.first
        yield k, out
        while out.finish_reason is None:
            out = await self._next()
            yield k, out

    async def close(self) -> None:
        """Abort the request if it is still running and give its place back. Idempotent."""
        if self._released:
            return
        self._released = True
        self.state.inflight -= 1
        if not self._finished and self.state.metrics is not None:
            self.state.metrics.finished.labels(finished_reason="abort").inc()
        await self.stream.aclose()


class Job(NamedTuple):
    """One generation a request asks for: a prompt and its parameters."""

    prompt_ids: list[int]
    params: SamplingParams


class Generations:
    """The generations of one request (``n`` or ``best_of`` per prompt), admitted together:
    each holds its own place in the server. ``id`` is the response's; generation ``k`` runs
    as engine request ``{id}-{k}`` (``{id}`` when it is the only one)."""

    def __init__(self, request_id: str, generations: list[Generation]) -> None:
        self.id = request_id
        self.generations = generations

    @classmethod
    async def start(
        cls,
        state: ServerState,
        request: Request,
        prefix: str,
        jobs: Sequence[Job],
        cache_salt: str | None,
        priority: int = 0,
    ) -> Generations:
        """Admit the jobs (or refuse them all with 429) and wait for the first output of
        each, so that errors the engine finds are still a plain error response."""
        arrival = time.perf_counter()
        check_generations(state, len(jobs))
        if state.inflight + len(jobs) > state.config.max_inflight:
            raise RequestError(
                f"the server is at capacity ({state.inflight} requests); retry later",
                status=429,
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        # The places are taken before anything is awaited, or requests arriving meanwhile
        # would all pass the check above; each generation gives its place back when closed.
        state.inflight += len(jobs)
        try:
            for spec in {job.params.structured_output for job in jobs} - {None}:
                await _compile_grammar(state, spec)
        except BaseException:
            state.inflight -= len(jobs)
            raise
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        generations = []
        for k, job in enumerate(jobs):
            engine_id = request_id if len(jobs) == 1 else f"{request_id}-{k}"
            stream = state.llm.generate(
                job.prompt_ids, job.params, request_id=engine_id, cache_salt=cache_salt, priority=priority
            )
            delta = job.params.output_kind is RequestOutputKind.DELTA
            generations.append(Generation(state, engine_id, arrival, stream, delta))
        group = cls(request_id, generations)
        try:
            primed = asyncio.gather(*(g._prime() for g in generations), return_exceptions=True)
            errors = [e for e in await unless_disconnected(request, primed) if e is not None]
            if errors:
                raise errors[0]
        except BaseException as e:
            refused = isinstance(e, (ValueError, RequestError))  # refused, not aborted
            for g in generations:
                g._finished = g._finished or refused
            await group.close()
            if isinstance(e, ValueError):
                raise RequestError(str(e), param=_param_of(str(e))) from None
            raise
        return group

    def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``(k, output)`` for every output of every generation, as they come (a single
        generation's own, with nothing between: a stream reads this once per output)."""
        if len(self.generations) == 1:
            return self.generations[0].outputs(0)
        return self._interleaved()

    async def _interleaved(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        arrived: asyncio.Queue[tuple[int, RequestOutput | None, Exception | None]] = asyncio.Queue()

        async def pump(k: int, generation: Generation) -> None:
            try:
                async for _, out in generation.outputs(k):
                    arrived.put_nowait((k, out, None))
            except Exception as e:
                arrived.put_nowait((k, None, e))
                return
            arrived.put_nowait((k, None, None))

        pumps = [asyncio.ensure_future(pump(k, g)) for k, g in enumerate(self.generations)]
        try:
            running = len(pumps)
            while running:
                k, out, error = await arrived.get()
                if error is not None:
                    raise error
                if out is None:
                    running -= 1
                else:
                    yield k, out
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    async def final(self, request: Request) -> list[RequestOutput]:
        """The finished output of each generation (non-streaming); aborts them all if the
        client disconnects first."""

        async def collect() -> list[RequestOutput]:
            last: list[RequestOutput | None] = [None] * len(self.generations)
            async with contextlib.aclosing(self.outputs()) as outputs:
                async for k, out in outputs:
                    last[k] = out
            return last

        try:
            return await unless_disconnected(request, collect())
        finally:
            await self.close()

    async def close(self) -> None:
        """Abort what still runs and give every place back. Idempotent."""
        for generation in self.generations:
            await generation.close()


def _param_of(message: str) -> str | None:
    """The request field an engine ``ValueError`` names first (``"min_tokens (5) must..."``,
    ``"Got priority 2 but..."``)."""
    return next((word for word in message.split(" ") if word in _REQUEST_FIELDS), None)


_REQUEST_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) | {"prompt", "priority"}


def check_generations(state: ServerState, count: int) -> None:
    """A 400 for a request that asks for more generations (prompts × ``n`` or ``best_of``)
    than the server holds at once: checked before any job is built."""
    limit = state.config.max_inflight
    if count > limit:
        raise RequestError(
            f"the request asks for {count} generations (prompts × n or best_of); "
            f"this server holds at most {limit} at once", param="n"
        )


async def _compile_grammar(state: ServerState, spec: StructuredOutputSpec) -> None:
    """Compile the request's grammar on a worker thread (a large schema takes a while), where
    the engine thread then finds it cached; a bad schema, regex or grammar is a 400."""
    try:
        await asyncio.to_thread(state.llm.engine.grammars.compile, spec)
    except ValueError as e:
        raise RequestError(str(e), param=spec.source) from None


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
