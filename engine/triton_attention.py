"""Paged attention on CUDA in Triton: the wrapper that checks a step and picks its kernel
(the KV write is in :mod:`engine.triton_kv_write`).

The kernels implement the contract of :mod:`engine.attention` (cache layout, metadata, fp8
scales) and are tested against its torch path on the CPU under ``TRITON_INTERPRET=1``.
A layer's cache is the strided view :func:`engine.kv_cache.layer_view`: the kernels take
the block stride, the token stride and the K->V offset from its strides and need only each
block's ``[block_size, H, D]`` to be contiguous.

:func:`attention` runs one of two kernels: decode (every sequence has one new token,
:mod:`engine.triton_decode`) or prefill (anything else, :mod:`engine.triton_prefill`).
Both split a long context when their grid would leave the GPU idle and merge the splits'
partial results (:mod:`engine.triton_split_kv`), and both attend with the online softmax
of :mod:`engine.triton_attend`. An fp8 cache is decoded exactly into q's dtype (every fp8
value is an fp16/bf16 value) and its scales are folded into the softmax scale and the
output. Grids come from host-side lengths, so a step's launch shapes change with its batch
(relevant to CUDA-graph capture).
"""
from __future__ import annotations

import operator
from typing import NamedTuple

import torch

from engine.attention import AttentionMetadata, KVScales
from engine.triton_decode import decode
from engine.triton_prefill import prefill
from engine.triton_support import (
    FP8_FACTOR,
    FP8_FORMATS,
    MAX_HEAD_DIM,
    QUERY_DTYPES,
    backport_interpreter_index,
    check_cache,
    check_index,
    check_kernel_device,
    interpreting,
    pow2,
)

_LOG2E = 1.4426950408889634


def _check_meta(
    meta: AttentionMetadata,
    num_tokens: int,
    block_size: int,
    max_seq_len: int,
    device: torch.device,
) -> None:
    B = meta.num_seqs
    if len(meta.query_lens_cpu) != B:
        raise ValueError(f"{len(meta.query_lens_cpu)} query lengths for {B} sequences")
    total = sum(meta.query_lens_cpu)
    if total != num_tokens:
        raise ValueError(f"query lengths sum to {total}, q has {num_tokens} tokens")
    if any(map(operator.gt, meta.query_lens_cpu, meta.seq_lens_cpu)):
        raise ValueError("a sequence has more new tokens than its seq_len")
    check_index(meta.query_start_loc, "query_start_loc", (B + 1,), device)
    check_index(meta.seq_lens, "seq_lens", (B,), device)
    tables = meta.block_tables
    if tables.dim() != 2:
        raise ValueError(f"block_tables must be [B, max_blocks], got {list(tables.shape)}")
    check_index(tables, "block_tables", (B, tables.shape[1]), device)
    if tables.shape[1] * block_size < max_seq_len:
        raise ValueError(
            f"block_tables has {tables.shape[1]} blocks of {block_size} per sequence, "
            f"fewer than max_seq_len {max_seq_len}"
        )


def attention(
    q: torch.Tensor,  # [N, Hq, D]
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D], may be a strided view
    meta: AttentionMetadata,
    scale: float,
    scales: KVScales = KVScales(),
    *,
    window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's paged context. ``[N, Hq, D]``.

    Matches :func:`engine.attention.attention_torch`, ``window`` and ``softcap`` included
    (positions before a window are never read). The cache's dtype is q's or fp8 (with
    ``scales``). Grid sizes come from the host lists in ``meta``: no device sync.
    ``num_splits`` overrides how many partitions each context (decode: or window) is split
    into (by default enough to fill the GPU); a prefill step with a window never splits.
    """
    check_kernel_device(q, "q")
    if q.dim() != 3:
        raise ValueError(f"q must be [N, Hq, D], got {list(q.shape)}")
    if q.dtype not in QUERY_DTYPES:
        raise ValueError(f"q must be fp16, bf16 or fp32, got {q.dtype}")
    if q.stride(2) != 1:
        raise ValueError("q must be contiguous in its last dim")
    check_cache(layer_cache, q.device)
    N, Hq, D = q.shape
    _, _, block_size, Hkv, cache_d = layer_cache.shape
    if cache_d != D:
        raise ValueError(f"q has head_dim {D}, the cache {cache_d}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be 1..{MAX_HEAD_DIM}, got {D}")
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    fp8 = FP8_FORMATS.get(layer_cache.dtype)
    if fp8 is None and layer_cache.dtype != q.dtype:
        raise ValueError(f"the cache must be q's dtype ({q.dtype}) or fp8, got {layer_cache.dtype}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive or None, got {softcap!r}")
    max_seq_len = meta.max_seq_len
    _check_meta(meta, N, block_size, max_seq_len, q.device)

    out = torch.empty(N, Hq, D, dtype=q.dtype, device=q.device)
    if N == 0:
        return out
    backport_interpreter_index()
    factor = FP8_FACTOR.get(layer_cache.dtype, 1.0)
    k_scale, v_factor = (scales.k * factor, scales.v * factor) if fp8 else (1.0, 1.0)
    d_pad = max(16, pow2(D))
    tiles = _tiles(q.dtype, d_pad)
    args = (
        q, layer_cache.view(torch.uint8) if fp8 else layer_cache, out,
        meta.query_start_loc, meta.seq_lens, meta.block_tables,
        float(scale) * k_scale * _LOG2E, v_factor,
        float(softcap or 1.0) * _LOG2E, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
        layer_cache.stride(1), layer_cache.stride(2), layer_cache.stride(3), layer_cache.stride(0),
    )
    constants = dict(
        BLOCK_SIZE=block_size, HEAD_DIM=D, D_PAD=d_pad, BLOCK_N=tiles.block_n,
        FP8=fp8[0] if fp8 else 0,
        # the interpreter cannot multiply bf16 tiles; fp32 runs as 3xTF32 (about fp32 accuracy)
        DOT_FP32=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and interpreting()),
        PRECISION="tf32x3" if q.dtype == torch.float32 else "tf32",
        SOFTCAP=softcap is not None, WINDOW=window is not None,
        num_stages=2,
    )
    if meta.is_decode_only:
        constants["num_warps"] = tiles.decode_warps
        span = max_seq_len if window is None else min(max_seq_len, window)
        decode(args, constants, out, meta, v_factor, Hkv, span, num_splits)
    else:
        prefill(args, constants, out, meta, v_factor, Hkv, tiles.block_m, tiles.prefill_warps,
                num_splits)
    return out


class _Tiles(NamedTuple):
    block_m: int  # prefill: most new tokens per program
    block_n: int  # keys per step of the inner loop
    prefill_warps: int
    decode_warps: int


def _tiles(dtype: torch.dtype, d_pad: int) -> _Tiles:
    """Tile sizes that fit an H100's registers and shared memory at num_stages=2."""
    if dtype == torch.float32:  # 3xTF32 dots hold about twice the registers
        return _Tiles(32, 32, 8, 8)
    if d_pad > 128:
        return _Tiles(64, 32, 8, 4)
    return _Tiles(128, 64, 8, 4)
