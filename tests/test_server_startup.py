"""What ``tiered-kv serve`` logs when it starts: the model, dtype, device, KV pool, tiers
(the disk tier with what it already holds, the remote URL without its password), the
start-up time, and ``serving`` once requests are accepted. Checked in a real server
process's output, with vLLM-style flags; the same server's ``/metrics`` (no key) shows
vLLM's names labelled with the served model's name."""
from __future__ import annotations

import re

import httpx
import pytest
import torch

from metrics_testing import samples
from engine import SamplingParams
from server_testing import ServerProcess, free_port
from tiered_kv import TierConfig, build_llm
from tiered_kv.server_startup import device_description

KEY = "k3y"
PASSWORD = "pa55-w0rd-in-the-url"
SECRET = "a shared secret of at least thirty-two bytes"
PROMPT = "A document that the disk tier keeps across restarts. " * 2  # 6 full blocks


def vllm_style_args(cache_dir, remote_url: str) -> list[str]:
    return [
        "--model", "tiny", "--served-model-name", "my-model", "--max-model-len", "512",
        "--block-size", "16", "--max-num-seqs", "8", "--num-gpu-blocks-override", "64",
        "--enable-prefix-caching", "--api-key", KEY,
        "--kv-cache-dir", str(cache_dir), "--kv-offloading-size", "0.01", "--kv-disk-size", "0.25",
        "--kv-remote-url", remote_url,
    ]


def complete(server: ServerProcess) -> None:
    response = httpx.post(
        server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
        json={"model": "my-model", "prompt": PROMPT, "max_tokens": 4, "temperature": 0},
    )
    assert response.status_code == 200, response.text


def test_start_up_log_and_vllm_metrics_of_a_server_process(tmp_path):
    cache_dir = tmp_path / "kv_cache"
    remote_port = free_port()  # nothing listens there: the remote tier misses, the server serves
    remote_url = f"redis://:{PASSWORD}@127.0.0.1:{remote_port}/0"
    args = vllm_style_args(cache_dir, remote_url)
    env = {"TIERED_KV_SECRET": SECRET}

    with build_llm("tiny", TierConfig(kv_cache_dir=cache_dir, cpu_bytes=0), max_model_len=512,
                   block_size=16, device="cpu") as llm:  # closing flushes the blocks to disk
        llm.generate([PROMPT], SamplingParams(max_tokens=1))
    server = ServerProcess(args, tmp_path / "server.log", env)
    try:
        complete(server)
        page = httpx.get(server.url + "/metrics", timeout=30)  # no key
        assert server.stop() == 0
    finally:
        server.kill()

    assert page.status_code == 200
    for name in ("vllm:gpu_cache_usage_perc", "vllm:cpu_prefix_cache_hit_rate",
                 "vllm:num_preemptions_total", "vllm:num_requests_running",
                 "vllm:prefix_cache_queries_total"):
        assert [labels for labels, _ in samples(page.text, name)] == [
            {"model_name": "my-model", "engine": "0"}
        ], name
    (success,) = samples(page.text, "vllm:request_success_total")
    assert success == ({"model_name": "my-model", "engine": "0", "finished_reason": "length"}, 1.0)

    log = server.output()
    assert "model: tiny (served as 'my-model'), dtype float32, KV cache dtype float32" in log
    assert "device: cpu" in log
    assert "KV pool: 64 blocks of 16 tokens (1024 tokens), 1.0 MiB" in log
    tiers = re.search(
        rf"tiers: cpu 10\.2 MiB; disk {re.escape(str(cache_dir))} \((\d+) entries, ([\d.]+ \w+) "
        r"already there, budget 256\.0 MiB, codec raw\); "
        rf"remote redis://:\*\*\*@127\.0\.0\.1:{remote_port}/0$",
        log, re.M,
    )
    assert tiers is not None, log
    assert int(tiers.group(1)) >= 6 and tiers.group(2) != "0 B"
    assert re.search(r"started in \d+\.\d s$", log, re.M)
    serving = log.index(f"serving 'my-model' on http://127.0.0.1:{server.port}")
    assert serving > log.index("Application startup complete")
    assert PASSWORD not in log


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_device_line_names_the_gpu():
    description = device_description(torch.device("cuda"))
    assert description.startswith("cuda:") and torch.cuda.get_device_name() in description
