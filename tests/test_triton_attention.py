"""The Triton paged-attention kernels against the torch path of engine/attention.py.

Every cache is block-major with several layers and the kernels get one layer's strided view
(:func:`engine.kv_cache.layer_view`), as in the engine; a write must leave the other
layers' bytes alone.

Triton reads TRITON_INTERPRET when it is imported, so the CPU checks run in a subprocess
with the variable set (:func:`interpreter_main`); this module never imports triton at
import time and works in any test order. The same checks run on the GPU in-process when
CUDA is there.
"""
from __future__ import annotations

import dataclasses
import json
import zlib

import pytest
import torch

from engine.attention import AttentionMetadata, KVScales, attention_torch, first_visible, write_kv
from engine.kv_cache import layer_view
from interpreter_testing import interpreter_main_of, run_interpreted, value_errors

E4M3 = "float8_e4m3fn"
E5M2 = "float8_e5m2"
LAYERS, LAYER = 3, 1  # caches have LAYERS layers; the kernels use the view of LAYER


@dataclasses.dataclass(frozen=True)
class WriteCase:
    name: str
    src: str  # dtype of k and v
    cache: str  # cache dtype
    shape: tuple[int, int, int]  # [N, H, D]; "edges" sets N to fit its values
    scales: tuple[float, float] = (1.0, 1.0)
    strided: bool = False  # k and v are slices of one fused tensor
    values: str = "random"  # "random" or "edges": every fp8 value, ties, near-ties, inf, nan


WRITE_CASES = [
    WriteCase("fp16", "float16", "float16", (13, 2, 64)),
    WriteCase("bf16-strided", "bfloat16", "bfloat16", (9, 4, 16), strided=True),
    WriteCase("fp32-d24", "float32", "float32", (7, 3, 24)),
    WriteCase("fp32-e4m3", "float32", E4M3, (16, 2, 32), (0.37, 1.9)),
    WriteCase("fp16-e4m3", "float16", E4M3, (11, 2, 64), (0.021, 0.5)),
    WriteCase("bf16-e4m3-strided", "bfloat16", E4M3, (8, 3, 16), (3.3, 0.07), strided=True),
    WriteCase("fp32-e5m2", "float32", E5M2, (16, 2, 32), (0.37, 1.9)),
    WriteCase("bf16-e5m2", "bfloat16", E5M2, (8, 2, 16), (0.013, 1.0)),
    WriteCase("edges-e4m3", "float32", E4M3, (0, 2, 16), values="edges"),
    WriteCase("edges-e5m2", "float32", E5M2, (0, 2, 16), values="edges"),
]


@dataclasses.dataclass(frozen=True)
class AttnCase:
    name: str
    dtype: str  # q's dtype
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    heads: tuple[int, int]  # (Hq, Hkv)
    head_dim: int
    block_size: int
    cache: str | None = None  # None: q's dtype
    num_splits: int | None = None
    window: int | None = None  # blocks wholly before a sequence's window hold NaN
    softcap: float | None = None

    @property
    def tol(self) -> float:
        return {"float32": 1e-4, "float16": 2e-3, "bfloat16": 2e-2}[self.dtype]


def _decode(name, dtype, seq_lens, heads, d, bs, **kw) -> AttnCase:
    return AttnCase(name, dtype, seq_lens, (1,) * len(seq_lens), heads, d, bs, **kw)


