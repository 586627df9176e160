"""``AsyncLLM``: the engine on a background thread, streaming to asyncio consumers.

The engine thread owns the :class:`~engine.llm_engine.LLMEngine` and everything in it. Other
threads talk to it only through a command queue (add, abort, stop); it answers each request
on that request's stream on its event loop, a step's outputs for one event loop in one
``loop.call_soon_threadsafe`` (one wake-up of the loop, not one per request). While no
request is unfinished the thread blocks on the command queue, so an idle engine costs
nothing, and the model forward never runs on the event loop.

A consumer that falls behind the engine (a streamed request whose event loop is busy) gets
the outputs waiting for it merged into one: the latest, with the waiting ``delta_text`` s
joined (and, for :attr:`~engine.outputs.RequestOutputKind.DELTA` outputs, their token ids,
text and logprobs joined too). Nothing is lost, and a loop that is behind builds one
response chunk for several steps instead of one per step.

A request that fails on its own (adding it, sampling or detokenizing it raised) raises
:class:`RequestFailedError` from its generator; the engine thread and the other requests
go on. Only a failed step as a whole (the model forward) stops the engine.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Sequence as Seq
from typing import Any

from engine.config import EngineConfig
from engine.connector import KVConnector
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput, RequestOutputKind
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    cache_salt: str | None
    add_special_tokens: bool
    priority: int
    loop: asyncio.AbstractEventLoop
    stream: _Stream


@dataclasses.dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclasses.dataclass(frozen=True)
class _Stop:
    pass


class _Stream:
    """A request's outputs on their way to its consumer: put on the consumer's event loop
    (by the engine thread's hand-off), read by :meth:`AsyncLLM.generate` on the same loop.
    What an ``asyncio.Queue`` did here and no more (a put per request per step when
    streaming): a future exists only while the consumer waits."""

    __slots__ = ("items", "_loop", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.items: collections.deque[RequestOutput | BaseException] = collections.deque()
        self._loop = loop
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item: RequestOutput | BaseException) -> None:
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # not cancelled
                waiter.set_result(None)

    def arrival(self) -> asyncio.Future:
        """A future that is done once the next item is put."""
        self._waiter = self._loop.create_future()
        return self._waiter


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down, or a step raised); no request can run."""


class RequestFailedError(RuntimeError):
    """The engine failed on this one request (the cause is in the log); it runs on."""


class AsyncLLM:
    """``AsyncLLM(model="tiny" | folder, **EngineConfig fields, kv_connector=None)``.

    ``generate`` streams :class:`~engine.outputs.RequestOutput` s (cumulative token ids and
    ``delta_text`` per output, or only what is new with ``output_kind=DELTA``); leaving the
    ``async for`` early, or cancelling the task consuming it, aborts the request and frees
    its blocks.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] = "tiny",
        *,
        kv_connector: KVConnector | None = None,
        **engine_config: Any,
    ) -> None:
        config = EngineConfig(model=os.fspath(model), **engine_config)
        self._start(LLMEngine(config, kv_connector=kv_connector))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> AsyncLLM:
        """Serve an existing engine; from now on only the engine thread may touch it."""
        self = cls.__new__(cls)
        self._start(engine)
        return self

    def _start(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[_Add | _Abort | _Stop] = queue.SimpleQueue()
        self._streams: dict[str, _Add] = {}  # engine thread only
        self._error: BaseException | None = None
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._stats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="tiered-kv-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def stats(self) -> EngineStats:
        """The engine's stats as of its last step (refreshed by the engine thread)."""
        return self._stats

    async def generate(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        *,
        add_special_tokens: bool = True,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request until it finishes.

        Raises ``ValueError`` for an invalid request (as :meth:`LLMEngine.add_request` does),
        :class:`RequestFailedError` when the engine fails on this request, and
        :class:`EngineDeadError` once the engine has stopped.
        """
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        stream = _Stream(loop)
        waiting = stream.items
        prompt = prompt if isinstance(prompt, str) else list(prompt)
        add = _Add(
            request_id, prompt, params or SamplingParams(), cache_salt, add_special_tokens, priority,
            loop, stream,
        )
        with self._lock:  # pairs with the drain in _run: no command is left unanswered
            if self._stopped.is_set():
                raise EngineDeadError("the engine is shut down") from self._error
            self._commands.put(add)
        finished = False
        merge = _joined if add.params.output_kind is RequestOutputKind.DELTA else _merged
        try:
            while True:
                while not waiting:
                    await stream.arrival()
                item = waiting.popleft()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                while waiting and item.finish_reason is None:  # behind: merge what waits
                    later = waiting[0]
                    if isinstance(later, BaseException) or later.finish_reason == "error":
                        break  # what came before it is yielded first
                    item = merge(item, waiting.popleft())
                finished = item.finish_reason is not None
                if item.finish_reason == "error":
                    raise RequestFailedError(f"the engine failed on request {request_id}")
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (a no-op for one that already finished). Thread-safe."""
        self._commands.put(_Abort(request_id))

    @property
    def is_running(self) -> bool:
        """Whether the engine thread still runs (until shutdown or a failed step)."""
        return self._thread.is_alive()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Abort every request (their streams end with ``finish_reason="abort"``), stop the
        engine thread and close the engine. Idempotent."""
        if self._thread.is_alive():
            self._commands.put(_Stop())
            self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the engine thread did not stop within %s s; engine left open", timeout)
            return
        self.engine.close()

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                idle = not engine.has_unfinished_requests()
                commands = [self._commands.get()] if idle else []
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                for command in commands:
                    if isinstance(command, _Stop):
                        self._abort_all()
                        return
                    self._apply(command)
                outputs = engine.step() if engine.has_unfinished_requests() else []
                # Stats first: a client that has its output and then reads /metrics must see
                # the step that produced it (e.g. the tokens its request loaded).
                self._stats = engine.stats()
                self._deliver_step(outputs)
        except Exception as e:  # a failed step leaves the engine in an unknown state
            logger.exception("the engine thread failed")
            self._error = e
            for request_id in list(self._streams):
                self._deliver(request_id, EngineDeadError(f"the engine failed: {e!r}"), True)
        finally:
            with self._lock:
                self._stopped.set()
            self._answer_leftovers()

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            output = self.engine.abort_request(command.request_id)
            if output is not None:
                self._deliver(command.request_id, output, True)
            self._streams.pop(command.request_id, None)
            return
        try:
            self.engine.add_request(
                command.prompt,
                command.params,
                request_id=command.request_id,
                cache_salt=command.cache_salt,
                add_special_tokens=command.add_special_tokens,
                priority=command.priority,
            )
        except ValueError as e:
            _send(command, e)
            return
        except Exception:
            logger.exception("adding request %s failed", command.request_id)
            _send(command, RequestFailedError(f"the engine failed on request {command.request_id}"))
            return
        self._streams[command.request_id] = command

    def _deliver(self, request_id: str, item: RequestOutput | BaseException, last: bool) -> None:
        target = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
        if target is not None and not _send(target, item) and not last:
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, in one hand-off per event loop; a request whose loop is closed
        is aborted."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Add, RequestOutput]]] = {}
        streams = self._streams
        for output in outputs:
            request_id = output.request_id
            target = streams.pop(request_id, None) if output.finished else streams.get(request_id)
            if target is not None:
                by_loop.setdefault(target.loop, []).append((target, output))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, [(target.stream, output) for target, output in items])
            except RuntimeError:  # the loop is closed: nobody reads these requests any more
                for target, output in items:
                    if not output.finished:
                        streams.pop(target.request_id, None)
                        self.engine.abort_request(target.request_id)
                self._stats = self.engine.stats()  # the aborts, before the thread may idle

    def _answer_leftovers(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                _send(command, EngineDeadError("the engine is shut down"))

    def _abort_all(self) -> None:
        for request_id in list(self._streams):
            output = self.engine.abort_request(request_id)
            if output is not None:
                self._deliver(request_id, output, True)
        self._streams.clear()


def _put_all(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, output in items:
        stream.put_nowait(output)


def _merged(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """``later`` (cumulative) with the text new since before ``earlier`` as its delta."""
    if not earlier.delta_text:
        return later
    return dataclasses.replace(later, delta_text=earlier.delta_text + later.delta_text)


def _joined(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two ``DELTA`` outputs as one: what both brought, and ``later``'s state."""
    def both(a: list | None, b: list | None) -> list | None:
        return a + b if a is not None and b is not None else b

    return dataclasses.replace(
        later,
        token_ids=earlier.token_ids + later.token_ids,
        text=earlier.text + later.text,
        delta_text=earlier.delta_text + later.delta_text,
        logprobs=both(earlier.logprobs, later.logprobs),
        top_logprobs=both(earlier.top_logprobs, later.top_logprobs),
    )


def _send(target: _Add, item: RequestOutput | BaseException) -> bool:
    """Hand ``item`` to the request's consumer; False if its event loop is closed."""
    try:
        target.loop.call_soon_threadsafe(target.stream.put_nowait, item)
    except RuntimeError:
        return False
    return True
