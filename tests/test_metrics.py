"""``/metrics`` as a vLLM user reads it: vLLM's names, ``model_name`` and ``engine`` labels and
histogram buckets; the tiers' own ``tiered_kv_*`` names with ``model_name``; no ``_created``
series; open without the API key; and docs/operations.md listing exactly what is exported."""
from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from engine import AsyncLLM
from engine_testing import hold_steps, one_thread  # noqa: F401  (one_thread: autouse fixture)
from metrics_testing import VLLM_BUCKETS, families, sample_names, samples, value
from server_testing import BLOCK, MAX_MODEL_LEN, client, run
from tiered_kv import TierConfig, TierManager

DOC = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
MODEL = "my-model"
KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = {"temperature": 0, "ignore_eos": True}
POOL_BLOCKS = MAX_MODEL_LEN // BLOCK  # the smallest pool: two long requests cannot both fit


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    manager = TierManager(TierConfig(
        kv_cache_dir=tmp_path_factory.mktemp("kv") / "cache", cpu_bytes=4 << 20, disk_bytes=64 << 20
    ))
    llm = AsyncLLM(
        "tiny", kv_connector=manager, max_model_len=MAX_MODEL_LEN,
        num_gpu_blocks_override=POOL_BLOCKS, block_size=BLOCK, device="cpu",
    )
    yield llm
    llm.shutdown()


async def complete(c, prompt: str, max_tokens: int):
    response = await c.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, **GREEDY}, headers=AUTH
    )
    assert response.status_code == 200, response.text
    return response


def metrics_after(llm, test) -> str:
    """The ``/metrics`` page (asked without a key) after ``test(c)`` ran on a server whose
    other routes need one."""

    async def run_then_scrape(c):
        await test(c)
        page = await c.get("/metrics")
        assert page.status_code == 200
        return page.text

    return run(llm, run_then_scrape, served_model_name=MODEL, api_key=KEY)


def test_vllm_names_carry_model_name_and_engine_labels(llm):
    text = metrics_after(llm, lambda c: complete(c, "Hello, metrics.", 8))
    for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc",
        "vllm:kv_cache_usage_perc", "vllm:cpu_prefix_cache_hit_rate", "vllm:cpu_cache_usage_perc",
        "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total",
        "vllm:gpu_prefix_cache_hits_total", "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
    ):
        assert [labels for labels, _ in samples(text, name)] == [
            {"model_name": MODEL, "engine": "0"}
        ], name
    assert value(text, "vllm:request_success_total", finished_reason="length") >= 1
    assert value(text, "vllm:generation_tokens_total") >= 8
    assert value(text, "vllm:time_to_first_token_seconds_count") >= 1
    assert value(text, "vllm:inter_token_latency_seconds_count") >= 7  # 8 tokens, 7 gaps
    assert value(text, "vllm:prompt_tokens_total") > 0
    tier_labels = {tuple(sorted(labels)) for labels, _ in samples(text, "tiered_kv_entries")}
    assert tier_labels == {("model_name", "tier")}  # ours: no vLLM engine label
    assert value(text, "tiered_kv_requests_total", route="/v1/completions", status="200") >= 1
    assert not [n for n in sample_names(text) if n.endswith("_created")]


def test_time_to_first_token_of_a_request_not_streamed_is_not_its_whole_time(llm):
    """A request that is not streamed gets only its final output from the engine; its first
    token's time comes with it, so TTFT is not the end-to-end latency."""
    before = metrics_after(llm, lambda c: asyncio.sleep(0))
    after = metrics_after(llm, lambda c: complete(c, "Time me.", 48))

    def grew(name):
        return value(after, name) - value(before, name)

    assert grew("vllm:time_to_first_token_seconds_count") == 1
    assert grew("vllm:inter_token_latency_seconds_count") == 47
    ttft, e2e = grew("vllm:time_to_first_token_seconds_sum"), grew("vllm:e2e_request_latency_seconds_sum")
    assert 0 < ttft < e2e
    assert grew("vllm:inter_token_latency_seconds_sum") > 0


