"""Helpers shared by the server tests: the app in-process over httpx, and OpenAI-shape checks."""
from __future__ import annotations

import asyncio
import contextlib
import json

import httpx

from tiered_kv.serve_config import ServeConfig
from tiered_kv.server import create_app

BLOCK = 16
MAX_MODEL_LEN = 256
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


def config(**overrides) -> ServeConfig:
    return ServeConfig(max_model_len=MAX_MODEL_LEN, block_size=BLOCK, **overrides)


ADMIN_KEY = "adm1n"
ADMIN = {"admin_api_key": ADMIN_KEY, "headers": {"Authorization": f"Bearer {ADMIN_KEY}"}}


@contextlib.asynccontextmanager
async def client(llm, headers: dict | None = None, **overrides):
    """The app over httpx; ``headers`` go with every request (``**ADMIN``: the admin key)."""
    app = create_app(config(**overrides), llm)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://test", timeout=60, headers=headers
        ) as c:
            c.app = app
            yield c


def run(llm, test, **overrides):
    async def main():
        async with client(llm, **overrides) as c:
            return await test(c)

    return asyncio.run(main())


async def post_json(c: httpx.AsyncClient, path: str, body: dict) -> httpx.Response:
    """POST ``body`` as ASCII JSON, so that lone surrogates travel as ``\\ud800`` escapes."""
    return await c.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def sse_events(text: str) -> list:
    assert text.endswith("data: [DONE]\n\n")
    events = text.split("\n\n")
    assert events[-1] == ""
    payloads = [e.removeprefix("data: ") for e in events[:-1]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
