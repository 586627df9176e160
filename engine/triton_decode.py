"""The decode kernel of :mod:`engine.triton_attention` (every sequence has one new token).

One program per (kv head, split, sequence) whose ``GROUP`` query heads form the rows of one
tile; a long context (or window) is split into ``num_splits`` partitions whose partial
results :func:`engine.triton_split_kv.merge` merges (split-KV, so a small batch still fills
the GPU).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention import AttentionMetadata
from engine.triton_attend import as_dot, attend
from engine.triton_split_kv import Partials, default_splits, merge, split_keys
from engine.triton_support import pow2


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
    q = as_dot(q, q_ptr, DOT_FP32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc, m_i, l_i = attend(
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


def decode(
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
    ``args`` and ``constants``: the arguments :func:`engine.triton_attention.attention`
    gives both kernels. ``max_seq_len``: the most keys any sequence attends to (its
    window, if shorter)."""
    num_seqs, q_heads, head_dim = meta.num_seqs, out.shape[1], out.shape[2]
    device = out.device
    if num_splits is None:
        num_splits = default_splits(num_seqs * kv_heads, max_seq_len, device)
    # split s covers positions [s * split_len, (s + 1) * split_len) of every sequence's
    # context, or of its window
    split_len, num_splits = split_keys(max_seq_len, num_splits, constants["BLOCK_N"])
    group = q_heads // kv_heads
    grid = (kv_heads, num_splits, num_seqs)
    common = dict(GROUP=group, G_PAD=max(16, pow2(group)), **constants)
    if num_splits == 1:
        _decode_kernel[grid](*args, out, out, split_len, 0, 0, 0, 0, 0, SPLIT=False, **common)
        return
    partials = Partials.empty(num_seqs, q_heads, num_splits, head_dim, device)
    _decode_kernel[grid](*args, *partials, split_len, *partials.strides, SPLIT=True, **common)
    merge(partials, out, meta.query_start_loc, v_factor, constants["D_PAD"], per_token=False)
