from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest
import torch

from engine import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from engine import llm_engine
from engine.async_engine import EngineDeadError, RequestFailedError, _Stream
from engine_testing import fail_detokenizing, hold_steps, one_thread  # noqa: F401  (one_thread: autouse fixture)

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
ENDLESS = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    llm = AsyncLLM(max_model_len=256, num_gpu_blocks_override=64, device="cpu")
    yield llm
    llm.shutdown()


@pytest.fixture
def fresh():
    llm = AsyncLLM(max_model_len=256, num_gpu_blocks_override=64, device="cpu")
    yield llm
    llm.shutdown()


def wait_idle(llm: AsyncLLM, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = llm.stats()
        if s.num_running == s.num_waiting == 0 and s.num_used_blocks == 0:
            return s
        time.sleep(0.01)
    raise AssertionError(f"engine still busy: {llm.stats()}")


def finishes(monkeypatch, llm: AsyncLLM) -> threading.Event:
    """An event set once a step's finished output has been handed to its event loop."""
    finished = threading.Event()
    deliver = llm._deliver_step

    def deliver_step(outputs):
        deliver(outputs)
        if any(o.finished for o in outputs):
            finished.set()

    monkeypatch.setattr(llm, "_deliver_step", deliver_step)
    return finished


async def collect(llm: AsyncLLM, prompt, params=GREEDY, **kw):
    return [out async for out in llm.generate(prompt, params, **kw)]


def test_streaming_yields_growing_outputs(llm):
    outs = asyncio.run(collect(llm, "Stream me", request_id="s1"))
    # one output a step, unless the consumer fell behind (then what waited is merged)
    lengths = [len(o.token_ids) for o in outs]
    assert lengths == sorted(set(lengths)) and lengths[0] >= 1 and lengths[-1] == 10
    assert all(o.request_id == "s1" for o in outs)
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].finish_reason == "length"
    assert "".join(o.delta_text for o in outs) == outs[-1].text
    for a, b in zip(outs, outs[1:]):
        assert b.token_ids[: len(a.token_ids)] == a.token_ids and b.text.startswith(a.text)


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_a_consumer_that_falls_behind_gets_the_waiting_outputs_merged(llm, monkeypatch, kind):
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, logprobs=1)
    offline = LLM(max_model_len=256, num_gpu_blocks_override=64, device="cpu")
    try:
        expected = offline.generate(["Fall behind"], params)[0]
    finally:
        offline.engine.close()
    release = hold_steps(monkeypatch, llm.engine, after=1)  # the first output is read alone
    finished = finishes(monkeypatch, llm)

    async def main():
        outs = []
        async for out in llm.generate("Fall behind", dataclasses.replace(params, output_kind=kind)):
            outs.append(out)
            if len(outs) == 1:
                release.set()
                assert finished.wait(30)  # the event loop is busy: the engine steps on meanwhile
        return outs

    outs = asyncio.run(main())
    assert len(outs) == 2
    assert "".join(o.delta_text for o in outs) == expected.text
    if kind is RequestOutputKind.CUMULATIVE:
        assert len(outs[1].token_ids) - len(outs[0].token_ids) > 1  # merged, not one a step
        assert outs[-1].token_ids == expected.token_ids and outs[-1].text == expected.text
        assert outs[-1].logprobs == pytest.approx(expected.logprobs)
    else:  # each output brings its own tokens: joined, they are the whole
        assert len(outs[1].token_ids) > 1
        assert [t for o in outs for t in o.token_ids] == expected.token_ids
        assert "".join(o.text for o in outs) == expected.text
        assert [lp for o in outs for lp in o.logprobs] == pytest.approx(expected.logprobs)
        assert [len(o.top_logprobs) for o in outs] == [len(o.token_ids) for o in outs]


def test_a_request_stream_keeps_what_is_put_and_outlives_a_cancelled_wait():
    """What is put while nobody waits is kept; a consumer cancelled while it waited leaves the
    stream to the next one, which the next put wakes."""
    async def main():
        stream = _Stream(asyncio.get_running_loop())
        stream.put_nowait("first")
        assert list(stream.items) == ["first"]
        stream.items.clear()
        cancelled = asyncio.ensure_future(stream.arrival())
        await asyncio.sleep(0)
        cancelled.cancel()
        stream.put_nowait("second")  # the cancelled wait is not woken (it cannot be)
        assert list(stream.items) == ["second"]
        stream.items.clear()

        async def next_item():
            while not stream.items:
                await stream.arrival()
            return stream.items.popleft()

        waiting = asyncio.ensure_future(next_item())
        await asyncio.sleep(0)
        assert not waiting.done()
        stream.put_nowait("third")
        assert await asyncio.wait_for(waiting, 5) == "third"

    asyncio.run(main())


