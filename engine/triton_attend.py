"""What the paged-attention kernels share (:mod:`engine.triton_decode`,
:mod:`engine.triton_prefill`): the online softmax of a tile of queries over a range of
cached keys (:func:`attend`), and exact fp8 decoding.

Keys are gathered per token through the block table, so a key tile may span several cache
blocks or part of one. Head dims that are not a power of two are zero-padded in registers.
The softmax is in base 2 with fp32 accumulation; fp16/bf16 dots run on tensor cores
(probabilities rounded to q's dtype before P·V), fp32 dots as 3xTF32. An fp8 cache is
decoded exactly into fp16 (:func:`_fp8_to_fp16`); its scales are folded in by the callers.
"""
from __future__ import annotations

import triton
import triton.language as tl


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
def as_dot(x, q_ptr, DOT_FP32: tl.constexpr):
    """``x`` in the dtype the dots take: fp32, or q's."""
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
def attend(
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
        k = as_dot(k, q_ptr, DOT_FP32)
        v = as_dot(v, q_ptr, DOT_FP32)
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
        p = as_dot(p, q_ptr, DOT_FP32)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i