ATTN_CASES = [
    _decode("decode-fp32-g2-d64", "float32", (1, 17, 33, 64), (4, 2), 64, 16),
    # splits of 64 keys: 3 full ones, a short third one, and empty ones
    _decode("decode-fp32-g4-d16-bs32-split3", "float32", (5, 192, 47, 150), (8, 2), 16, 32,
            num_splits=3),
    _decode("decode-fp16-g1-d128", "float16", (30, 16, 1), (2, 2), 128, 16),
    _decode("decode-bf16-g4-d64-bs8-split2", "bfloat16", (40, 9), (4, 1), 64, 8, num_splits=2),
    _decode("decode-fp32-e4m3-split2", "float32", (70, 3), (4, 2), 64, 16, cache=E4M3,
            num_splits=2),
    _decode("decode-fp32-d24", "float32", (19, 40), (2, 1), 24, 16),
    _decode("decode-fp16-d256-bs64", "float16", (70, 5), (2, 1), 256, 64),  # key tile < block
    AttnCase("prefill-fp32-g1-d64", "float32", (20, 37), (20, 37), (2, 2), 64, 16),
    AttnCase("prefix-fp32-g2-d128-bs32", "float32", (40, 70), (9, 33), (4, 2), 128, 32),
    AttnCase("mixed-fp16-g4-d16", "float16", (9, 12, 50, 45), (1, 12, 1, 30), (8, 2), 16, 16),
    AttnCase("prefix-bf16-g2-d64", "bfloat16", (50, 23), (17, 23), (4, 2), 64, 16),
    AttnCase("mixed-fp16-e4m3-g2", "float16", (33, 21), (1, 14), (4, 2), 64, 16, cache=E4M3),
    AttnCase("mixed-bf16-e5m2-bs32", "bfloat16", (40, 5), (13, 1), (2, 2), 32, 32, cache=E5M2),
    AttnCase("mixed-fp32-d24", "float32", (26, 31), (26, 4), (4, 2), 24, 16),
    AttnCase("prefix-fp32-many-query-tiles", "float32", (170,), (150,), (2, 1), 16, 16),
    AttnCase("prefix-fp32-bs128", "float32", (150, 40), (20, 40), (2, 1), 16, 128),
    # sliding windows (shorter and longer than contexts, of 1 token) and soft caps
    _decode("decode-fp32-window", "float32", (1, 17, 100, 64), (4, 2), 16, 16, window=20),
    _decode("decode-fp32-window-split2", "float32", (250, 30, 101), (4, 1), 32, 16,
            num_splits=3, window=100),
    _decode("decode-bf16-softcap", "bfloat16", (40, 9), (4, 1), 64, 8, softcap=2.0),
    _decode("decode-fp16-e4m3-window-softcap", "float16", (70, 3), (4, 2), 64, 16, cache=E4M3,
            window=33, softcap=5.0),
    AttnCase("prefill-fp32-window", "float32", (40, 70), (40, 33), (2, 2), 32, 16, window=9),
    AttnCase("prefix-fp32-window1", "float32", (50, 23), (17, 23), (4, 2), 16, 8, window=1),
    AttnCase("mixed-fp16-window-softcap", "float16", (9, 120, 50, 45), (1, 100, 1, 30), (8, 2),
             16, 16, window=37, softcap=3.0),
    AttnCase("prefix-fp32-softcap-many-tiles", "float32", (170,), (150,), (2, 1), 16, 16,
             softcap=1.5),
    AttnCase("mixed-bf16-e5m2-window", "bfloat16", (40, 5), (13, 1), (2, 2), 32, 32, cache=E5M2,
             window=6),
    # split-KV prefill (a prefix hit): splits of the keys every row sees, some of them empty
    # for the shorter contexts and for the rows near a context's start
    AttnCase("prefix-fp32-split3", "float32", (200, 90, 20), (16, 33, 20), (4, 2), 64, 16,
             num_splits=3),
    AttnCase("mixed-bf16-e4m3-split4", "bfloat16", (150, 7, 131), (5, 1, 3), (4, 1), 32, 8,
             cache=E4M3, num_splits=4),
    AttnCase("prefix-fp16-softcap-split2-tiles", "float16", (170,), (150,), (2, 1), 16, 16,
             num_splits=2, softcap=1.5),
    AttnCase("prefix-fp32-d24-split5-bs32", "float32", (300, 64), (2, 64), (2, 1), 24, 32,
             num_splits=5),
]

# bigger shapes for the GPU only: default split heuristics, many query tiles, long contexts
CUDA_ATTN_CASES = [
    _decode("gpu-decode-fp16-long", "float16", (3000, 17, 1200), (8, 2), 128, 16),
    _decode("gpu-decode-bf16-e4m3", "bfloat16", (2049, 511), (32, 8), 128, 16, cache=E4M3),
    AttnCase("gpu-prefix-bf16", "bfloat16", (1500, 700, 64), (900, 1, 64), (16, 4), 128, 16),
    AttnCase("gpu-prefix-fp16-d256", "float16", (600, 300), (300, 300), (8, 8), 256, 32),
    AttnCase("gpu-mixed-fp32-d80", "float32", (300, 129), (45, 1), (4, 2), 80, 16),
    _decode("gpu-decode-bf16-window", "bfloat16", (5000, 300, 4097), (8, 2), 128, 16,
            window=4096, softcap=50.0),
    AttnCase("gpu-prefix-fp16-window", "float16", (1500, 700), (900, 700), (8, 4), 256, 16,
             window=512, softcap=50.0),
    # prefix hits: few new tokens over long contexts, split by the default heuristic
    AttnCase("gpu-prefix-hit-bf16", "bfloat16", (8208, 2064), (16, 16), (32, 8), 64, 16),
    AttnCase("gpu-prefix-hit-fp16-e4m3", "float16", (4100,), (4,), (32, 8), 128, 16, cache=E4M3),
]