def test_a_requests_phases_and_sizes_are_vllms_histograms(llm):
    """Queue, prefill, decode and inference time from the engine's stamps, and the token and
    parameter histograms, one observation per finished generation (per prompt for params)."""
    before = metrics_after(llm, lambda c: asyncio.sleep(0))
    after = metrics_after(llm, lambda c: complete(c, "Phases.", 12))

    def grew(name):
        return value(after, name) - value(before, name)

    for phase in ("queue", "prefill", "decode", "inference"):
        assert grew(f"vllm:request_{phase}_time_seconds_count") == 1, phase
    decode, inference = grew("vllm:request_decode_time_seconds_sum"), grew("vllm:request_inference_time_seconds_sum")
    assert 0 < decode < inference <= grew("vllm:e2e_request_latency_seconds_sum")
    assert grew("vllm:request_generation_tokens_sum") == 12
    assert grew("vllm:request_prompt_tokens_sum") == grew("vllm:prompt_tokens_total") > 0
    assert grew("vllm:request_params_n_sum") == 1 and grew("vllm:request_params_max_tokens_sum") == 12


def test_a_streamed_request_counts_every_token_it_was_sent(llm):
    """A stream's outputs bring only their new tokens: its token histogram, its TTFT and
    its inter-token latencies still count every token once."""
    async def stream(c):
        response = await c.post(
            "/v1/completions", headers=AUTH,
            json={"prompt": "Stream me.", "max_tokens": 20, "stream": True, **GREEDY},
        )
        assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")

    before = metrics_after(llm, lambda c: asyncio.sleep(0))
    after = metrics_after(llm, stream)

    def grew(name):
        return value(after, name) - value(before, name)

    assert grew("vllm:request_generation_tokens_sum") == 20
    assert grew("vllm:request_generation_tokens_count") == 1
    assert grew("vllm:time_to_first_token_seconds_count") == 1
    assert grew("vllm:inter_token_latency_seconds_count") == 19


def test_each_engine_step_is_one_observation_of_the_tokens_it_computed(llm):
    """A short prompt alone: one prefill step, then one step per further token; every
    admission asks the tiers, so the connector's queries are the prefix cache's."""
    before = metrics_after(llm, lambda c: asyncio.sleep(0))
    after = metrics_after(llm, lambda c: complete(c, "Steps, counted.", 6))

    def grew(name):
        return value(after, name) - value(before, name)

    assert grew("vllm:iteration_tokens_total_count") == 6
    assert grew("vllm:iteration_tokens_total_sum") == grew("vllm:prompt_tokens_total") + 5
    queries = grew("vllm:external_prefix_cache_queries_total")
    assert queries == grew("vllm:prefix_cache_queries_total") > 0


def test_the_cache_configuration_is_vllms_info_gauge(llm):
    (labels, one), = samples(metrics_after(llm, lambda c: asyncio.sleep(0)), "vllm:cache_config_info")
    assert one == 1 and labels["model_name"] == MODEL and labels["engine"] == "0"
    assert labels["block_size"] == str(llm.config.block_size)
    assert labels["num_gpu_blocks"] == str(llm.stats().num_blocks)
    assert labels["cache_dtype"] == "auto" and labels["enable_prefix_caching"] == "True"


def test_latency_histograms_use_vllms_buckets(llm):
    text = metrics_after(llm, lambda c: complete(c, "Buckets.", 4))
    for name, buckets in VLLM_BUCKETS.items():
        bounds = [float(labels["le"]) for labels, _ in samples(text, name + "_bucket")]
        assert bounds == [*buckets, float("inf")], name


