"""``tiered-kv serve`` as a process, driven by the official ``openai`` client: completions,
chat, streaming, a client that disconnects mid-stream, SIGTERM, and a restart that serves
an earlier prompt's KV from the disk tier; two servers sharing a prefix through the remote
tier."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from server_testing import CPU_ONLY, ServerProcess, free_port

API_KEY = "test-key"
ADMIN_KEY = "test-admin-key"
# ~330 tokens with the byte-level tiny tokenizer: 20 full blocks of 16
LONG_PROMPT = "A long document about persistent KV caches, repeated to fill many blocks. " * 4
GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


class Server(ServerProcess):
    """A server with both keys, a small disk tier in ``cache_dir`` and clients for the API
    (``http``, ``client``) and the admin routes (``admin``)."""

    def __init__(
        self, cache_dir: Path, log: Path, extra: tuple[str, ...] = (), env: dict | None = None
    ) -> None:
        super().__init__([
            "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY, "--kv-cache-dir", str(cache_dir),
            "--max-model-len", "512", "--num-gpu-blocks-override", "96",
            "--kv-offloading-size", "0.01", "--kv-disk-size", "0.25", "--log-level", "warning",
            *extra,
        ], log, env)
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
        self.admin = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30
        )
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0)

    def tiers(self) -> dict:
        return self.admin.get("/admin/tiers").json()

    def terminate(self, timeout: float = 60.0) -> int:
        self.http.close()
        self.admin.close()
        self.client.close()
        return self.stop(timeout)


@pytest.fixture
def servers(tmp_path):
    started: list[Server] = []

    def start(cache: str = "kv_cache", extra: tuple[str, ...] = (), env: dict | None = None) -> Server:
        server = Server(tmp_path / cache, tmp_path / f"{cache}.log", extra, env)
        started.append(server)
        return server

    yield start
    for server in started:
        server.kill()


def wait_for(predicate, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_openai_client_sigterm_and_restart_from_disk(servers):
    server = servers()
    client = server.client

    first = client.completions.create(model="tiny", prompt=LONG_PROMPT, **GREEDY)
    text = first.choices[0].text
    assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens == 12
    prompt_tokens = first.usage.prompt_tokens
    assert prompt_tokens > 8 * 16

    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], **GREEDY
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 12

    pieces, usage = [], None
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], stream=True,
        stream_options={"include_usage": True}, **GREEDY,
    )
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == chat.choices[0].message.content
    assert usage.completion_tokens == 12 and usage.prompt_tokens_details.cached_tokens == 0  # < 1 block

    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model="tiny", prompt=LONG_PROMPT, stream=True, **GREEDY)
    )
    assert streamed == text

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()

    # A client that disconnects mid-stream: the request is aborted and its blocks freed.
    body = {"model": "tiny", "prompt": "Endless", "max_tokens": 480, "stream": True, "ignore_eos": True}
    with server.http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    idle = wait_for(
        lambda: (t := server.tiers())["engine"]["num_running"] == 0 and t["server"]["inflight"] == 0 and t,
        what="the aborted request to leave the engine",
    )
    assert idle["engine"]["num_used_blocks"] == 0
    assert idle["engine"]["num_generated_tokens"] < 4 * 12 + 480
    metrics = server.http.get("/metrics").text
    assert 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"} 1.0' in metrics

    assert server.terminate() == 0

    restarted = servers()
    before = restarted.tiers()
    assert before["tiers"]["disk"]["entries"] >= prompt_tokens // 16 - 1  # flushed at shutdown
    again = restarted.client.completions.create(model="tiny", prompt=LONG_PROMPT, **GREEDY)
    assert again.choices[0].text == text
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= (prompt_tokens // 16 - 1) * 16
    assert restarted.tiers()["tiers"]["disk"]["hit_blocks"] > 0
    assert restarted.terminate() == 0


def test_two_servers_share_a_prefix_through_the_remote_tier(servers, redis_server, tmp_path):
    remote = ("--kv-remote-url", redis_server.url, "--kv-remote-timeout", "1")
    secret = "the deployment's secret: " + "5f" * 16
    secret_file = tmp_path / "kv_secret"
    secret_file.write_text(secret + "\n")
    secret_file.chmod(0o600)
    a = servers("kv_a", remote, {"TIERED_KV_KV_SECRET_FILE": str(secret_file)})
    first = a.client.completions.create(model="tiny", prompt=LONG_PROMPT + "shared", **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert a.admin.post("/admin/flush", json={"timeout": 30}).json()["flushed"]
    b = servers("kv_b", remote, {"TIERED_KV_SECRET": secret})  # its own, empty CPU pool and disk
    again = b.client.completions.create(model="tiny", prompt=LONG_PROMPT + "shared", **GREEDY)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens >= 16 * 16
    tiers = b.tiers()
    assert tiers["tiers"]["remote"]["hit_blocks"] >= 16
    assert tiers["kv_remote_url"] == redis_server.url


def test_a_remote_tier_without_a_secret_is_one_line_and_exit_two(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERED_KV_")}
    done = subprocess.run(
        [sys.executable, "-c", "from tiered_kv.cli import main; main()", "serve",
         "--port", str(free_port()), "--kv-cache-dir", str(tmp_path / "kv"),
         "--kv-remote-url", "redis://127.0.0.1:1/0", "--max-model-len", "256"],
        capture_output=True, text=True, env=env | {"OMP_NUM_THREADS": "1", **CPU_ONLY}, timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "TIERED_KV_SECRET" in done.stderr and "Traceback" not in done.stderr
