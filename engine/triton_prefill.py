"""The prefill kernel of :mod:`engine.triton_attention` (any step that is not decode only).

One program per (query head, tile of ``BLOCK_M`` new tokens, sequence), first over the key
tiles every row of the tile sees, then over the causal diagonal with a mask. When that
grid is too small to fill the GPU (a few new tokens over a long cached prefix: a prefix
hit), the keys every row sees are split likewise and
:func:`engine.triton_split_kv.merge` merges the partials per token.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention import AttentionMetadata
from engine.triton_attend import as_dot, attend
from engine.triton_split_kv import Partials, default_splits, merge, split_keys
from engine.triton_support import pow2


# left unspecialized as in engine.triton_decode._decode_kernel
@triton.jit(do_not_specialize=["stride_bt", "num_splits", "stride_lb", "stride_lh"])
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
    q = as_dot(q, q_ptr, DOT_FP32)
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
        acc, m_i, l_i = attend(
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
        acc, m_i, l_i = attend(
            acc, m_i, l_i, q, q_ptr, pos, cache_ptr, bt_row, head_off, lo, hi, qk_scale,
            softcap, window, stride_blk, stride_tok, v_offset,
            BLOCK_SIZE, HEAD_DIM, D_PAD, BLOCK_N, FP8, DOT_FP32, PRECISION, 0, SOFTCAP,
        )
        acc, m_i, l_i = attend(
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


def prefill(
    args: tuple,
    constants: dict,
    out: torch.Tensor,
    meta: AttentionMetadata,
    v_factor: float,
    kv_heads: int,
    max_block_m: int,
    warps: int,
    num_splits: int | None,
) -> None:
    """Launch the prefill kernel; split-KV plus a merge per token when the grid is too
    small (never within a window: it reads few keys anyway). ``args`` and ``constants``:
    the arguments :func:`engine.triton_attention.attention` gives both kernels;
    ``max_block_m`` and ``warps``: the tile of new tokens and its warps, for a long step."""
    N, Hq, D = out.shape
    max_seq_len = meta.max_seq_len
    block_m = min(max_block_m, max(16, pow2(meta.max_query_len)))
    tiles_m = triton.cdiv(meta.max_query_len, block_m)
    warps = warps if block_m >= 32 else 4
    common = dict(GROUP=Hq // kv_heads, BLOCK_M=block_m, num_warps=warps, **constants)
    # a few new tokens over a long context (a prefix hit) leave most SMs idle: split the keys
    # every row sees, as decode does
    if constants["WINDOW"]:
        num_splits = 1
    elif num_splits is None:
        num_splits = default_splits(Hq * tiles_m * meta.num_seqs, max_seq_len, out.device)
    if num_splits > 1:
        split_len, num_splits = split_keys(max_seq_len, num_splits, constants["BLOCK_N"])
    if num_splits == 1:
        grid = (Hq, tiles_m, meta.num_seqs)
        _prefill_kernel[grid](*args, out, out, 0, 1, 0, 0, 0, 0, 0, SPLIT=False, **common)
        return
    partials = Partials.empty(N, Hq, num_splits, D, out.device)
    grid = (Hq, tiles_m * num_splits, meta.num_seqs)
    _prefill_kernel[grid](*args, *partials, split_len, num_splits, *partials.strides, SPLIT=True,
                          **common)
    merge(partials, out, meta.query_start_loc, v_factor, constants["D_PAD"], per_token=True)
