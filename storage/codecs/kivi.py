"""``kivi2`` / ``kivi4``: KIVI asymmetric quantization of a KV block (lossy, opt-in).

Keys are quantized per channel — for every (layer, head, channel) the block's tokens form
the groups — and values per token — for every (layer, token, head) the head dim is cut into
groups. Groups are ``GROUP`` (32) elements along that axis; the last one is shorter when the
axis is not a multiple of 32 (a 16-token block gives 16-element key groups). Each group gets
an fp16 scale and zero point::

    zero  = fp16(min)                    scale = fp16((max - min) * fp32(1 / qmax))
    code  = trunc(clamp((x - zero) / scale, 0, qmax) + 0.5)    (scale 0 divides by 1)
    x'    = code * scale + zero          computed in fp32, cast to the block's dtype

``qmax = 2**bits - 1``. Every step is a single IEEE fp32 operation on values read back from
fp16, and ``code * scale`` is exact (a ≤4-bit integer times an 11-bit significand), so the
torch path on any device and the Triton path give identical bytes and identical tensors.
Values beyond the fp16 range saturate to ±65504. Non-finite inputs (a block holding them is
already broken) have one defined encoding: NaN reads as 0; ``max - min`` is taken as 0
when ``max == min`` (a group of one infinity, where it would be NaN); a zero ``min`` is +0.
So every scale and zero is finite and no finite value decodes to NaN (docs/codecs.md).

Payload of a ``[L, 2, T, H, D]`` block, ``Gk = ceil(T/32)``, ``Gv = ceil(D/32)``::

    fp16  key scales    [L, H, D, Gk]  ┐
    fp16  key zeros     [L, H, D, Gk]  │ section 1 (2-byte elements)
    fp16  value scales  [L, T, H, Gv]  │
    fp16  value zeros   [L, T, H, Gv]  ┘
    u8    key codes     [L, H, D, ceil(T * bits / 8)]  ┐ section 2 (bytes)
    u8    value codes   [L, T, H, ceil(D * bits / 8)]  ┘

Codes are packed little-end first: code ``j`` of a row sits in byte ``j // (8 // bits)`` at
bit ``(j % (8 // bits)) * bits``; the last byte of a row is zero-padded where needed.

Metadata cost: 32 bits (scale + zero) per group. Values: 1 bit/value for D a multiple of 32.
Keys: 32 / min(T, 32) bits/value — 2 bits/value at block size 16, 1 bit/value at 32.
"""
from __future__ import annotations

import functools
import math
from types import ModuleType
from typing import NamedTuple

import numpy as np
import torch

from storage.codecs.base import CodecError, Section, TensorCodec, check_kv_dtype

