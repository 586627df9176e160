"""Triton kernels for paged attention on CUDA (the KV write is in :mod:`engine.triton_kv_write`).

They implement the contract of :mod:`engine.attention` (cache layout, metadata, fp8
scales) and are tested against its torch path on the CPU under ``TRITON_INTERPRET=1``.
A layer's cache is the strided view :func:`engine.kv_cache.layer_view`: the kernels take
the block stride, the token stride and the K->V offset from its strides and need only each
block's ``[block_size, H, D]`` to be contiguous.

- :func:`attention` runs one of two kernels. Decode (every sequence has one new token):
  one program per (sequence, kv head, split) whose ``GROUP`` query heads form the rows of
  one tile; a long context is split into ``num_splits`` partitions whose partial results
  a second kernel merges (split-KV, so a small batch still fills the GPU). Prefill
  (anything else): one program per (query head, tile of ``BLOCK_M`` new tokens,
  sequence), first over the key tiles every row of the tile sees, then over the causal
  diagonal with a mask. When that grid is too small to fill the GPU (a few new tokens
  over a long cached prefix: a prefix hit), the keys every row sees are split likewise
  and the same kernel merges the partials per token.

Both attend with an online softmax in base 2 and fp32 accumulation; fp16/bf16 dots run
on tensor cores (probabilities rounded to q's dtype before P·V), fp32 dots as 3xTF32.
Keys are gathered per token through the block table, so a key tile may span several
cache blocks or part of one. Head dims that are not a power of two are zero-padded in
registers. An fp8 cache is decoded exactly into q's dtype (every fp8 value is an
fp16/bf16 value) and its scales are folded into the softmax scale and the output; see
:func:`_fp8_to_fp16`. Grids come from host-side lengths, so a step's launch shapes
change with its batch (relevant to CUDA-graph capture).
"""
from __future__ import annotations

import operator
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.attention import AttentionMetadata, KVScales
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

# Fewest keys a decode split is given: below this the merge costs more than it saves.
MIN_SPLIT_TOKENS = 256

_LOG2E = 1.4426950408889634


@triton.jit
def _fp8_to_fp16(b, FP8: tl.constexpr):
    """An fp8 byte tile -> fp16, exactly: e5m2 as is, e4m3fn times 2**-8 (NaN kept)."""
    x = b.to(tl.int32)
    if FP8 == 1:
        # e4m3fn's exponent bias is 7, fp16's 15: placing the bits in an fp16 divides by 2**8
        bits = ((x & 0x80) << 8) | ((x & 0x7F) << 7)
        bits = tl.where((x & 0x7F) == 0x7F, bits | 0x7E00, bits)
    else:
        bits = x << 8
    return bits.to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _as_dot(x, q_ptr, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        y = x.to(tl.float32)
    else:
        y = x.to(q_ptr.dtype.element_ty)
    return y


@triton.jit
def _load_kv(ptrs, t_ok, d, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, MASKED: tl.constexpr):
    if MASKED:
        if HEAD_DIM == D_PAD:
            x = tl.load(ptrs, mask=t_ok[:, None], other=0)
        else:
            x = tl.load(ptrs, mask=t_ok[:, None] & (d < HEAD_DIM)[None, :], other=0)
    else:
        if HEAD_DIM == D_PAD:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=(d < HEAD_DIM)[None, :], other=0)
    return x