def test_a_steps_outputs_reach_each_event_loop_in_one_hand_off(fresh, monkeypatch):
    calls = []
    real = asyncio.BaseEventLoop.call_soon_threadsafe

    def counted(loop, callback, *args, **kwargs):
        calls.append(callback)
        return real(loop, callback, *args, **kwargs)

    monkeypatch.setattr(asyncio.BaseEventLoop, "call_soon_threadsafe", counted)
    produced = []  # the engine's outputs, counted before any merging of a consumer's
    deliver = fresh._deliver_step

    def counted_step(outputs):
        produced.append(len(outputs))
        return deliver(outputs)

    monkeypatch.setattr(fresh, "_deliver_step", counted_step)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    release = hold_steps(monkeypatch, fresh.engine)  # until all six wait: they run side by side

    async def main():
        streams = asyncio.gather(*(collect(fresh, f"prompt {i}", params) for i in range(6)))
        while fresh.stats().num_waiting < 6:
            await asyncio.sleep(0.005)
        release.set()
        return await streams

    results = asyncio.run(main())
    assert all(outs[-1].finished and len(outs[-1].token_ids) == 12 for outs in results)
    # one hand-off per step that had outputs (12 steps or a few more as requests join),
    # not one per output (6 a step)
    steps = sum(1 for n in produced if n)
    assert len(calls) <= steps < sum(produced) / 2, (len(calls), produced)


def test_a_request_whose_event_loop_closed_is_aborted(fresh, monkeypatch):
    release = hold_steps(monkeypatch, fresh.engine, after=1)
    loop = asyncio.new_event_loop()
    stream = fresh.generate("Nobody reads me", ENDLESS)
    first = loop.run_until_complete(stream.__anext__())
    assert not first.finished
    loop.close()  # the consumer's loop is gone, its generator left suspended
    release.set()
    stats = wait_idle(fresh)
    assert stats.num_used_blocks == 0 and stats.num_generated_tokens < 200
    with pytest.raises(RuntimeError):
        loop.run_until_complete(stream.aclose())


def test_streams_match_offline_generation_and_run_concurrently(fresh):
    async def main():
        return await asyncio.gather(*(collect(fresh, p) for p in ("one", "two", "three")))

    results = asyncio.run(main())
    assert all(r[-1].finished for r in results)
    with LLM(max_model_len=256, num_gpu_blocks_override=64, device="cpu") as offline:
        expected = [o.token_ids for o in offline.generate(["one", "two", "three"], GREEDY)]
    assert [r[-1].token_ids for r in results] == expected


def test_abort_ends_the_stream_and_frees_blocks(fresh, monkeypatch):
    hold_steps(monkeypatch, fresh.engine, after=3)  # the request runs until the abort

    async def main():
        outs = []
        async for out in fresh.generate("abort me", ENDLESS, request_id="a1"):
            outs.append(out)
            if len(out.token_ids) == 3:
                fresh.abort("a1")
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finish_reason == "abort" and len(outs[-1].token_ids) == 3
    assert wait_idle(fresh).num_finished_requests == 1


def test_leaving_the_loop_early_aborts(fresh, monkeypatch):
    hold_steps(monkeypatch, fresh.engine, after=2)

    async def main():
        async for out in fresh.generate("break early", ENDLESS):
            if len(out.token_ids) >= 2:  # outputs merge when the consumer falls behind
                break
        await asyncio.sleep(0)  # let the abandoned generator be finalized

    asyncio.run(main())
    assert wait_idle(fresh).num_generated_tokens == 2


def test_cancelling_the_consumer_aborts(fresh, monkeypatch):
    hold_steps(monkeypatch, fresh.engine, after=1)

    async def main():
        started = asyncio.Event()

        async def consume():
            async for _ in fresh.generate("cancel me", ENDLESS):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert wait_idle(fresh).num_generated_tokens == 1


def test_invalid_requests_raise_in_the_consumer(fresh):
    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(fresh, [5] * 300)
        with pytest.raises(ValueError, match="already in use"):
            await asyncio.gather(
                collect(fresh, "x", ENDLESS, request_id="dup"),
                collect(fresh, "y", request_id="dup"),
            )

    asyncio.run(main())


