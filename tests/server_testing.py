"""Helpers shared by the server tests: the app in-process over httpx, OpenAI-shape checks, and
``tiered-kv serve`` as a process (:class:`ServerProcess`)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from engine import AsyncLLM
from ports import free_port  # noqa: F401  (tests import it from here)
from tiered_kv.serve_config import ServeConfig
from tiered_kv import TierConfig, TierManager
from tiered_kv.server import create_app

BLOCK = 16
MAX_MODEL_LEN = 256
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
# The environment of a ``tiered-kv serve`` child on the CPU: the server has no device flag
# and runs on the GPU wherever it sees one (device "auto"), so the tests hide the GPU from it.
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 3  # ~136 tokens: 8 full blocks


def tiered_llm(tmp_path_factory) -> Iterator[AsyncLLM]:
    """For a module's ``llm`` fixture: a tiny model on the CPU behind a CPU pool and a disk
    tier, shared by the module's server tests (each serves it through its own app: :func:`run`)."""
    manager = TierManager(
        TierConfig(kv_cache_dir=tmp_path_factory.mktemp("kv") / "cache", cpu_bytes=4 << 20, disk_bytes=64 << 20)
    )
    llm = AsyncLLM(
        "tiny", kv_connector=manager, max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64,
        block_size=BLOCK, device="cpu"
    )
    yield llm
    llm.shutdown()


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


class ServerProcess:
    """``tiered-kv serve ARGS --port P`` as a process on a free port, its output appended to
    ``log``; the constructor returns once ``/health`` answers 200. It runs on the CPU
    (:data:`CPU_ONLY`) unless ``env`` sets ``CUDA_VISIBLE_DEVICES`` (a ``cuda`` test)."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None,
                 timeout: float = 90.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        command = [sys.executable, "-c", "from tiered_kv.cli import main; main()", "serve",
                   *args, "--port", str(self.port)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", **CPU_ONLY, **(env or {})}
        with log.open("ab") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.kill()
        raise AssertionError(f"server not healthy after {timeout} s:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