@triton.jit
def _tanh(x):
    """tanh from exp2 (the interpreter has no libdevice): saturates to ±1, no overflow NaN."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def _attend(
    acc, m_i, l_i, q, q_ptr, pos,
    cache_ptr, bt_row_ptr, head_off, lo, hi, qk_scale, softcap, window,
    stride_blk, stride_tok, v_offset,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, FP8: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    MASK: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Online softmax of ``q`` [M, D_PAD] over context positions ``lo..hi-1``.

    MASK: 0 every key is visible to every row and in range; 1 keys past ``hi`` are
    masked; 2 causal, key ``t`` visible to the row at position ``pos`` iff ``t <= pos``;
    3 causal within a window, iff ``pos - window < t <= pos`` (a row may see no key of a
    tile). SOFTCAP: scores (base-2 units) become ``softcap * tanh(scores / softcap)``.
    """
    d = tl.arange(0, D_PAD)
    for start in range(lo, hi, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] context positions
        t_ok = t < hi
        if MASK == 0:
            blk = tl.load(bt_row_ptr + t // BLOCK_SIZE)
        else:
            blk = tl.load(bt_row_ptr + t // BLOCK_SIZE, mask=t_ok, other=0)
        off = blk.to(tl.int64) * stride_blk + (t % BLOCK_SIZE) * stride_tok + head_off
        ptrs = cache_ptr + off[:, None] + d[None, :]  # [BLOCK_N, D_PAD]
        k = _load_kv(ptrs, t_ok, d, HEAD_DIM, D_PAD, MASK != 0)
        v = _load_kv(ptrs + v_offset, t_ok, d, HEAD_DIM, D_PAD, MASK != 0)
        if FP8:
            k = _fp8_to_fp16(k, FP8)
            v = _fp8_to_fp16(v, FP8)
        k = _as_dot(k, q_ptr, DOT_FP32)
        v = _as_dot(v, q_ptr, DOT_FP32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, BLOCK_N]
        if SOFTCAP:
            s = softcap * _tanh(s / softcap)
        if MASK == 1:
            s = tl.where(t_ok[None, :], s, float("-inf"))
        elif MASK == 2:
            s = tl.where(t[None, :] <= pos[:, None], s, float("-inf"))
        elif MASK == 3:
            seen = (t[None, :] <= pos[:, None]) & (t[None, :] > pos[:, None] - window)
            s = tl.where(seen & t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = m_new
        if MASK == 3:  # a row that has seen nothing yet: subtract 0, not -inf (no NaN)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = _as_dot(p, q_ptr, DOT_FP32)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# --- attention: decode ------------------------------------------------------------------


# Arguments that follow a step's context length are left unspecialized: Triton would
# otherwise compile a variant of its own, at first use, for each such value equal to 1 or
# divisible by 16 (a block-table width of 1 or 16k blocks; a split count giving a split
# stride of 16k), e.g. on a server's first prefix hit of a new length class.
@triton.jit(do_not_specialize=["stride_bt", "stride_lb", "stride_lh"])
def _decode_kernel(
    q_ptr, cache_ptr, out_ptr, qsl_ptr, seq_lens_ptr, bt_ptr, qk_scale, v_factor, softcap, window,
    stride_qn, stride_qh, stride_on, stride_oh, stride_bt,
    stride_blk, stride_tok, stride_kvh, v_offset,
    part_ptr, lse_ptr, split_len, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
):
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    row = tl.load(qsl_ptr + b)
    if tl.load(qsl_ptr + b + 1) == row:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    lo = split * split_len
    if WINDOW:  # the splits cover the window: the first one is never empty
        lo += tl.maximum(seq_len - window, 0)
    hi = tl.minimum(lo + split_len, seq_len)

    g = tl.arange(0, G_PAD)  # this kv head's query heads are rows; G_PAD >= 16 for tl.dot
    d = tl.arange(0, D_PAD)
    io_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    heads = kvh * GROUP + g
    q = tl.load(
        q_ptr + row.to(tl.int64) * stride_qn + heads[:, None] * stride_qh + d[None, :],
        mask=io_mask, other=0.0,
    )
    q = _as_dot(q, q_ptr, DOT_FP32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc, m_i, l_i = _attend(
        acc, m_i, l_i, q, q_ptr, g,
        cache_ptr, bt_ptr + b.to(tl.int64) * stride_bt, kvh * stride_kvh, lo, hi, qk_scale,
        softcap, window, stride_blk, stride_tok, v_offset,
        BLOCK_SIZE, HEAD_DIM, D_PAD, BLOCK_N, FP8, DOT_FP32, PRECISION, 1, SOFTCAP,
    )
    # an empty split (past the end of a shorter sequence) leaves l == 0, m == -inf
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    if SPLIT:
        part = (
            part_ptr + b.to(tl.int64) * stride_pb + heads[:, None] * stride_ph
            + split * stride_ps + d[None, :]
        )
        tl.store(part, acc / l_safe[:, None], mask=io_mask)
        lse = m_i + tl.log2(l_safe)
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g < GROUP)
    else:
        out = acc * (v_factor / l_safe)[:, None]
        ptrs = out_ptr + row.to(tl.int64) * stride_on + heads[:, None] * stride_oh + d[None, :]
        tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit(do_not_specialize=["num_splits", "stride_lb", "stride_lh"])  # see _decode_kernel
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr, qsl_ptr, num_splits, v_factor,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_on, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PER_TOKEN: tl.constexpr,
):
    """out = Σ_s 2**lse_s · o_s / Σ_s 2**lse_s over a head's split partials ``o_s``.
    Axis 1 is a sequence (decode: its one token) or, with PER_TOKEN, a token (prefill)."""
    h = tl.program_id(0)
    b = tl.program_id(1)
    if PER_TOKEN:
        row = b
    else:
        row = tl.load(qsl_ptr + b)
        if tl.load(qsl_ptr + b + 1) == row:
            return
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    part = part_ptr + b.to(tl.int64) * stride_pb + h * stride_ph + d
    lse = lse_ptr + b * stride_lb + h * stride_lh
    # split 0 starts at the context's (or window's) first position: never empty, lse finite
    m = tl.load(lse)
    acc = tl.load(part, mask=d_ok, other=0.0)
    total = tl.full([D_PAD], 1.0, dtype=tl.float32)
    for s in range(1, num_splits):
        lse_s = tl.load(lse + s)
        m_new = tl.maximum(m, lse_s)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse_s - m_new)
        acc = acc * alpha + tl.load(part + s * stride_ps, mask=d_ok, other=0.0) * w
        total = total * alpha + w
        m = m_new
    out = acc * v_factor / total
    ptrs = out_ptr + row.to(tl.int64) * stride_on + h * stride_oh + d
    tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=d_ok)