GROUP = 32
FP16_MAX = 65504.0
# Dtypes the Triton kernels read and write; others take the torch path on any device.
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class KiviLayout(NamedTuple):
    """Sizes of one block's payload, derived from its shape and the bit width."""

    L: int
    T: int
    H: int
    D: int
    bits: int

    @property
    def key_groups(self) -> int:
        return -(-self.T // GROUP)

    @property
    def value_groups(self) -> int:
        return -(-self.D // GROUP)

    @property
    def key_row_bytes(self) -> int:
        return -(-self.T * self.bits // 8)

    @property
    def value_row_bytes(self) -> int:
        return -(-self.D * self.bits // 8)

    @property
    def key_meta(self) -> int:
        """Elements in each of the key scale and key zero arrays."""
        return self.L * self.H * self.D * self.key_groups

    @property
    def value_meta(self) -> int:
        return self.L * self.T * self.H * self.value_groups

    @property
    def meta_bytes(self) -> int:
        return 2 * 2 * (self.key_meta + self.value_meta)

    @property
    def code_bytes(self) -> int:
        return (
            self.L * self.H * self.D * self.key_row_bytes
            + self.L * self.T * self.H * self.value_row_bytes
        )

    @property
    def nbytes(self) -> int:
        return self.meta_bytes + self.code_bytes

    def views(self, buf: torch.Tensor) -> KiviViews:
        """Typed views of a payload buffer: ``[..., nbytes]`` uint8 (one payload per row;
        rows must start at even offsets), viewed as ``[..., L, H, D, Gk]`` and so on."""
        L, T, H, D = self.L, self.T, self.H, self.D
        lead = tuple(buf.shape[:-1])
        meta = buf[..., : self.meta_bytes].view(torch.float16)
        k, v = self.key_meta, self.value_meta
        codes = buf[..., self.meta_bytes :]
        kc = L * H * D * self.key_row_bytes
        return KiviViews(
            key_scale=meta[..., :k].view(*lead, L, H, D, self.key_groups),
            key_zero=meta[..., k : 2 * k].view(*lead, L, H, D, self.key_groups),
            value_scale=meta[..., 2 * k : 2 * k + v].view(*lead, L, T, H, self.value_groups),
            value_zero=meta[..., 2 * k + v :].view(*lead, L, T, H, self.value_groups),
            key_codes=codes[..., :kc].view(*lead, L, H, D, self.key_row_bytes),
            value_codes=codes[..., kc:].view(*lead, L, T, H, self.value_row_bytes),
        )


class KiviViews(NamedTuple):
    key_scale: torch.Tensor  # [L, H, D, Gk] fp16
    key_zero: torch.Tensor
    value_scale: torch.Tensor  # [L, T, H, Gv] fp16
    value_zero: torch.Tensor
    key_codes: torch.Tensor  # [L, H, D, ceil(T*bits/8)] u8
    value_codes: torch.Tensor  # [L, T, H, ceil(D*bits/8)] u8


def kivi_layout(shape: tuple[int, ...], bits: int) -> KiviLayout:
    if len(shape) != 5 or shape[1] != 2 or min(shape) <= 0:
        raise ValueError(f"KIVI takes a KV block [L, 2, T, H, D], got shape {list(shape)}")
    L, _, T, H, D = shape
    return KiviLayout(L, T, H, D, bits)


# The two quantization axes, as 4-D views [*rows, N] of a [L, 2, T, H, D] block.
def key_rows(kv: torch.Tensor) -> torch.Tensor:
    return kv[:, 0].permute(0, 2, 3, 1)  # [L, H, D, T]


def value_rows(kv: torch.Tensor) -> torch.Tensor:
    return kv[:, 1]  # [L, T, H, D]


@functools.cache
def _triton() -> ModuleType | None:
    try:
        from storage.codecs import kivi_triton
    except ImportError:
        return None
    return kivi_triton


def _backend(t: torch.Tensor, dtype: torch.dtype, backend: str | None) -> str:
    if backend == "triton" and _triton() is None:
        raise ValueError("the triton backend was asked for but triton is not importable")
    if backend is not None:
        if backend not in ("torch", "triton"):
            raise ValueError(f"backend is 'torch' or 'triton', got {backend!r}")
        return backend
    if t.is_cuda and dtype in TRITON_DTYPES and _triton() is not None:
        return "triton"
    return "torch"


def quantize_block(kv: torch.Tensor, bits: int, backend: str | None = None) -> torch.Tensor:
    """The KIVI payload of ``kv`` ``[L, 2, T, H, D]`` as a 1-D uint8 tensor on ``kv``'s device.

    ``backend`` picks the implementation ("torch" or "triton"); by default Triton is used
    for CUDA tensors when it is importable.
    """
    lay = kivi_layout(tuple(kv.shape), bits)
    buf = torch.empty(lay.meta_bytes + lay.code_bytes, dtype=torch.uint8, device=kv.device)
    out = lay.views(buf)
    if _backend(kv, kv.dtype, backend) == "triton":
        kernels = _triton()
        kernels.quantize_pack(key_rows(kv), bits, out.key_codes, out.key_scale, out.key_zero)
        kernels.quantize_pack(value_rows(kv), bits, out.value_codes, out.value_scale, out.value_zero)
        return buf
    for rows, codes, scale, zero in (
        (key_rows(kv), out.key_codes, out.key_scale, out.key_zero),
        (value_rows(kv), out.value_codes, out.value_scale, out.value_zero),
    ):
        q, s, z = _quantize_rows(rows.reshape(-1, rows.shape[-1]), bits)
        codes.view(-1, codes.shape[-1]).copy_(_pack(q, bits))
        scale.view(-1, scale.shape[-1]).copy_(s)
        zero.view(-1, zero.shape[-1]).copy_(z)
    return buf


def dequantize_block(
    buf: torch.Tensor,
    bits: int,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    backend: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode a payload (1-D uint8 tensor) into a ``[L, 2, T, H, D]`` tensor on its device:
    ``out`` (of that dtype and shape) if given, else a new one."""
    lay = kivi_layout(shape, bits)
    src = lay.views(buf)
    if out is not None and (out.dtype != dtype or tuple(out.shape) != tuple(shape)):
        raise ValueError(f"out is {out.dtype}{list(out.shape)}, the block {dtype}{list(shape)}")
    kv = torch.empty(shape, dtype=dtype, device=buf.device) if out is None else out
    if _backend(buf, dtype, backend) == "triton":
        kernels = _triton()
        kernels.unpack_dequantize(src.key_codes, src.key_scale, src.key_zero, bits, key_rows(kv))
        kernels.unpack_dequantize(
            src.value_codes, src.value_scale, src.value_zero, bits, value_rows(kv)
        )
        return kv
    for codes, scale, zero, rows in (
        (src.key_codes, src.key_scale, src.key_zero, key_rows(kv)),
        (src.value_codes, src.value_scale, src.value_zero, value_rows(kv)),
    ):
        n = rows.shape[-1]
        q = _unpack(codes.reshape(-1, codes.shape[-1]), bits, n)
        x = _dequantize_rows(q, scale.reshape(-1, scale.shape[-1]), zero.reshape(-1, zero.shape[-1]))
        rows.copy_(x.view(rows.shape).to(dtype))
    return kv


def quantize_blocks(
    blocks: torch.Tensor, bits: int, out: torch.Tensor, backend: str | None = None
) -> None:
    """Quantize a batch ``[n, L, 2, T, H, D]`` into ``out`` ``[n, payload]`` (uint8, same
    device): row ``i`` is byte for byte :func:`quantize_block` of block ``i``.

    The batch is quantized as one block of ``n * L`` layers (every row of the quantizer
    lies within one layer of one block), then its sections are copied to the rows.
    """
    n, L = blocks.shape[:2]
    lay, joint = _batch_layouts(tuple(blocks.shape), bits, out)
    if lay.nbytes % 2:  # rows at odd offsets have no fp16 views: one block at a time
        for i in range(n):
            out[i].copy_(quantize_block(blocks[i], bits, backend))
        return
    payload = quantize_block(blocks.reshape(n * L, *blocks.shape[2:]), bits, backend)
    for whole, rows in zip(joint.views(payload), lay.views(out)):
        rows.copy_(whole.view(rows.shape))


def dequantize_blocks(
    payloads: torch.Tensor, bits: int, out: torch.Tensor, backend: str | None = None
) -> None:
    """The inverse of :func:`quantize_blocks`: decode ``payloads`` ``[n, payload]`` into
    ``out`` ``[n, L, 2, T, H, D]`` (contiguous, on the payloads' device)."""
    n, L = out.shape[:2]
    lay, joint = _batch_layouts(tuple(out.shape), bits, payloads)
    if not out.is_contiguous():
        raise ValueError("dequantize_blocks writes into a contiguous batch")
    if lay.nbytes % 2:
        for i in range(n):
            dequantize_block(payloads[i].clone(), bits, out.dtype, tuple(out.shape[1:]), backend, out[i])
        return
    whole = torch.empty(joint.nbytes, dtype=torch.uint8, device=payloads.device)
    for section, rows in zip(joint.views(whole), lay.views(payloads)):
        section.view(rows.shape).copy_(rows)
    shape = (n * L, *out.shape[2:])
    dequantize_block(whole, bits, out.dtype, shape, backend, out.view(shape))


def _batch_layouts(
    shape: tuple[int, ...], bits: int, payloads: torch.Tensor
) -> tuple[KiviLayout, KiviLayout]:
    """The layout of one block of a batch ``shape`` ``[n, L, 2, T, H, D]``, and of the batch
    seen as one block of ``n * L`` layers, after checking ``payloads`` ``[n, payload]``."""
    if len(shape) != 6:
        raise ValueError(f"a batch of KV blocks is [n, L, 2, T, H, D], got {list(shape)}")
    n, L, *block = shape
    lay = kivi_layout((L, *block), bits)
    if tuple(payloads.shape) != (n, lay.nbytes) or payloads.dtype != torch.uint8:
        raise ValueError(
            f"payloads must be uint8 [{n}, {lay.nbytes}], got {payloads.dtype}{list(payloads.shape)}"
        )
    return lay, kivi_layout((n * L, *block), bits)


def _quantize_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes ``[R, N]`` (u8, unpacked), scales and zeros ``[R, G]`` (fp16) of rows ``[R, N]``."""
    R, N = x.shape
    G = -(-N // GROUP)
    x = x.float().nan_to_num(0.0, math.inf, -math.inf)  # NaN reads as 0; infinities stay
    if G * GROUP != N:
        # Repeating the last element leaves the tail group's min and max unchanged.
        x = torch.cat([x, x[:, -1:].expand(R, G * GROUP - N)], dim=1)
    g = x.view(R, G, GROUP)
    qmax = (1 << bits) - 1
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)  # [R, G]
    # A zero min is +0, whichever zero the reduction met first, so that every device
    # writes the same bytes. hi > lo is false in a group of one infinity, where hi - lo
    # would be NaN: it is a constant group.
    lo = torch.where(lo == 0, 0.0, lo)
    span = torch.where(hi > lo, hi - lo, 0.0)
    # A multiply, not a division: torch's CUDA kernels turn division by a scalar into a
    # reciprocal multiply, which would round differently from the CPU and from Triton.
    scale = (span * (1.0 / qmax)).clamp(max=FP16_MAX).half()
    zero = lo.clamp(-FP16_MAX, FP16_MAX).half()
    s, z = scale.float(), zero.float()
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = ((g - z[..., None]) / s[..., None]).clamp_(0, qmax).add_(0.5).to(torch.uint8)
    return q.view(R, G * GROUP)[:, :N], scale, zero


def _dequantize_rows(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """fp32 ``[R, N]`` from codes ``[R, N]`` and fp16 scales and zeros ``[R, G]``."""
    R, N = q.shape
    G = scale.shape[1]
    if G * GROUP == N:  # whole groups: broadcast each group's scale and zero, no copies
        x = q.reshape(R, G, GROUP).float().mul_(scale.float()[..., None])
        return x.add_(zero.float()[..., None]).view(R, N)
    s = scale.float().repeat_interleave(GROUP, dim=1)[:, :N]
    z = zero.float().repeat_interleave(GROUP, dim=1)[:, :N]
    return q.float().mul_(s).add_(z)


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[R, N]`` -> bytes ``[R, ceil(N * bits / 8)]``, ``8 // bits`` codes per byte."""
    per = 8 // bits
    R, N = q.shape
    nbytes = -(-N // per)
    if nbytes * per != N:
        q = torch.cat([q, q.new_zeros(R, nbytes * per - N)], dim=1)
    q = q.view(R, nbytes, per)
    out = q[..., 0].clone()
    for j in range(1, per):
        out |= q[..., j] << (j * bits)
    return out


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Bytes ``[R, B]`` -> codes ``[R, n]`` (u8)."""
    mask = (1 << bits) - 1
    # One elementwise op per code position (a broadcast shift is several times slower on
    # the CPU); the top code needs no mask.
    parts = [packed & mask] + [(packed >> shift) & mask for shift in range(bits, 8 - bits, bits)]
    q = torch.stack([*parts, packed >> (8 - bits)], dim=-1)  # [R, B, per]
    return q.view(packed.shape[0], -1)[:, :n]


class KiviCodec(TensorCodec):
    """KIVI with ``bits`` (2 or 4) bit codes; see the module docstring for the format."""

    lossless = False

    def __init__(self, bits: int) -> None:
        if bits not in (2, 4):
            raise ValueError(f"KIVI codes are 2 or 4 bits, got {bits}")
        self.bits = bits
        self.name = f"kivi{bits}"

    def layout(self, dtype: torch.dtype, shape: tuple[int, ...]) -> list[Section]:
        check_kv_dtype(dtype, self.name, CodecError)
        try:
            lay = kivi_layout(shape, self.bits)
        except ValueError as e:
            raise CodecError(str(e)) from None
        return [Section(lay.meta_bytes, 2), Section(lay.code_bytes, 1)]

    def encode_array(self, kv: torch.Tensor) -> np.ndarray:
        check_kv_dtype(kv.dtype, self.name)
        return quantize_block(kv.detach(), self.bits).cpu().numpy()

    def encode_blocks(self, blocks: torch.Tensor, out: torch.Tensor) -> None:
        check_kv_dtype(blocks.dtype, self.name)
        quantize_blocks(blocks.detach(), self.bits, out)

    def decode_blocks(self, payloads: torch.Tensor, out: torch.Tensor) -> None:
        dequantize_blocks(payloads, self.bits, out)

    def decode_array(
        self, buf: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device | str
    ) -> torch.Tensor:
        # One copy: a tensor we own (buf may be read-only), moved to the device in one go.
        payload = torch.from_numpy(buf.copy()).to(device)
        return dequantize_block(payload, self.bits, dtype, tuple(shape))

