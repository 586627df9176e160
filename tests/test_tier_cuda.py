"""The tier manager on CUDA: DMA offloads and restores, KIVI quantized on the GPU, a failing
offload, a pool too large to pin, and closing gives the memory back."""
from __future__ import annotations


import pytest
import torch

from engine import LLM
from engine_testing import one_thread  # noqa: F401  (autouse fixture)
from storage.codecs.kivi import KiviCodec
from tiered_kv import TierConfig, TierManager, build_llm
from tier_testing import BLOCK, FLUSH, GREEDY, PROMPTS, assert_all_dropped, hit_tokens, make_llm
from tier_testing import disk, reference  # noqa: F401  (fixtures)


# ---------------------------------------------------------------- on CUDA

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def cuda_llm(tiers: TierConfig | None, **engine) -> LLM:
    """:func:`make_llm` on the GPU (``None``: no tiers)."""
    kwargs = dict(device="cuda", max_model_len=256, num_gpu_blocks_override=16, **engine)
    return LLM("tiny", **kwargs) if tiers is None else build_llm("tiny", tiers, **kwargs)


@pytest.mark.cuda
@needs_cuda
def test_cuda_restores_generate_what_the_engines_own_prefix_hit_does(disk):
    """Blocks offloaded by DMA on the side stream come back from the CPU pool, and from disk
    in a new engine, as the KV the engine computed: a hit generates the tokens of the
    engine's own prefix-cache hit (the same computation on the same KV)."""
    with cuda_llm(None) as llm:
        cold = llm.generate(PROMPTS[0], GREEDY)[0]
        gpu_hit = llm.generate(PROMPTS[0], GREEDY)[0]
    assert gpu_hit.num_cached_tokens == hit_tokens(PROMPTS[0])
    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=4 << 20, disk_bytes=64 << 20)
    with cuda_llm(tiers) as llm:
        first = llm.generate(PROMPTS[0], GREEDY)[0]
        llm.generate(FLUSH, GREEDY)  # takes every block of the engine's pool
        cpu_hit = llm.generate(PROMPTS[0], GREEDY)[0]
        assert llm.engine.connector.stats()["cpu"]["hit_blocks"] == 8
    with cuda_llm(tiers) as llm:
        disk_hit = llm.generate(PROMPTS[0], GREEDY)[0]
        stats = llm.engine.connector.stats()["disk"]
    assert first.token_ids == cold.token_ids
    assert cpu_hit.token_ids == disk_hit.token_ids == gpu_hit.token_ids
    assert cpu_hit.num_cached_tokens == disk_hit.num_cached_tokens == hit_tokens(PROMPTS[0])
    assert stats["hit_blocks"] == 8 and stats["corrupt"] == stats["load_failures"] == 0


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("codec", ["kivi4", "kivi2"])
def test_cuda_kivi_blocks_are_quantized_on_the_gpu_and_restored(codec):
    with cuda_llm(TierConfig(cpu_bytes=4 << 20, codec=codec)) as llm:
        llm.generate(PROMPTS[0], GREEDY)
        llm.generate(FLUSH, GREEDY)
        cpu_hit = llm.generate(PROMPTS[0], GREEDY)[0]
        stats = llm.engine.connector.stats()["cpu"]
    assert cpu_hit.num_cached_tokens == hit_tokens(PROMPTS[0])
    assert stats["hit_blocks"] == 8 and stats["load_failures"] == 0


@pytest.mark.cuda
@needs_cuda
def test_cuda_an_offload_that_fails_when_queued_drops_its_blocks(monkeypatch):
    """On CUDA a KIVI offload is queued by the engine thread, so a failing kernel raises
    there, not on a thread: its blocks are dropped all the same (slots given back, GPU blocks
    released once) and the engine serves on."""
    with cuda_llm(None) as llm:
        expected = [llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS[:2]]

    def broken(self, blocks, out):
        raise RuntimeError("device error")

    with cuda_llm(TierConfig(cpu_bytes=4 << 20, codec="kivi4")) as llm:
        # broken after start-up, whose warm-up ran the kernels once
        monkeypatch.setattr(KiviCodec, "encode_blocks", broken)
        out = llm.generate(PROMPTS[0], GREEDY)[0]
        assert_all_dropped(llm.engine.connector, 8)
        assert [out.token_ids, llm.generate(PROMPTS[1], GREEDY)[0].token_ids] == expected


@pytest.mark.cuda
@needs_cuda
def test_cuda_a_pool_larger_than_the_host_can_pin_is_refused_naming_its_setting():
    manager = TierManager(TierConfig(cpu_bytes=1 << 50))
    kv_cache = torch.zeros(4, 1, 2, BLOCK, 1, 8, device="cuda")  # [blocks, L, 2, T, H, D]
    with pytest.raises(ValueError, match=r"cpu_bytes=\d+: cannot pin .*; lower it"):
        manager.register_kv_cache(kv_cache, bytes(32), BLOCK)
    manager.close()


@pytest.mark.parametrize("codec", ["raw", "kivi4"])
def test_closing_gives_back_the_kv_cache_and_the_pool_while_the_llm_lives_on(disk, codec):
    """The KV cache and the CPU pool's slab (pinned memory on a GPU host) are freed by close,
    not only when the last reference to the LLM goes."""
    import gc
    import weakref

    tiers = TierConfig(kv_cache_dir=disk, cpu_bytes=4 << 20, disk_bytes=64 << 20, codec=codec)
    llm = make_llm(tiers)
    llm.generate(PROMPTS[:1], GREEDY)
    cache = weakref.ref(llm.engine.model_runner.kv_cache)
    slab = weakref.ref(llm.engine.connector._stores.pool.slab)
    llm.close()
    gc.collect()
    assert cache() is None and slab() is None
    assert llm.engine.connector.stats() is not None  # still answers after close
