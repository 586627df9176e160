"""The Triton kernel that writes a step's new K/V into their cache slots (CUDA).

:func:`write_kv` implements :func:`engine.attention.write_kv` on the layer view of the
block-major cache (see :mod:`engine.triton_attention` for the layout the kernels share). A
cache of the inputs' dtype gets a bit copy; an fp8 cache gets ``x / scale`` clamped to the
fp8 range and rounded to nearest-even with integer ops, so the bytes equal the torch path's
on any GPU and in the interpreter (whose own fp8 casts do not round to nearest-even).
Tested against the torch path under ``TRITON_INTERPRET=1`` (tests/test_triton_attention.py).
"""
from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from engine.attention import KVScales
from engine.triton_support import (
    FP8_FORMATS,
    QUERY_DTYPES,
    check_cache,
    check_device,
    check_index,
    check_kernel_device,
    pow2,
)


@triton.jit
def _fp32_to_fp8_bits(y, MAN: tl.constexpr, BIAS: tl.constexpr, MAX_BITS: tl.constexpr):
    """fp32 -> fp8 byte: clamp to ±max, round to nearest-even; NaN stays NaN."""
    u = y.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    a = tl.minimum(u & 0x7FFFFFFF, MAX_BITS)  # |y| clamped, as bits (monotonic for non-NaN)
    # normal fp8: drop SHIFT mantissa bits with round-to-nearest-even; a carry bumps the
    # exponent, which is right. Then re-bias the exponent from 127 to BIAS.
    SHIFT: tl.constexpr = 23 - MAN
    r = (a + ((1 << (SHIFT - 1)) - 1) + ((a >> SHIFT) & 1)) >> SHIFT
    normal = r - ((127 - BIAS) << MAN)
    # subnormal fp8: |y| / 2**(1 - BIAS - MAN), an integer 0..2**MAN after rounding, is the
    # 24-bit significand shifted right by s; s is capped where the result is 0 anyway.
    s = tl.minimum(tl.maximum((SHIFT + 128 - BIAS) - (a >> 23), 1), 30)
    sig = (a & 0x7FFFFF) | 0x800000
    q = sig >> s
    rem = sig & ((1 << s) - 1)
    half = 1 << (s - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    bits = tl.where(a < ((128 - BIAS) << 23), q, normal)
    bits = tl.where(is_nan, 0x7F, bits) | sign
    return bits.to(tl.uint8)


@triton.jit
def _load_fp32(ptrs, mask, SRC_BF16: tl.constexpr):
    if SRC_BF16:
        # bf16 is the top half of an fp32; the tensor is passed as int16
        bits = tl.load(ptrs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        x = (bits << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr,
    k_scale, v_scale, num_slots, num_heads,
    stride_kn, stride_kh, stride_vn, stride_vh, stride_blk, stride_tok, stride_head, v_offset,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
    FP8: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr, MAX_BITS: tl.constexpr,
    SRC_BF16: tl.constexpr,
):
    n = tl.program_id(0)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, D_PAD)
    mask = (h < num_heads)[:, None] & (d < HEAD_DIM)[None, :]
    k_src = k_ptr + n.to(tl.int64) * stride_kn + h[:, None] * stride_kh + d[None, :]
    v_src = v_ptr + n.to(tl.int64) * stride_vn + h[:, None] * stride_vh + d[None, :]
    # blocks need not be adjacent (a layer's view skips the other layers' parts of a block)
    dst = (
        cache_ptr + (slot // BLOCK_SIZE) * stride_blk + (slot % BLOCK_SIZE) * stride_tok
        + h[:, None] * stride_head + d[None, :]
    )
    if FP8:
        k = tl.math.div_rn(_load_fp32(k_src, mask, SRC_BF16), k_scale)
        v = tl.math.div_rn(_load_fp32(v_src, mask, SRC_BF16), v_scale)
        tl.store(dst, _fp32_to_fp8_bits(k, MAN, BIAS, MAX_BITS), mask=mask)
        tl.store(dst + v_offset, _fp32_to_fp8_bits(v, MAN, BIAS, MAX_BITS), mask=mask)
    else:
        # same dtype: the tensors are passed as same-width integers and copied bit for bit
        tl.store(dst, tl.load(k_src, mask=mask), mask=mask)
        tl.store(dst + v_offset, tl.load(v_src, mask=mask), mask=mask)


# --- attention: shared pieces ------------------------------------------------------------


def _fp8_max_bits(dtype: torch.dtype) -> int:
    return struct.unpack("<i", struct.pack("<f", torch.finfo(dtype).max))[0]


def write_kv(
    k: torch.Tensor,  # [N, H, D]
    v: torch.Tensor,  # [N, H, D]
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, H, D], may be a strided view
    slot_mapping: torch.Tensor,  # [N]
    scales: KVScales = KVScales(),
) -> None:
    """Store new keys and values into their cache slots; see :func:`engine.attention.write_kv`.

    ``k`` and ``v`` may be strided views (e.g. slices of a fused QKV projection) as long as
    their last dim is contiguous. Slots outside the cache are skipped rather than written.
    """
    check_kernel_device(k, "k")
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [N, H, D], got {list(k.shape)} and {list(v.shape)}")
    if k.dtype != v.dtype or k.dtype not in QUERY_DTYPES:
        raise ValueError(f"k and v must both be fp16, bf16 or fp32, got {k.dtype} and {v.dtype}")
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("k and v must be contiguous in their last dim")
    check_device(v, "v", k.device)
    check_cache(layer_cache, k.device)
    N, H, D = k.shape
    if tuple(layer_cache.shape[3:]) != (H, D):
        raise ValueError(f"layer_cache holds [H, D] = {list(layer_cache.shape[3:])}, k is {[H, D]}")
    check_index(slot_mapping, "slot_mapping", (N,), k.device)
    fp8 = FP8_FORMATS.get(layer_cache.dtype)
    if fp8 is None and layer_cache.dtype != k.dtype:
        dtype = layer_cache.dtype
        raise ValueError(f"a {dtype} cache needs {dtype} k and v, got {k.dtype}")
    if N == 0:
        return

    d_pad = pow2(D)
    block_h = min(pow2(H), max(1, 4096 // d_pad))
    if fp8 is not None:
        _, man, bias = fp8
        cache = layer_cache.view(torch.uint8)
        src_bf16 = k.dtype == torch.bfloat16
        k_arg, v_arg = (k.view(torch.int16), v.view(torch.int16)) if src_bf16 else (k, v)
        max_bits = _fp8_max_bits(layer_cache.dtype)
    else:
        man, bias, max_bits, src_bf16 = 0, 0, 0, False
        as_int = {2: torch.int16, 4: torch.int32}[k.element_size()]
        cache, k_arg, v_arg = layer_cache.view(as_int), k.view(as_int), v.view(as_int)
    grid = (N, triton.cdiv(H, block_h))
    _write_kv_kernel[grid](
        k_arg, v_arg, cache, slot_mapping,
        float(scales.k), float(scales.v), layer_cache.shape[1] * layer_cache.shape[2], H,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        layer_cache.stride(1), layer_cache.stride(2), layer_cache.stride(3), layer_cache.stride(0),
        BLOCK_SIZE=layer_cache.shape[2], HEAD_DIM=D, D_PAD=d_pad, BLOCK_H=block_h,
        FP8=fp8 is not None, MAN=man, BIAS=bias, MAX_BITS=max_bits, SRC_BF16=src_bf16,
    )
