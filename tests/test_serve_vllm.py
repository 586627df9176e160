"""``tiered-kv serve`` as a drop-in for ``vllm serve``: a vLLM command line from vLLM's docs
serves; CORS and --chat-template as vLLM has them."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import httpx
import pytest

from engine import AsyncLLM
from engine.models.tiny import tiny_model_path
from engine_testing import one_thread  # noqa: F401  (autouse fixture)
from server_testing import BLOCK, CPU_ONLY, MAX_MODEL_LEN, client
from test_server_process import free_port

ORIGIN = "https://chat.example.com"


def test_a_vllm_command_line_serves(tmp_path):
    model = str(tiny_model_path())
    port = free_port()
    log = tmp_path / "server.log"
    args = [
        sys.executable, "-c", "from tiered_kv.cli import main; main()", "serve", model,
        "--gpu-memory-utilization", "0.9", "--max-model-len", "4096", "--max-num-seqs", "64",
        "--block-size", "16", "--enable-prefix-caching",
        "--trust-remote-code", "--disable-log-requests", "--tokenizer", model,
        "--served-model-name", model, "alias", "--disable-uvicorn-access-log",
        "--port", str(port), "--kv-cache-dir", str(tmp_path / "kv"), "--kv-offloading-size", "0.01",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "0", **CPU_ONLY}
    proc = subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            deadline = time.monotonic() + 90
            while True:
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
            card, alias = http.get("/v1/models").json()["data"]
            assert (card["id"], card["max_model_len"], alias["id"]) == (model, 4096, "alias")
            reply = http.post("/v1/completions", json={
                "model": "alias", "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            })
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.terminate()
        proc.wait(60)
    text = log.read_text()
    ignored = [line for line in text.splitlines() if "ignored vLLM flags" in line]
    assert len(ignored) == 1 and "--trust-remote-code" in ignored[0] and "--disable-log-requests" in ignored[0]
    assert "POST /v1/completions" not in text  # no access log


@pytest.fixture(scope="module")
def llm():
    llm = AsyncLLM("tiny", max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=32, block_size=BLOCK, device="cpu")
    yield llm
    llm.shutdown()


def serve(llm, test, **overrides):
    async def main():
        async with client(llm, kv_offloading_size=0, kv_disk_size=0, **overrides) as c:
            return await test(c)

    return asyncio.run(main())


def test_cors_is_off_until_an_origin_is_allowed(llm):
    async def preflight(c):
        return await c.options("/v1/completions", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        })

    closed = serve(llm, preflight)
    assert "access-control-allow-origin" not in closed.headers
    opened = serve(llm, preflight, allowed_origins=(ORIGIN,), api_key="k")
    assert opened.status_code == 200  # answered before the API key is asked for
    assert opened.headers["access-control-allow-origin"] == ORIGIN

    async def models(c):
        return await c.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer k"})

    response = serve(llm, models, allowed_origins=(ORIGIN,), api_key="k", allow_credentials=True)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == ORIGIN
    assert response.headers["access-control-allow-credentials"] == "true"
    other = serve(llm, models, allowed_origins=("https://other.example",), api_key="k")
    assert "access-control-allow-origin" not in other.headers


def test_a_chat_template_replaces_the_tokenizers(llm, tmp_path):
    body = {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 1, "temperature": 0}

    async def chat(c):
        return (await c.post("/v1/chat/completions", json=body)).json()["usage"]["prompt_tokens"]

    # the tiny tokenizer is byte-level: one token per byte, and no special tokens here
    assert serve(llm, chat, chat_template="[{{ messages[0]['content'] }}]") == len("[abc]")
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    assert serve(llm, chat, chat_template=str(path)) == len("<<abc>>")
    assert serve(llm, chat) > len("abc") + 4  # the model's own template, with its special tokens
    with pytest.raises(ValueError, match="--chat-template: chat template, line 1"):
        serve(llm, chat, chat_template="{% for m in messages %}")
