"""The torch path of paged attention on a layer's strided view of a block-major cache."""
from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionMetadata, KVScales, attention_torch, write_kv
from engine.kv_cache import layer_view

NUM_BLOCKS, LAYERS, T, H, D = 6, 3, 4, 2, 8


def _meta(tables: list[list[int]], seq_lens: list[int], query_lens: list[int]) -> AttentionMetadata:
    slots = [
        table[p // T] * T + p % T
        for table, s, q in zip(tables, seq_lens, query_lens)
        for p in range(s - q, s)
    ]
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]).int(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        seq_lens_cpu=seq_lens,
        query_lens_cpu=query_lens,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=str)
def test_write_kv_writes_through_a_strided_layer_view(dtype):
    g = torch.Generator().manual_seed(0)
    cache = torch.zeros(NUM_BLOCKS, LAYERS, 2, T, H, D, dtype=dtype)  # [B, L, 2, T, H, D]
    k, v = torch.rand(3, H, D, generator=g) + 1, torch.rand(3, H, D, generator=g) + 1
    slots = [5, 22, 0]
    scales = KVScales(0.5, 2.0) if dtype != torch.float32 else KVScales()
    write_kv(k, v, layer_view(cache, 1), torch.tensor(slots), scales)
    for i, slot in enumerate(slots):
        block = cache[slot // T].float()  # [L, 2, T, H, D]
        assert torch.equal(block[1, 0, slot % T], (k[i] / scales.k).to(dtype).float())
        assert torch.equal(block[1, 1, slot % T], (v[i] / scales.v).to(dtype).float())
    assert int(cache.float().ne(0).sum()) == 2 * len(slots) * H * D  # nothing else written


@pytest.mark.parametrize(
    "seq_lens, query_lens",
    [([7, 13], [7, 13]), ([9, 14], [3, 5]), ([5, 11, 2], [1, 1, 1])],
    ids=["prefill", "prefix", "decode"],
)
def test_attention_reads_a_strided_layer_view_like_a_contiguous_one(seq_lens, query_lens):
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(NUM_BLOCKS, LAYERS, 2, T, H, D, generator=g)
    tables = [[4, 1, 3, 5], [0, 2, 5, 4], [3, 0, 1, 2]][: len(seq_lens)]
    meta = _meta(tables, seq_lens, query_lens)
    q = torch.randn(sum(query_lens), 2 * H, D, generator=g)
    view = layer_view(cache, 2)
    out = attention_torch(q, view, meta, D**-0.5)
    assert torch.equal(out, attention_torch(q, view.contiguous(), meta, D**-0.5))
    assert not torch.equal(out, attention_torch(q, layer_view(cache, 0), meta, D**-0.5))
