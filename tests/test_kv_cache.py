"""The KV cache tensor: block-major layout, per-layer views, fp8 scales."""
from __future__ import annotations

import torch

from engine.kv_cache import KVCacheSpec, fp8_scale, fp8_scales_from_cache, layer_view

SPEC = KVCacheSpec(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def test_the_cache_is_block_major_and_each_block_is_contiguous():
    cache = SPEC.allocate(5, torch.device("cpu"))
    assert cache.shape == (5, 3, 2, 4, 2, 8)  # [num_blocks, L, 2, T, H, D]
    for b in range(5):
        block = cache[b]
        assert block.is_contiguous()
        assert block.numel() * block.element_size() == SPEC.bytes_per_block
    assert cache.stride(0) == cache[0].numel()


def test_a_block_holds_the_bytes_of_the_layer_major_layout():
    # stored records keep KV_LAYOUT_VERSION 1: a block is [L, 2, T, H, D] as before
    g = torch.Generator().manual_seed(0)
    old = torch.randn(3, 2, 5, 4, 2, 8, generator=g)  # [L, 2, num_blocks, T, H, D]
    cache = old.permute(2, 0, 1, 3, 4, 5).contiguous()  # [num_blocks, L, 2, T, H, D]
    for b in range(5):
        assert torch.equal(cache[b].view(torch.uint8), old[:, :, b].contiguous().view(torch.uint8))


def test_layer_view_is_a_strided_view_into_the_cache():
    cache = SPEC.allocate(5, torch.device("cpu"))
    view = layer_view(cache, 1)
    assert view.shape == (2, 5, 4, 2, 8)  # [2, num_blocks, T, H, D]
    assert not view.is_contiguous() and view[1, 3].is_contiguous()
    assert view[1, 3].data_ptr() == cache[3, 1, 1].data_ptr()
    view[1, 3, 2] = 7.0
    assert cache[3, 1, 1, 2].eq(7).all() and int(cache.ne(0).sum()) == 2 * 8


def test_fp8_scales_are_per_layer_and_per_k_and_v():
    cache = SPEC.allocate(5, torch.device("cpu"))
    amax = [(1.0, 300.0), (0.01, 0.0), (40.0, 2.5)]  # (k, v) per layer
    for layer, (k, v) in enumerate(amax):
        cache[layer + 1, layer, 0, 3, 1, 7] = -k  # in different blocks, tokens and heads
        cache[4 - layer, layer, 1, 0, 0, 0] = v
    scales = fp8_scales_from_cache(cache)
    assert [(s.k, s.v) for s in scales] == [(fp8_scale(k), fp8_scale(v)) for k, v in amax]