def _fp8_edges(dtype: torch.dtype) -> torch.Tensor:
    """Every finite fp8 value, the midpoints between neighbours and the fp32s next to them."""
    vals = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    vals = vals[vals.isfinite()].unique()  # sorted
    mids = (vals[:-1] + vals[1:]) / 2
    big = torch.finfo(dtype).max
    extra = torch.tensor([big * 1.01, big * 4, float("inf"), float("nan"), 1e-40, 1e-45, 0.0])
    parts = [vals, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1), extra]
    x = torch.cat(parts)
    return torch.cat([x, -x])


def _write_inputs(case: WriteCase, device: str):
    g = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    src, cache_dtype = getattr(torch, case.src), getattr(torch, case.cache)
    N, H, D = case.shape
    if case.values == "edges":
        x = _fp8_edges(cache_dtype)
        N = -(-x.numel() // (H * D))
        x = torch.cat([x, torch.zeros(N * H * D - x.numel())]).view(N, H, D)
        k, v = x, x.flip(0)
    else:
        # magnitudes over many octaves reach fp8's subnormals and its clamp
        k = torch.randn(N, H, D, generator=g) * torch.exp(torch.randn(N, H, D, generator=g) * 3)
        v = torch.randn(N, H, D, generator=g) * 4
    if case.strided:
        fused = torch.randn(N, 3, H, D, generator=g)
        fused[:, 1], fused[:, 2] = k, v
        k, v = fused[:, 1], fused[:, 2]
    k, v = k.to(src).to(device), v.to(src).to(device)
    num_blocks, block_size = -(-N // 16) * 2, 16
    shape = (num_blocks, LAYERS, 2, block_size, H, D * cache_dtype.itemsize)
    cache = torch.randint(0, 256, shape, generator=g).to(torch.uint8)
    cache = cache.view(cache_dtype).to(device)  # [B, L, 2, T, H, D] of random bytes
    slots = torch.randperm(num_blocks * block_size, generator=g)[:N].to(device)
    return k, v, cache, slots, KVScales(*case.scales)


def check_write(case: WriteCase, device: str, reference_device: str | None = None) -> dict:
    """Bytes differing between the kernel's cache and the torch path's, over all layers."""
    from engine import triton_kv_write

    k, v, cache, slots, scales = _write_inputs(case, device)
    ref_device = reference_device or device
    expected = cache.to(ref_device, copy=True)
    ref_args = (k.to(ref_device), v.to(ref_device), layer_view(expected, LAYER))
    write_kv(*ref_args, slots.to(ref_device), scales)
    triton_kv_write.write_kv(k, v, layer_view(cache, LAYER), slots, scales)
    got, want = cache.cpu(), expected.cpu()
    diff = got.view(torch.uint8) != want.view(torch.uint8)
    if got.element_size() == 1:  # fp8: one byte per element
        # The rule for NaN: any NaN encoding matches (CUDA's division drops a NaN's sign).
        diff &= ~(got.float().isnan() & want.float().isnan())
    return {"bytes_differing": int(diff.sum()), "bytes": diff.numel()}


def _attention_inputs(case: AttnCase, device: str):
    g = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    dtype = getattr(torch, case.dtype)
    cache_dtype = getattr(torch, case.cache) if case.cache else dtype
    hq, hkv = case.heads
    D, bs = case.head_dim, case.block_size
    B = len(case.seq_lens)
    blocks_per_seq = [-(-s // bs) for s in case.seq_lens]
    max_blocks = max(blocks_per_seq) + 1
    num_blocks = sum(blocks_per_seq) + 5
    # shuffled blocks; the unused tail of each row points at blocks of other sequences
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.randint(0, num_blocks, (B, max_blocks), generator=g)
    start = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = perm[start : start + n]
        start += n
    scales = KVScales(0.15, 0.11) if case.cache else KVScales()
    raw = torch.randn(num_blocks, LAYERS, 2, bs, hkv, D, generator=g)
    if case.window is not None:
        # what a block manager gave away: NaN, which any read would spread to the output
        given_away = int(perm[-1])
        raw[given_away] = float("nan")
        tables[tables == given_away] = int(perm[0])  # the unused tails stay finite
        for b, (s, ql) in enumerate(zip(case.seq_lens, case.query_lens)):
            tables[b, : first_visible(s, ql, case.window) // bs] = given_away
    cache = (raw * 6).to(cache_dtype) if case.cache else raw.to(dtype)  # [NB, L, 2, T, Hkv, D]
    n_tokens = sum(case.query_lens)
    q = torch.randn(n_tokens, hq, D, generator=g).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(case.query_lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.cat([
        torch.tensor([int(tables[b, p // bs]) * bs + p % bs for p in range(s - ql, s)])
        for b, (s, ql) in enumerate(zip(case.seq_lens, case.query_lens))
    ])
    meta = AttentionMetadata(
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(torch.int32).to(device),
        slot_mapping=slots.to(device),
        seq_lens_cpu=list(case.seq_lens),
        query_lens_cpu=list(case.query_lens),
    )
    return q.to(device), layer_view(cache.to(device), LAYER), meta, scales


def check_attention(case: AttnCase, device: str) -> dict:
    """Largest error of the kernel against ``attention_torch`` and whether it is close."""
    from engine import triton_attention

    q, cache, meta, scales = _attention_inputs(case, device)
    scale = case.head_dim**-0.5
    window = dict(window=case.window, softcap=case.softcap)
    expected = attention_torch(q, cache, meta, scale, scales, **window).float()
    out = triton_attention.attention(
        q, cache, meta, scale, scales, num_splits=case.num_splits, **window
    )
    err = (out.float() - expected).abs()
    close = torch.allclose(out.float(), expected, atol=case.tol, rtol=case.tol)
    return {
        "close": bool(close),
        "max_err": float(err.max()),
        "dtype": str(out.dtype).removeprefix("torch."),
        "shape": list(out.shape),
        "finite": bool(out.isfinite().all() and expected.isfinite().all()),
    }


# wrapper calls that must raise ValueError, and a part of each message
BAD_CALLS = {
    "q fp64": "fp16, bf16 or fp32",
    "heads": "multiple of kv heads",
    "head dim": "head_dim must be",
    "strided cache": "must be contiguous",
    "cache dtype": "q's dtype",
    "block size": "power of two",
    "short table": "fewer than max_seq_len",
    "token count": "q has 2 tokens",
    "q last dim": "contiguous in its last dim",
    "kv shapes": "k and v must both be",
    "slot dtype": "int32 or int64",
    "cache kind": "cache needs torch.bfloat16 k and v",
    "cache heads": "holds [H, D]",
    "window": "window must be a positive int",
    "softcap": "softcap must be positive",
}


def _bad_calls(device: str) -> dict:
    from engine import triton_attention as ta
    from engine import triton_kv_write as kw

    def meta(seq_lens, query_lens, max_blocks=4) -> AttentionMetadata:
        qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        return AttentionMetadata(
            query_start_loc=qsl.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32, device=device),
            slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64, device=device),
            seq_lens_cpu=list(seq_lens),
            query_lens_cpu=list(query_lens),
        )

    def cache(h=2, d=16, bs=16, dtype=torch.float32):
        return layer_view(torch.zeros(8, LAYERS, 2, bs, h, d, dtype=dtype, device=device), LAYER)

    def zeros(*shape):
        return torch.zeros(*shape, device=device)

    q, kv, m = zeros(2, 4, 16), zeros(2, 2, 16), meta([5, 9], [1, 1])
    slots = torch.zeros(2, dtype=torch.int64, device=device)
    return {
        "q fp64": lambda: ta.attention(q.double(), cache(), m, 1.0),
        "heads": lambda: ta.attention(zeros(2, 3, 16), cache(), m, 1.0),
        "head dim": lambda: ta.attention(zeros(2, 2, 512), cache(d=512), m, 1.0),
        "strided cache": lambda: ta.attention(q, cache().transpose(3, 4), m, 1.0),
        "cache dtype": lambda: ta.attention(q, cache(dtype=torch.float16), m, 1.0),
        "block size": lambda: ta.attention(q, cache(bs=24), m, 1.0),
        "short table": lambda: ta.attention(q, cache(), meta([5, 90], [1, 1]), 1.0),
        "token count": lambda: ta.attention(q, cache(), meta([5, 9], [1, 2]), 1.0),
        "q last dim": lambda: ta.attention(zeros(2, 16, 4).transpose(1, 2), cache(), m, 1.0),
        "kv shapes": lambda: kw.write_kv(kv, kv[:1], cache(), slots),
        "slot dtype": lambda: kw.write_kv(kv, kv, cache(), slots.float()),
        "cache kind": lambda: kw.write_kv(kv.half(), kv.half(), cache(dtype=torch.bfloat16), slots),
        "cache heads": lambda: kw.write_kv(kv, kv, cache(h=4), slots),
        "window": lambda: ta.attention(q, cache(), m, 1.0, window=0),
        "softcap": lambda: ta.attention(q, cache(), m, 1.0, softcap=-1.0),
    }


def check_errors(device: str) -> dict:
    return value_errors(_bad_calls(device))


def check_skipped_slot(device: str) -> bool:
    """A slot past the end of the cache is not written; the other tokens are."""
    from engine import triton_kv_write

    cache = torch.zeros(2, LAYERS, 2, 16, 1, 16, device=device)  # [B, L, 2, T, H, D]
    kv = torch.ones(2, 1, 16, device=device)
    slots = torch.tensor([3, 32], device=device)
    triton_kv_write.write_kv(kv, kv, layer_view(cache, LAYER), slots)
    return bool(cache[0, LAYER, :, 3].eq(1).all()) and int(cache.ne(0).sum()) == 2 * 16


def interpreter_main() -> None:
    """Run every check on the CPU and print the results as one JSON line."""
    from engine import triton_support

    assert triton_support.interpreting(), "TRITON_INTERPRET=1 did not reach triton"
    results = {
        "write": {c.name: check_write(c, "cpu") for c in WRITE_CASES},
        "attention": {c.name: check_attention(c, "cpu") for c in ATTN_CASES},
        "errors": check_errors("cpu"),
        "skipped_slot": check_skipped_slot("cpu"),
    }
    print(json.dumps(results))


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_interpreted(interpreter_main_of("test_triton_attention"))


@pytest.mark.parametrize("case", WRITE_CASES, ids=lambda c: c.name)
def test_write_kv_matches_torch_bit_for_bit(interpreted, case):
    result = interpreted["write"][case.name]
    assert result["bytes_differing"] == 0, result


@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: c.name)
def test_attention_matches_torch(interpreted, case):
    result = interpreted["attention"][case.name]
    assert result["close"], f"max error {result['max_err']} > {case.tol}"
    assert result["finite"]
    assert result["dtype"] == case.dtype
    assert result["shape"] == [sum(case.query_lens), case.heads[0], case.head_dim]


@pytest.mark.parametrize("call", BAD_CALLS)
def test_wrappers_reject_bad_arguments(interpreted, call):
    error = interpreted["errors"][call]
    assert error is not None, "no ValueError"
    assert BAD_CALLS[call] in error


def test_write_kv_skips_slots_outside_the_cache(interpreted):
    assert interpreted["skipped_slot"]


def test_a_prefix_hit_splits_its_keys_and_a_long_prefill_does_not():
    from engine.triton_split_kv import split_count

    # 1B shape (32 query heads) on 132 SMs: 16 new tokens over 8K cached ones is one tile
    # per head, 32 programs for 264 slots: 9 splits of 912 keys
    assert split_count(32 * 1 * 1, 8208, 132) == 9
    assert split_count(32, 1040, 132) == 4  # no split under MIN_SPLIT_TOKENS keys
    assert split_count(32, 200, 132) == 1
    assert split_count(32 * 16 * 1, 8208, 132) == 1  # 2,048 new tokens fill the GPU


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_on_gpu():
    # the torch path divides by the scale on the CPU but multiplies by its reciprocal on
    # CUDA; the kernel divides, so its bytes are compared with the CPU's
    for case in WRITE_CASES:
        result = check_write(case, "cuda", reference_device="cpu")
        assert result["bytes_differing"] == 0, (case.name, result)
    for case in ATTN_CASES + CUDA_ATTN_CASES:
        result = check_attention(case, "cuda")
        assert result["close"] and result["finite"], (case.name, result)
    for name, error in check_errors("cuda").items():
        assert error is not None and BAD_CALLS[name] in error, (name, error)
    assert check_skipped_slot("cuda")
