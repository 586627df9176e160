"""The request ``priority`` over HTTP: refused unless the engine schedules by priority, and
then a request of a lower value overtakes the queue."""
from __future__ import annotations

import asyncio

import pytest

from engine import AsyncLLM
from engine_testing import hold_steps, one_thread  # noqa: F401  (one_thread: autouse fixture)
from server_testing import BLOCK, MAX_MODEL_LEN, assert_error, run

SHORT = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}


def async_llm(**config) -> AsyncLLM:
    return AsyncLLM(
        "tiny", max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64, block_size=BLOCK,
        device="cpu", **config,
    )


@pytest.fixture(scope="module")
def fcfs():
    llm = async_llm()
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def by_priority():
    llm = async_llm(scheduling_policy="priority", max_num_seqs=1)
    yield llm
    llm.shutdown()


def test_fcfs_refuses_a_priority_with_400(fcfs):
    async def test(c):
        ranked = await c.post("/v1/completions", json={"prompt": "Hi", "priority": 2, **SHORT})
        chat = await c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "priority": -1, **SHORT},
        )
        zero = await c.post("/v1/completions", json={"prompt": "Hi", "priority": 0, **SHORT})
        not_int = await c.post("/v1/completions", json={"prompt": "Hi", "priority": "high", **SHORT})
        return ranked, chat, zero, not_int

    ranked, chat, zero, not_int = run(fcfs, test)
    assert_error(ranked, 400, param="priority")
    assert "Priority scheduling is not enabled" in ranked.json()["error"]["message"]
    assert_error(chat, 400, param="priority")
    assert zero.status_code == 200, zero.text
    assert_error(not_int, 400, param="priority")


def test_a_higher_priority_request_overtakes_the_queue(by_priority, monkeypatch):
    llm = by_priority
    finished: list[str] = []
    release = hold_steps(monkeypatch, llm.engine, after=1)  # the long request runs until all wait

    async def until(condition) -> None:
        while not condition(llm.stats()):
            await asyncio.sleep(0.005)

    async def test(c):
        async def send(name: str, priority: int, max_tokens: int = 4, path="/v1/completions"):
            body = {**SHORT, "max_tokens": max_tokens, "priority": priority}
            if path == "/v1/completions":
                body["prompt"] = f"Request {name}"
            else:
                body["messages"] = [{"role": "user", "content": f"Request {name}"}]
            response = await c.post(path, json=body)
            assert response.status_code == 200, response.text
            finished.append(name)

        tasks = [asyncio.create_task(send("running", 0, max_tokens=200))]
        await until(lambda s: s.num_running == 1)
        for waiting, name in enumerate(("queued-1", "queued-2"), start=1):
            tasks.append(asyncio.create_task(send(name, 5)))
            # Prompts are tokenized off the event loop: wait for each to arrive in turn.
            await until(lambda s, n=waiting: s.num_waiting == n)
        tasks.append(asyncio.create_task(send("urgent", -1, path="/v1/chat/completions")))
        await until(lambda s: s.num_waiting == 3)
        assert finished == []  # the long request still runs: the three wait behind it
        release.set()
        await asyncio.gather(*tasks)

    run(llm, test)
    assert finished == ["running", "urgent", "queued-1", "queued-2"]