# --- attention: prefill -----------------------------------------------------------------


@triton.jit(do_not_specialize=["stride_bt", "num_splits", "stride_lb", "stride_lh"])  # see _decode_kernel
def _prefill_kernel(
    q_ptr, cache_ptr, out_ptr, qsl_ptr, seq_lens_ptr, bt_ptr, qk_scale, v_factor, softcap, window,
    stride_qn, stride_qh, stride_on, stride_oh, stride_bt,
    stride_blk, stride_tok, stride_kvh, v_offset,
    part_ptr, lse_ptr, split_len, num_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, SPLIT: tl.constexpr,
):
    hq = tl.program_id(0)
    # the last query tiles see the most keys: launch them first. With SPLIT, axis 1 is
    # (tile, split) and split s reads keys [s * split_len, (s + 1) * split_len) of the
    # part every row sees; split 0 also reads the causal diagonal, so it is never empty.
    split = 0
    if SPLIT:
        split = tl.program_id(1) % num_splits
        m_tile = tl.num_programs(1) // num_splits - 1 - tl.program_id(1) // num_splits
    else:
        m_tile = tl.num_programs(1) - 1 - tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    m_lo = m_tile * BLOCK_M
    if m_lo >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len  # cached positions before this step's tokens
    #   keys:   |0 .............. full_end|... causal ...|causal_end      seq_len
    #   rows:                    ctx + m_lo| this tile |ctx + m_lo + BLOCK_M
    # keys before ctx + m_lo are visible to every row of the tile; whole key tiles up to
    # there need no mask, the rest up to the tile's last row do.
    full_end = ((ctx + m_lo) // BLOCK_N) * BLOCK_N
    causal_end = tl.minimum(seq_len, ctx + m_lo + BLOCK_M)

    rows = m_lo + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_PAD)
    io_mask = (rows < q_len)[:, None] & (d < HEAD_DIM)[None, :]
    tok = (q_start + rows).to(tl.int64)
    q_ptrs = q_ptr + tok[:, None] * stride_qn + hq * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=io_mask, other=0.0)
    q = _as_dot(q, q_ptr, DOT_FP32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    head_off = (hq // GROUP) * stride_kvh
    pos = ctx + rows
    if WINDOW:
        # keys from the tile's first row's window start, every one masked: at most
        # window + BLOCK_M of them, and keys before it (maybe given away) never read
        win_lo = tl.maximum(ctx + m_lo - window + 1, 0)
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q, q_ptr, pos, cache_ptr, bt_row, head_off, win_lo, causal_end,
            qk_scale, softcap, window, stride_blk, stride_tok, v_offset,
            BLOCK_SIZE, HEAD_DIM, D_PAD, BLOCK_N, FP8, DOT_FP32, PRECISION, 3, SOFTCAP,
        )
    else:
        lo, hi, diagonal_end = 0, full_end, causal_end
        if SPLIT:  # split_len is a multiple of BLOCK_N, so is every split of the full part
            lo = split * split_len
            hi = tl.minimum(lo + split_len, full_end)
            diagonal_end = tl.where(split == 0, causal_end, full_end)
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q, q_ptr, pos, cache_ptr, bt_row, head_off, lo, hi, qk_scale,
            softcap, window, stride_blk, stride_tok, v_offset,
            BLOCK_SIZE, HEAD_DIM, D_PAD, BLOCK_N, FP8, DOT_FP32, PRECISION, 0, SOFTCAP,
        )
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q, q_ptr, pos, cache_ptr, bt_row, head_off, full_end, diagonal_end,
            qk_scale, softcap, window, stride_blk, stride_tok, v_offset,
            BLOCK_SIZE, HEAD_DIM, D_PAD, BLOCK_N, FP8, DOT_FP32, PRECISION, 2, SOFTCAP,
        )
    if SPLIT:  # partials per token; an empty split leaves l == 0, m == -inf: weight 0
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        part = (part_ptr + tok[:, None] * stride_pb + hq * stride_ph + split * stride_ps
                + d[None, :])
        tl.store(part, acc / l_safe[:, None], mask=io_mask)
        tl.store(lse_ptr + tok * stride_lb + hq * stride_lh + split, m_i + tl.log2(l_safe),
                 mask=rows < q_len)
    else:
        out = acc * (v_factor / l_i)[:, None]
        ptrs = out_ptr + tok[:, None] * stride_on + hq * stride_oh + d[None, :]
        tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


