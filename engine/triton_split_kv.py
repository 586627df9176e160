"""Split-KV for the paged-attention kernels: when a step's grid is too small to fill the
GPU, each context is cut into splits attended by programs of their own, and a second kernel
merges their partial results (:func:`merge`).

A split's partial is its output normalized by its own softmax sum, with ``lse``, that sum's
log2 plus the running max (base 2, as :func:`engine.triton_attend.attend`). Split 0 starts
at the context's (or window's) first position: it is never empty.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# Fewest keys a decode split is given: below this the merge costs more than it saves.
MIN_SPLIT_TOKENS = 256


def split_count(programs: int, max_seq_len: int, sms: int) -> int:
    """How many splits bring a grid of ``programs`` to about two programs per SM, none
    shorter than MIN_SPLIT_TOKENS; 1 when the grid fills the GPU already."""
    target = 2 * sms
    if programs >= target:
        return 1
    return max(1, min(triton.cdiv(target, programs), max_seq_len // MIN_SPLIT_TOKENS))


def default_splits(programs: int, max_seq_len: int, device: torch.device) -> int:
    """Splits of each context for about two programs per SM (see :func:`split_count`)."""
    if device.type != "cuda":
        return 1
    return split_count(programs, max_seq_len, torch.cuda.get_device_properties(device).multi_processor_count)


def split_keys(max_seq_len: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """``(split_len, num_splits)``: whole key tiles of ``block_n`` per split, and as many
    splits as that takes to cover ``max_seq_len`` keys."""
    split_len = triton.cdiv(triton.cdiv(max_seq_len, num_splits), block_n) * block_n
    return split_len, triton.cdiv(max_seq_len, split_len)


class Partials(NamedTuple):
    """What the splits write and :func:`merge` reads."""

    out: torch.Tensor  # [rows, H, splits, D] fp32, each normalized by its own sum
    lse: torch.Tensor  # [rows, H, splits] fp32, log2 of that sum plus the max

    @staticmethod
    def empty(
        rows: int, heads: int, num_splits: int, head_dim: int, device: torch.device
    ) -> Partials:
        return Partials(
            torch.empty(rows, heads, num_splits, head_dim, dtype=torch.float32, device=device),
            torch.empty(rows, heads, num_splits, dtype=torch.float32, device=device),
        )

    @property
    def strides(self) -> tuple[int, ...]:
        """``stride_pb, stride_ph, stride_ps, stride_lb, stride_lh`` of the kernels."""
        return (*self.out.stride()[:3], *self.lse.stride()[:2])


# Left unspecialized as in engine.triton_decode._decode_kernel: no variant per split count.
@triton.jit(do_not_specialize=["num_splits", "stride_lb", "stride_lh"])
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


def merge(
    partials: Partials,
    out: torch.Tensor,  # [N, Hq, D]
    query_start_loc: torch.Tensor,
    v_factor: float,
    d_pad: int,
    *,
    per_token: bool,
) -> None:
    """Merge each row's splits into ``out``, times ``v_factor``. A row of ``partials`` is a
    sequence (decode: its one token at ``query_start_loc``) or, ``per_token``, a token."""
    rows, heads, num_splits, head_dim = partials.out.shape
    _merge_splits_kernel[(heads, rows)](
        partials.out, partials.lse, out, query_start_loc, num_splits, v_factor,
        *partials.strides, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, D_PAD=d_pad, PER_TOKEN=per_token,
    )
