"""The decoder's elementwise work as one kernel each on CUDA: the residual add fused with
RMSNorm, and rotary embedding applied in place to q and k.

Each function has a torch path (the CPU, and the reference) and a Triton kernel (CUDA, and
the CPU under ``TRITON_INTERPRET=1``, where the tests compare the two). The kernels round
where the torch path rounds, so in fp32 they agree to the last bits of a reduction and in
fp16/bf16 to one unit in the last place:

- :func:`add_rms_norm`: ``residual = x + residual`` in the model dtype, then
  ``weight * (residual / rms(residual))`` with the statistics in fp32, the normalized
  value rounded to the model dtype before the scale, as Llama's reference does.
- :func:`rope_`: ``x * cos + rotate_half(x) * sin`` per head, each product and the sum
  rounded to the model dtype, written over ``q`` and ``k`` (views into the fused qkv
  projection: rows strided, each head's ``D`` values contiguous).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def _use_kernel(x: torch.Tensor) -> bool:
    return x.is_cuda or bool(triton.knobs.runtime.interpret)


@triton.jit
def _round(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` to nearest-even. For bf16 with integer ops: the
    interpreter's own bf16 cast truncates (the compiled one rounds either way)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


# --- residual add + RMSNorm -------------------------------------------------------------


@triton.jit
def _add_rms_norm_kernel(
    X, R, W, OUT,
    stride_x, stride_r, stride_o,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # row * stride may pass 2**31 elements
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x = _round(x.to(tl.float32) + r.to(tl.float32), x.dtype)  # in the model dtype
        tl.store(R + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = _round(xf * rstd, x.dtype)
    w = tl.load(W + cols, mask=mask, other=0.0)
    out = _round(w.to(tl.float32) * normed.to(tl.float32), x.dtype)
    tl.store(OUT + row * stride_o + cols, out, mask=mask)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` for ``[N, hidden]`` rows; without a
    residual, ``(rms_norm(x), x)``. On the kernel path ``residual`` is updated in place."""
    if not _use_kernel(x):
        if residual is not None:
            x = x + residual
        return rms_norm_reference(x, weight, eps), x
    if x.dim() != 2 or x.stride(-1) != 1 or weight.shape != (x.shape[-1],):
        raise ValueError(f"add_rms_norm takes [N, hidden] rows, got {list(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError("residual must have x's shape, its rows contiguous")
    out = torch.empty_like(x)
    n, cols = x.shape
    if n:
        r = x if residual is None else residual
        _add_rms_norm_kernel[(n,)](
            x, r, weight, out, x.stride(0), r.stride(0), out.stride(0), cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(cols),
        )
    return out, (x if residual is None else residual)


# --- rotary embedding, in place ---------------------------------------------------------


@triton.jit
def _rope_kernel(
    Q, K, COS, SIN,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_cn,
    num_q_heads,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)  # token * stride may pass 2**31 elements
    head = tl.program_id(1)
    if head < num_q_heads:
        base = Q + token * stride_qn + head * stride_qh
    else:
        base = K + token * stride_kn + (head - num_q_heads) * stride_kh
    cols = tl.arange(0, BLOCK)
    mask = cols < HALF
    x1 = tl.load(base + cols, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + cols, mask=mask, other=0.0)
    dtype = x1.dtype
    c1 = tl.load(COS + token * stride_cn + cols, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + token * stride_cn + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + token * stride_cn + cols, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + token * stride_cn + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    a1, b1 = x1.to(tl.float32), x2.to(tl.float32)
    # each product and the sum rounded to the model dtype, as the torch path rounds
    f32 = tl.float32
    out1 = _round(_round(a1 * c1, dtype).to(f32) + _round(-b1 * s1, dtype).to(f32), dtype)
    out2 = _round(_round(b1 * c2, dtype).to(f32) + _round(a1 * s2, dtype).to(f32), dtype)
    tl.store(base + cols, out1, mask=mask)
    tl.store(base + HALF + cols, out2, mask=mask)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` is ``[N, H, D]``; ``cos``/``sin`` are ``[N, D]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


def rope_(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of ``q`` ``[N, Hq, D]`` and ``k`` ``[N, Hkv, D]``, in place on the
    kernel path (new tensors on the torch path); returns the rotated pair."""
    if not _use_kernel(q):
        return rope_reference(q, cos, sin), rope_reference(k, cos, sin)
    n, hq, d = q.shape
    if (
        k.shape[0] != n or k.shape[2] != d or d % 2
        or q.stride(-1) != 1 or k.stride(-1) != 1
        or cos.shape != (n, d) or sin.shape != (n, d) or cos.stride() != sin.stride()
        or cos.stride(-1) != 1 or q.dtype != k.dtype
    ):
        raise ValueError(
            f"rope_ takes q [N, Hq, D], k [N, Hkv, D] with contiguous heads and cos/sin [N, D], "
            f"got {list(q.shape)}, {list(k.shape)}, {list(cos.shape)}"
        )
    if n:
        _rope_kernel[(n, hq + k.shape[1])](
            q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
            hq, HALF=d // 2, BLOCK=triton.next_power_of_2(d // 2),
        )
    return q, k
