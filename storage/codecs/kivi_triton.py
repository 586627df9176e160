"""Triton kernels for the KIVI codec: fused quantize + bit-pack, fused unpack + dequantize.

Both work on a 4-D view ``[n0, n1, n2, N]`` of the KV block with arbitrary strides — the
keys' ``[L, H, D, T]`` is a permuted view — so the block is read or written in place with
no transposed copy. Rows are the first three dims flattened; groups run along ``N``.

One program handles ``BLOCK_ROWS`` rows × one group. Its tile is ``[rows, NB, PER]``: a
group of ``GROUP`` codes is ``NB`` bytes of ``PER = 8 // bits`` codes each::

    group g:  col = g*GROUP + b*PER + p        b < NB,  p < PER
    byte  g*NB + b  of the row  =  Σ_p code[col] << (p * bits)

Columns past ``N`` (the tail group) are masked: they take no part in min/max and their
codes are zero. The arithmetic mirrors ``kivi._quantize_rows`` / ``_dequantize_rows`` op for
op (see ``storage/codecs/kivi.py``) so the payloads are byte-identical. bf16 is converted
with integer ops rather than casts, so the interpreter (``TRITON_INTERPRET=1``), whose
bf16 casts truncate, rounds to nearest-even like the GPU and torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from storage.codecs.kivi import FP16_MAX, GROUP, TRITON_DTYPES

BLOCK_ROWS = 64


@triton.jit
def _load_f32(ptrs, mask, IS_BF16: tl.constexpr):
    if IS_BF16:
        # bf16 is the top half of an fp32; the tensor is passed as int16
        bits = tl.load(ptrs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_f32(ptrs, y, mask, IS_BF16: tl.constexpr):
    if IS_BF16:
        # round to nearest even, as torch does for finite values
        u = y.to(tl.int32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        # NaN (from a payload whose scale or zero is NaN) as torch's CPU cast writes it:
        # rounding its bits could carry into -0 or inf
        u = tl.where(y == y, u, -1)
        tl.store(ptrs, u.to(tl.int16), mask=mask)
    else:
        tl.store(ptrs, y.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _tile(R, N, n1, n2, s0, s1, s2, sn, BITS: tl.constexpr, GROUP: tl.constexpr,
          BLOCK_R: tl.constexpr):
    """Row indices, element offsets and masks of this program's [BLOCK_R, NB, PER] tile."""
    PER: tl.constexpr = 8 // BITS
    NB: tl.constexpr = GROUP // PER
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    row_ok = rows < R
    i2 = rows % n2
    i1 = (rows // n2) % n1
    i0 = rows // (n2 * n1)
    base = i0 * s0 + i1 * s1 + i2 * s2
    byte = tl.program_id(1) * NB + tl.arange(0, NB)  # [NB] byte index within the row
    col = byte[:, None] * PER + tl.arange(0, PER)[None, :]  # [NB, PER]
    mask = row_ok[:, None, None] & (col < N)[None, :, :]
    offs = base[:, None, None] + col[None, :, :] * sn
    return rows, row_ok, byte, offs, mask


@triton.jit
def _quantize_pack_kernel(
    x_ptr, codes_ptr, scale_ptr, zero_ptr,
    R, N, n1, n2, s0, s1, s2, sn, row_bytes, groups,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_R: tl.constexpr, IS_BF16: tl.constexpr,
    FP16_MAX: tl.constexpr,
):
    QMAX: tl.constexpr = (1 << BITS) - 1
    PER: tl.constexpr = 8 // BITS
    rows, row_ok, byte, offs, mask = _tile(R, N, n1, n2, s0, s1, s2, sn, BITS, GROUP, BLOCK_R)
    g = tl.program_id(1)
    x = _load_f32(x_ptr + offs, mask, IS_BF16)  # [BLOCK_R, NB, PER]
    x = tl.where(x == x, x, 0.0)  # NaN reads as 0
    lo = tl.min(tl.min(tl.where(mask, x, float("inf")), axis=2), axis=1)
    hi = tl.max(tl.max(tl.where(mask, x, float("-inf")), axis=2), axis=1)
    lo = tl.where(row_ok & (lo != 0), lo, 0.0)  # a zero min is +0
    hi = tl.where(row_ok, hi, 0.0)
    span = tl.where(hi > lo, hi - lo, 0.0)  # not inf - inf in a group of one infinity
    scale = tl.minimum(span * (1.0 / QMAX), FP16_MAX).to(tl.float16)
    zero = tl.minimum(tl.maximum(lo, -FP16_MAX), FP16_MAX).to(tl.float16)
    s = scale.to(tl.float32)
    s = tl.where(s > 0, s, 1.0)
    z = zero.to(tl.float32)
    v = tl.math.div_rn(x - z[:, None, None], s[:, None, None])
    v = tl.minimum(tl.maximum(v, 0.0), QMAX)
    q = tl.where(mask, (v + 0.5).to(tl.int32), 0)
    shifts = tl.arange(0, PER) * BITS
    packed = tl.sum(q << shifts[None, None, :], axis=2)  # [BLOCK_R, NB]
    byte_ok = row_ok[:, None] & (byte < row_bytes)[None, :]
    tl.store(codes_ptr + rows[:, None] * row_bytes + byte[None, :], packed.to(tl.uint8), mask=byte_ok)
    tl.store(scale_ptr + rows * groups + g, scale, mask=row_ok)
    tl.store(zero_ptr + rows * groups + g, zero, mask=row_ok)


@triton.jit
def _unpack_dequantize_kernel(
    codes_ptr, scale_ptr, zero_ptr, out_ptr,
    R, N, n1, n2, s0, s1, s2, sn, row_bytes, groups,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_R: tl.constexpr, IS_BF16: tl.constexpr,
):
    QMAX: tl.constexpr = (1 << BITS) - 1
    PER: tl.constexpr = 8 // BITS
    rows, row_ok, byte, offs, mask = _tile(R, N, n1, n2, s0, s1, s2, sn, BITS, GROUP, BLOCK_R)
    g = tl.program_id(1)
    byte_ok = row_ok[:, None] & (byte < row_bytes)[None, :]
    packed = tl.load(codes_ptr + rows[:, None] * row_bytes + byte[None, :], mask=byte_ok, other=0)
    shifts = tl.arange(0, PER) * BITS
    q = (packed.to(tl.int32)[:, :, None] >> shifts[None, None, :]) & QMAX  # [BLOCK_R, NB, PER]
    s = tl.load(scale_ptr + rows * groups + g, mask=row_ok, other=0.0).to(tl.float32)
    z = tl.load(zero_ptr + rows * groups + g, mask=row_ok, other=0.0).to(tl.float32)
    # q * s is exact (≤4-bit integer × fp16), so a fused multiply-add rounds the same.
    y = q.to(tl.float32) * s[:, None, None] + z[:, None, None]
    _store_f32(out_ptr + offs, y, mask, IS_BF16)


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def _check_rows(x: torch.Tensor, name: str) -> None:
    if x.dim() != 4:
        raise ValueError(f"{name} must be a 4-D view [n0, n1, n2, N], got {list(x.shape)}")
    if x.dtype not in TRITON_DTYPES:
        raise ValueError(f"{name}: the KIVI kernels take fp16, bf16 or fp32, got {x.dtype}")
    if not (x.is_cuda or _interpreting()):
        raise ValueError(f"{name} must be on a CUDA device (or run under TRITON_INTERPRET=1)")
    if any(s < 0 for s in x.stride()):
        raise ValueError(f"{name} has negative strides {x.stride()}")
    span = sum((n - 1) * s for n, s in zip(x.shape, x.stride())) + 1
    if span >= 2**31:
        raise ValueError(f"{name} spans {span} elements; the kernels index with int32")


def _check_meta(
    t: torch.Tensor, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the block on {device}")


def _geometry(
    x: torch.Tensor, bits: int, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> tuple[tuple[int, int], tuple[int, ...]]:
    """The grid and the scalar kernel arguments after checking every tensor."""
    _check_rows(x, "block view")
    n0, n1, n2, N = x.shape
    groups = -(-N // GROUP)
    row_bytes = -(-N * bits // 8)
    _check_meta(codes, "codes", (n0, n1, n2, row_bytes), torch.uint8, x.device)
    _check_meta(scale, "scale", (n0, n1, n2, groups), torch.float16, x.device)
    _check_meta(zero, "zero", (n0, n1, n2, groups), torch.float16, x.device)
    R = n0 * n1 * n2
    grid = (triton.cdiv(R, BLOCK_ROWS), groups)
    return grid, (R, N, n1, n2, *x.stride(), row_bytes, groups)


def _as_kernel_dtype(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def quantize_pack(
    x: torch.Tensor, bits: int, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> None:
    """Quantize ``x`` ``[n0, n1, n2, N]`` (any strides) in groups along ``N``.

    Writes packed codes ``[n0, n1, n2, ceil(N*bits/8)]`` (u8) and fp16 scales and zeros
    ``[n0, n1, n2, ceil(N/32)]``, all contiguous and on ``x``'s device.
    """
    if bits not in (2, 4):
        raise ValueError(f"KIVI codes are 2 or 4 bits, got {bits}")
    grid, args = _geometry(x, bits, codes, scale, zero)
    _quantize_pack_kernel[grid](
        _as_kernel_dtype(x), codes, scale, zero, *args,
        BITS=bits, GROUP=GROUP, BLOCK_R=BLOCK_ROWS, IS_BF16=x.dtype == torch.bfloat16,
        FP16_MAX=FP16_MAX,
    )


def unpack_dequantize(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, out: torch.Tensor
) -> None:
    """The inverse of :func:`quantize_pack`: writes the decoded values into ``out`` (any strides)."""
    if bits not in (2, 4):
        raise ValueError(f"KIVI codes are 2 or 4 bits, got {bits}")
    grid, args = _geometry(out, bits, codes, scale, zero)
    _unpack_dequantize_kernel[grid](
        codes, scale, zero, _as_kernel_dtype(out), *args,
        BITS=bits, GROUP=GROUP, BLOCK_R=BLOCK_ROWS, IS_BF16=out.dtype == torch.bfloat16,
    )
