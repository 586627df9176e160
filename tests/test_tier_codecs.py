"""Lossy codecs in the tiers: the divergence they cause is measured, and blocks are
quantized before the CPU tier."""
from __future__ import annotations

import dataclasses
import math

import pytest

from engine import LLM, SamplingParams
from engine_testing import one_thread  # noqa: F401  (autouse fixture)
from storage.codecs import get_codec
from tiered_kv import TierConfig
from tier_testing import BLOCK, FLUSH, PROMPTS, hit_tokens, make_llm
from tier_testing import disk, reference  # noqa: F401  (fixtures)


# ---------------------------------------------------------------- lossy codecs


def _divergence(ref, got) -> tuple[int, float]:
    """First differing token position (len if none) and the largest |logprob| error over
    the whole vocabulary at the steps before it."""
    first = next((i for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)) if a != b),
                 len(ref.token_ids))
    err = 0.0
    for step in range(first + 1 if first < len(ref.token_ids) else first):
        a, b = ref.top_logprobs[step], got.top_logprobs[step]
        err = max(err, max(abs(a[t] - b[t]) for t in a))
    return first, err


@pytest.mark.parametrize("codec", ["kivi4", "kivi2"])
def test_lossy_codec_divergence_is_measured(disk, codec):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1000)
    with LLM(max_model_len=256, enable_prefix_caching=False, device="cpu") as llm:
        refs = llm.generate(PROMPTS, params)
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=0, disk_bytes=64 << 20, codec=codec)
    with make_llm(tiers, blocks=64) as llm:
        llm.generate(PROMPTS, params)
    with make_llm(tiers, blocks=64) as llm:
        outs = [llm.generate(p, params)[0] for p in PROMPTS]
        hits = llm.engine.connector.stats()["disk"]["hit_blocks"]
    assert hits == sum(hit_tokens(p) for p in PROMPTS) // BLOCK
    firsts, errors = zip(*(_divergence(r, o) for r, o in zip(refs, outs)))
    print(f"\n{codec}: first differing token per prompt {list(firsts)} of 16; "
          f"max |logprob error| before it {[round(e, 4) for e in errors]}")
    assert all(math.isfinite(e) and e < 5.0 for e in errors)
    # Lossy records live in their own namespace: a lossless configuration never sees them.
    with make_llm(dataclasses.replace(tiers, codec="raw")) as llm:
        assert llm.generate(PROMPTS[0], params)[0].num_cached_tokens == 0


@pytest.mark.parametrize("codec", ["kivi4", "kivi2+zstd"])
def test_a_lossy_codec_quantizes_blocks_before_the_cpu_tier(disk, codec):
    """With kivi4 the pool holds KIVI payloads, quantized before the copy: more blocks fit
    in the same bytes, and a CPU hit restores exactly what a disk hit after a restart does
    (the disk's records are the pool's payloads, sealed)."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=20)
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=4 << 20, disk_bytes=64 << 20, codec=codec)
    with make_llm(tiers) as llm:
        llm.generate(PROMPTS[0], params)
        llm.generate(FLUSH, params)  # the engine's blocks now hold another request
        cpu_hit = llm.generate(PROMPTS[0], params)[0]
        manager = llm.engine.connector
        kv_cache = llm.engine.model_runner.kv_cache
        block = tuple(kv_cache.shape[1:])
        slot_nbytes = manager.stores()["cpu"].slot_nbytes
        assert manager.stats()["cpu"]["hit_blocks"] == 8
    assert slot_nbytes == get_codec(codec).stage.payload_size(kv_cache.dtype, block)
    assert slot_nbytes * 2 < math.prod(block) * kv_cache.element_size()
    with make_llm(tiers) as llm:
        disk_hit = llm.generate(PROMPTS[0], params)[0]
        assert llm.engine.connector.stats()["disk"]["hit_blocks"] == 8
    assert cpu_hit.num_cached_tokens == disk_hit.num_cached_tokens == hit_tokens(PROMPTS[0])
    assert cpu_hit.token_ids == disk_hit.token_ids
    assert cpu_hit.top_logprobs == disk_hit.top_logprobs