# --- wrappers ---------------------------------------------------------------------------


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


def _default_splits(programs: int, max_seq_len: int, device: torch.device) -> int:
    """Splits of each context for about two programs per SM (see :func:`split_count`)."""
    if device.type != "cuda":
        return 1
    return split_count(programs, max_seq_len, torch.cuda.get_device_properties(device).multi_processor_count)


def split_count(programs: int, max_seq_len: int, sms: int) -> int:
    """How many splits bring a grid of ``programs`` to about two programs per SM, none
    shorter than MIN_SPLIT_TOKENS; 1 when the grid fills the GPU already."""
    target = 2 * sms
    if programs >= target:
        return 1
    return max(1, min(triton.cdiv(target, programs), max_seq_len // MIN_SPLIT_TOKENS))


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
        _decode(args, constants, out, meta, v_factor, Hkv, span, num_splits)
        return out
    block_m = min(tiles.block_m, max(16, pow2(meta.max_query_len)))
    tiles_m = triton.cdiv(meta.max_query_len, block_m)
    warps = tiles.prefill_warps if block_m >= 32 else 4
    common = dict(GROUP=Hq // Hkv, BLOCK_M=block_m, num_warps=warps, **constants)
    # a few new tokens over a long context (a prefix hit) leave most SMs idle: split the keys
    # every row sees, as decode does (not within a window: it reads few keys anyway)
    if window is not None:
        num_splits = 1
    elif num_splits is None:
        num_splits = _default_splits(Hq * tiles_m * meta.num_seqs, max_seq_len, q.device)
    if num_splits > 1:  # whole key tiles per split; as many splits as that takes
        split_len = triton.cdiv(triton.cdiv(max_seq_len, num_splits), tiles.block_n) * tiles.block_n
        num_splits = triton.cdiv(max_seq_len, split_len)
    if num_splits == 1:
        grid = (Hq, tiles_m, meta.num_seqs)
        _prefill_kernel[grid](*args, out, out, 0, 1, 0, 0, 0, 0, 0, SPLIT=False, **common)
        return out
    part = torch.empty(N, Hq, num_splits, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(N, Hq, num_splits, dtype=torch.float32, device=q.device)
    strides = (*part.stride()[:3], *lse.stride()[:2])
    grid = (Hq, tiles_m * num_splits, meta.num_seqs)
    _prefill_kernel[grid](*args, part, lse, split_len, num_splits, *strides, SPLIT=True, **common)
    _merge_splits_kernel[(Hq, N)](
        part, lse, out, meta.query_start_loc, num_splits, v_factor, *strides,
        out.stride(0), out.stride(1), HEAD_DIM=D, D_PAD=d_pad, PER_TOKEN=True,
    )
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


def _decode(
    args: tuple,
    constants: dict,
    out: torch.Tensor,
    meta: AttentionMetadata,
    v_factor: float,
    kv_heads: int,
    max_seq_len: int,
    num_splits: int | None,
) -> None:
    """Launch the decode kernel; split-KV plus a merge when the batch is too small.
    ``max_seq_len``: the most keys any sequence attends to (its window, if shorter)."""
    num_seqs, q_heads, head_dim = meta.num_seqs, out.shape[1], out.shape[2]
    device = out.device
    if num_splits is None:
        num_splits = _default_splits(num_seqs * kv_heads, max_seq_len, device)
    # split s covers positions [s * split_len, (s + 1) * split_len) of every sequence's
    # context, or of its window
    block_n = constants["BLOCK_N"]
    split_len = triton.cdiv(triton.cdiv(max_seq_len, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_seq_len, split_len)
    group = q_heads // kv_heads
    grid = (kv_heads, num_splits, num_seqs)
    common = dict(GROUP=group, G_PAD=max(16, pow2(group)), **constants)
    if num_splits == 1:
        _decode_kernel[grid](*args, out, out, split_len, 0, 0, 0, 0, 0, SPLIT=False, **common)
        return
    part = torch.empty(num_seqs, q_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    lse = torch.empty(num_seqs, q_heads, num_splits, dtype=torch.float32, device=device)
    strides = (*part.stride()[:3], *lse.stride()[:2])
    _decode_kernel[grid](*args, part, lse, split_len, *strides, SPLIT=True, **common)
    _merge_splits_kernel[(q_heads, num_seqs)](
        part, lse, out, meta.query_start_loc, num_splits, v_factor,
        *strides, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, D_PAD=constants["D_PAD"], PER_TOKEN=False,
    )