def test_preemptions_are_counted(llm, monkeypatch):
    """Two requests that each need 10 of the pool's 16 blocks: one is preempted."""
    before = value(metrics_after(llm, lambda c: asyncio.sleep(0)), "vllm:num_preemptions_total")
    release = hold_steps(monkeypatch, llm.engine)  # until both wait: they run side by side

    async def crowd(c):
        both = asyncio.gather(
            complete(c, "First long story: " * 3, 100), complete(c, "Second long story: " * 3, 100)
        )
        while llm.stats().num_waiting < 2:
            await asyncio.sleep(0.005)
        release.set()
        await both

    after = value(metrics_after(llm, crowd), "vllm:num_preemptions_total")
    assert after > before


def test_cpu_prefix_cache_hit_rate_comes_from_the_cpu_tier(llm):
    """A prompt whose blocks left the GPU pool comes back from the CPU tier."""
    prompt = "A prompt that is served again after the pool forgot it. " * 2  # 7 full blocks

    async def evict_then_repeat(c):
        await complete(c, prompt, 1)
        assert await asyncio.to_thread(llm.engine.connector.flush, 30)  # the blocks are below
        await complete(c, "Another prompt that fills the whole pool. " * 5, 30)
        await complete(c, prompt, 1)

    text = metrics_after(llm, evict_then_repeat)
    hits = value(text, "tiered_kv_hit_blocks_total", tier="cpu")
    lookups = value(text, "tiered_kv_lookups_total", tier="cpu")
    assert hits > 0, text
    assert value(text, "vllm:cpu_prefix_cache_hit_rate") == pytest.approx(hits / lookups)
    assert value(text, "vllm:external_prefix_cache_hits_total") >= hits * BLOCK


def test_without_tiers_there_is_no_cpu_rate_and_the_label_stays(tmp_path):
    llm = AsyncLLM("tiny", max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=POOL_BLOCKS,
                   block_size=BLOCK, device="cpu")
    try:
        text = metrics_after(llm, lambda c: complete(c, "No tiers.", 2))
    finally:
        llm.shutdown()
    names = families(text)
    assert "vllm:cpu_prefix_cache_hit_rate" not in names and "tiered_kv_entries" not in names
    assert 0 <= value(text, "vllm:gpu_cache_usage_perc", model_name=MODEL, engine="0") <= 1


def test_two_apps_on_one_engine_export_in_turn(llm):
    """An app's shutdown takes its metrics out of the page; the next app exports its own."""

    async def twice():
        texts = []
        for name in ("first", "second"):
            async with client(llm, served_model_name=name) as c:
                texts.append((await c.get("/metrics")).text)
        return texts

    first, second = asyncio.run(twice())
    assert {labels["model_name"] for labels, _ in samples(second, "vllm:num_requests_running")} == {
        "second"
    }
    assert families(first) == families(second)


# ---------------------------------------------------------------- docs/operations.md


def documented_metrics() -> dict[str, tuple[str, set[str]]]:
    """The rows of the table under "## Metrics": name → (type, labels)."""
    section = DOC.read_text().split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"^\| `([^`]+)` \| (\w+) \| ([^|]*) \|", line)
        if match:
            name, kind, labels = match.groups()
            rows[name] = (kind, set(re.findall(r"`(\w+)`", labels)))
    return rows


def test_operations_doc_lists_every_exported_metric_with_its_type_and_labels(llm):
    async def exercise(c):
        await complete(c, "Documented metrics.", 4)
        await c.get("/nowhere")

    text = metrics_after(llm, exercise)
    documented = documented_metrics()
    assert {name: kind for name, (kind, _) in documented.items()} == families(text)
    for name, (_, labels) in documented.items():
        seen = {
            label
            for suffix in ("", "_bucket", "_count")
            for sample_labels, _ in samples(text, name + suffix)
            for label in sample_labels
            if label != "le"
        }
        if seen:  # a family without samples yet (no tier load so far) shows no labels
            assert seen == labels, name
