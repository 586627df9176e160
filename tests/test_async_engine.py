from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from engine import LLM, AsyncLLM, SamplingParams
from engine import llm_engine
from engine.async_engine import EngineDeadError, RequestFailedError
from engine.output_processor import OutputProcessor
from engine_testing import one_thread  # noqa: F401  (autouse fixture)

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


async def collect(llm: AsyncLLM, prompt, params=GREEDY, **kw):
    return [out async for out in llm.generate(prompt, params, **kw)]


def test_streaming_yields_growing_outputs(llm):
    outs = asyncio.run(collect(llm, "Stream me", request_id="s1"))
    assert [len(o.token_ids) for o in outs] == list(range(1, 11))
    assert all(o.request_id == "s1" for o in outs)
    assert [o.finished for o in outs] == [False] * 9 + [True]
    assert outs[-1].finish_reason == "length"
    assert "".join(o.delta_text for o in outs) == outs[-1].text
    for a, b in zip(outs, outs[1:]):
        assert b.token_ids[: len(a.token_ids)] == a.token_ids and b.text.startswith(a.text)


def test_streams_match_offline_generation_and_run_concurrently(fresh):
    async def main():
        return await asyncio.gather(*(collect(fresh, p) for p in ("one", "two", "three")))

    results = asyncio.run(main())
    assert all(r[-1].finished for r in results)
    with LLM(max_model_len=256, num_gpu_blocks_override=64, device="cpu") as offline:
        expected = [o.token_ids for o in offline.generate(["one", "two", "three"], GREEDY)]
    assert [r[-1].token_ids for r in results] == expected


def test_abort_ends_the_stream_and_frees_blocks(fresh):
    async def main():
        outs = []
        async for out in fresh.generate("abort me", ENDLESS, request_id="a1"):
            outs.append(out)
            if len(outs) == 3:
                fresh.abort("a1")
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finish_reason == "abort" and 3 <= len(outs[-1].token_ids) < 200
    assert wait_idle(fresh).num_finished_requests == 1


def test_leaving_the_loop_early_aborts(fresh):
    async def main():
        async for out in fresh.generate("break early", ENDLESS):
            if len(out.token_ids) == 2:
                break
        await asyncio.sleep(0)  # let the abandoned generator be finalized

    asyncio.run(main())
    stats = wait_idle(fresh)
    assert stats.num_generated_tokens < 200


def test_cancelling_the_consumer_aborts(fresh):
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
    assert wait_idle(fresh).num_generated_tokens < 200


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
    real = OutputProcessor._detokenizer

    def detokenizer(self, prompt_token_ids, params):
        detokenizer = real(self, prompt_token_ids, params)
        if params == marked:
            add, count = detokenizer.add, [0]

            def failing_add(token_id):
                count[0] += 1
                if count[0] == 3:
                    raise RuntimeError("detokenizer broke")
                return add(token_id)

            detokenizer.add = failing_add
        return detokenizer

    monkeypatch.setattr(OutputProcessor, "_detokenizer", detokenizer)

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
    assert isinstance(failed, RequestFailedError) and len(seen) == 2
    assert beside[-1].finish_reason == "length" and len(beside[-1].token_ids) == 200
    assert after[-1].finish_reason == "length" and fresh.is_running
    assert wait_idle(fresh).num_used_blocks == 0


def test_a_prompt_that_is_not_unicode_is_refused(fresh):
    async def main():
        with pytest.raises(ValueError, match="lone surrogate"):
            await collect(fresh, "bad \ud800 text")
        return await collect(fresh, "good text")

    assert asyncio.run(main())[-1].finished and fresh.is_running


def test_shutdown_aborts_streams_and_refuses_new_requests():
    llm = AsyncLLM(max_model_len=256, num_gpu_blocks_override=64, device="cpu")

    async def main():
        outs = []
        async for out in llm.generate("shutting down", ENDLESS):
            outs.append(out)
            if len(outs) == 2:
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