def test_a_request_that_fails_in_the_engine_fails_alone(fresh, monkeypatch):
    """Detokenizing the marked request raises on its third token: it fails, the request
    running beside it and the next one do not, and the engine runs on."""
    marked = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, seed=13)
    fail_detokenizing(monkeypatch, lambda params: params == marked, at_call=3)

    async def main():
        seen = []

        async def failing():
            async for out in fresh.generate("fail me", marked):
                seen.append(out)

        both = await asyncio.gather(
            failing(), collect(fresh, "beside it", ENDLESS), return_exceptions=True
        )
        return seen, both, await collect(fresh, "after it")

    seen, (failed, beside), after = asyncio.run(main())
    # two tokens before the failure (in one output if the consumer fell behind)
    assert isinstance(failed, RequestFailedError) and len(seen[-1].token_ids) == 2
    assert beside[-1].finish_reason == "length" and len(beside[-1].token_ids) == 200
    assert after[-1].finish_reason == "length" and fresh.is_running
    assert wait_idle(fresh).num_used_blocks == 0


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_outputs_waiting_before_a_failure_are_yielded_before_it_raises(fresh, monkeypatch, kind):
    """The consumer falls behind, so the outputs before the failure and the failure wait
    together: the outputs are merged and yielded, then the failure raises."""
    marked = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, seed=14, output_kind=kind)
    fail_detokenizing(monkeypatch, lambda params: params == marked, at_call=12)

    async def consume(stall: bool):
        seen = []
        if stall:
            release = hold_steps(monkeypatch, fresh.engine, after=1)  # the first output is read alone
            finished = finishes(monkeypatch, fresh)
        with pytest.raises(RequestFailedError):
            async for out in fresh.generate("fail me later", marked):
                seen.append(out)
                if stall and len(seen) == 1:
                    release.set()
                    assert finished.wait(30)  # the rest of the outputs and the failure queue up
        return seen

    def tokens(seen):
        return seen[-1].token_ids if kind is RequestOutputKind.CUMULATIVE else [
            t for out in seen for t in out.token_ids]

    steady, stalled = asyncio.run(consume(False)), asyncio.run(consume(True))
    # the eleven tokens before the failure all reach the consumer, however far behind it was:
    # the stalled one sees the first output, then the rest merged into one
    assert len(stalled) == 2 and len(stalled[0].token_ids) == 1
    assert len(tokens(stalled)) == 11 and tokens(stalled) == tokens(steady)
    assert "".join(o.delta_text for o in stalled) == "".join(o.delta_text for o in steady)


def test_a_prompt_that_is_not_unicode_is_refused(fresh):
    async def main():
        with pytest.raises(ValueError, match="lone surrogate"):
            await collect(fresh, "bad \ud800 text")
        return await collect(fresh, "good text")

    assert asyncio.run(main())[-1].finished and fresh.is_running


def test_shutdown_aborts_streams_and_refuses_new_requests(monkeypatch):
    llm = AsyncLLM(max_model_len=256, num_gpu_blocks_override=64, device="cpu")
    hold_steps(monkeypatch, llm.engine, after=2)  # the request runs until the shutdown

    async def main():
        outs = []
        async for out in llm.generate("shutting down", ENDLESS):
            outs.append(out)
            if len(out.token_ids) == 2:
                await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
        with pytest.raises(EngineDeadError):
            await collect(llm, "too late")
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finish_reason == "abort"
    llm.shutdown()  # idempotent


def test_idle_engine_thread_blocks_instead_of_spinning(fresh):
    wait_idle(fresh)
    start = time.process_time()
    time.sleep(0.3)
    assert time.process_time() - start < 0.1


def test_each_step_runs_on_the_engines_cuda_device(monkeypatch):
    """Kernels launch on the thread's current CUDA device: with ``cuda:N`` every step (on
    the engine thread here) makes N current first, whatever thread built the engine."""
    steps = []
    use_device = llm_engine._use_device
    monkeypatch.setattr(
        llm_engine, "_use_device",
        lambda device: (steps.append((device, threading.current_thread().name)), use_device(device)),
    )
    llm = AsyncLLM(max_model_len=256, num_gpu_blocks_override=64, device="cpu")
    try:
        asyncio.run(collect(llm, "hi"))
    finally:
        llm.shutdown()
    assert ("cpu", "tiered-kv-engine") in {(d.type, t) for d, t in steps}
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    for device in ("cuda:1", "cuda", "cpu"):
        use_device(torch.device(device))
    assert calls == [torch.device("cuda:1")]
