"""Paged attention: the one place where the model meets the KV cache.

The KV cache is one block-major tensor ``[num_blocks, L, 2, block_size, kv_heads, head_dim]``;
each layer gets the strided view :func:`engine.kv_cache.layer_view` of shape
``[2, num_blocks, block_size, H, D]``, in which only each block's ``[block_size, H, D]`` is
contiguous. Everything here reads and writes through that view.
A step runs a flattened batch: ``N`` new tokens from ``B`` sequences, sequence ``b``
owning rows ``query_start_loc[b] : query_start_loc[b+1]``. Its new tokens are the *last*
``query_len`` positions of its ``seq_len`` context::

    context of seq b:  |<------------- seq_len ------------->|
                       |<-- cached: seq_len-query_len -->|<-q->|
                       positions 0 ..                        seq_len-1

Token ``j`` of the context lives in slot ``block_tables[b, j // block_size] *
block_size + j % block_size``; ``slot_mapping`` gives that slot for each new token.
A new token at context position ``p`` attends to context positions ``0..p`` (causal), or
in a layer with a sliding window of ``W`` to ``p-W+1..p`` (see :func:`first_visible`).

:func:`paged_attention` first writes the new K/V into their slots, then attends. On CUDA
it uses the Triton kernels of :mod:`engine.triton_kv_write` and :mod:`engine.triton_attention`; elsewhere the torch path
below, which is also the reference the kernels are tested against.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclasses.dataclass
class AttentionMetadata:
    """Where one step's tokens come from and go to. Built by the model runner.

    All tensors live on the model's device. ``seq_lens_cpu`` / ``query_lens_cpu`` are host
    copies (Python lists) so that the torch path never synchronizes with the device.
    """

    query_start_loc: torch.Tensor  # [B+1] int32, cumulative new-token counts
    seq_lens: torch.Tensor  # [B] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32; entries past a sequence's blocks unused
    slot_mapping: torch.Tensor  # [N] int64, cache slot of each new token
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclasses.dataclass(frozen=True)
class KVScales:
    """Per-layer dequantization scales for an fp8 KV cache (1.0 for other dtypes)."""

    k: float = 1.0
    v: float = 1.0


def write_kv(
    k: torch.Tensor,  # [N, H, D]
    v: torch.Tensor,  # [N, H, D]
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, H, D]
    slot_mapping: torch.Tensor,  # [N]
    scales: KVScales = KVScales(),
) -> None:
    """Store new keys and values into their cache slots (quantizing for an fp8 cache).

    Writes in place through ``layer_cache``, which may be a strided view: flattening its
    block and token dims would copy it, so each slot is indexed as (block, offset).
    """
    block_size = layer_cache.shape[2]
    index = (slot_mapping // block_size, slot_mapping % block_size)  # ([N], [N])
    cache = layer_cache
    k = _to_cache(k, layer_cache.dtype, scales.k)
    v = _to_cache(v, layer_cache.dtype, scales.v)
    if layer_cache.dtype in FP8_DTYPES:
        # index_put_ has no fp8 kernel on the CPU; copying the bytes is the same
        cache, k, v = cache.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    cache[0].index_put_(index, k)
    cache[1].index_put_(index, v)


def _to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if dtype in FP8_DTYPES:
        limit = torch.finfo(dtype).max
        return (x.float() / scale).clamp_(-limit, limit).to(dtype)
    return x.to(dtype)


def gather_context(
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, H, D]
    block_table: torch.Tensor,  # [max_blocks]
    first: int,
    seq_len: int,
    scales: KVScales,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's keys and values at positions ``first..seq_len-1``, each
    ``[seq_len - first, H, D]`` in ``dtype``. Blocks before ``first``'s are not read."""
    block_size = layer_cache.shape[2]
    lo, hi = first // block_size, -(-seq_len // block_size)
    blocks = layer_cache[:, block_table[lo:hi].long()]  # [2, n, block_size, H, D]
    kv = blocks.flatten(1, 2)[:, first - lo * block_size : seq_len - lo * block_size]
    k, v = kv[0].to(dtype), kv[1].to(dtype)  # [len, H, D]
    if layer_cache.dtype in FP8_DTYPES:
        k, v = k * scales.k, v * scales.v
    return k, v


def first_visible(seq_len: int, query_len: int, window: int | None) -> int:
    """The first context position any of a sequence's new tokens attends to.

    A token at position ``p`` sees ``p - window < t <= p`` (``window`` tokens, itself
    included: transformers' and vLLM's convention), or ``0 <= t <= p`` without a window::

        |<-- never read -->|<----- window ----->|
        0            first = p0 - window + 1    p0 = seq_len - query_len (first new token)
    """
    if window is None:
        return 0
    return max(0, seq_len - query_len - window + 1)


def attention_torch(
    q: torch.Tensor,  # [N, Hq, D]
    layer_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    scales: KVScales = KVScales(),
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached context. [N, Hq, D].

    ``window``: a token sees only the last ``window`` positions up to itself.
    ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before the softmax.
    """
    if meta.is_decode_only and meta.num_seqs > 1:
        return _decode_torch(q, layer_cache, meta, scale, scales, window, softcap)
    out = torch.empty_like(q)
    start = 0
    for b, (seq_len, q_len) in enumerate(zip(meta.seq_lens_cpu, meta.query_lens_cpu)):
        first = first_visible(seq_len, q_len, window)
        k, v = gather_context(
            layer_cache, meta.block_tables[b], first, seq_len, scales, torch.float32
        )
        # 4-D [1, heads, len, D] inputs take torch's fused CPU kernel; GQA needs no K/V copy.
        qb = q[start : start + q_len].float().transpose(0, 1).unsqueeze(0)
        kb, vb = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        mask = None
        causal = 1 < q_len == seq_len and (window is None or window >= seq_len)
        if q_len > 1 and not causal:  # new tokens over cached keys: causal with an offset
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
            k_pos = torch.arange(first, seq_len, device=q.device)[None, :]
            mask = k_pos <= q_pos  # [q_len, seq_len - first]
            if window is not None:
                mask &= k_pos > q_pos - window
        o = _sdpa(qb, kb, vb, mask, causal, scale, softcap)  # [1, Hq, q_len, D]
        out[start : start + q_len] = o[0].transpose(0, 1).to(q.dtype)
        start += q_len
    return out


def _sdpa(
    q: torch.Tensor,  # [B, Hq, Lq, D]
    k: torch.Tensor,  # [B, Hkv, Lk, D]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # broadcast to [B, Hq, Lq, Lk], True where visible
    causal: bool,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
        )
    if gqa:  # torch's fused kernels have no soft cap: scores are formed here
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = q @ k.transpose(-1, -2) * scale  # [B, Hq, Lq, Lk]
    s = torch.tanh(s / softcap) * softcap
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _decode_torch(
    q: torch.Tensor,  # [B, Hq, D]: one new token per sequence
    layer_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    scales: KVScales,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """A decode step in one gather and one fused call: contexts padded to the longest (with
    a window, to the window: each sequence's table is read from its window's first block)."""
    block_size = layer_cache.shape[2]
    width = -(-meta.max_seq_len // block_size)
    table = meta.block_tables[:, :width].long()  # [B, nb]
    first_block = torch.zeros_like(meta.seq_lens, dtype=torch.long)  # [B]
    if window is not None:
        width = min(width, (window - 1) // block_size + 2)
        first_block = (meta.seq_lens.long() - window).clamp(min=0) // block_size
        cols = first_block[:, None] + torch.arange(width, device=q.device)  # [B, nb]
        table = table.gather(1, cols.clamp(max=table.shape[1] - 1))
    kv = layer_cache[:, table].flatten(2, 3)  # [2, B, S, Hkv, D], S = nb * block_size
    k, v = kv[0].transpose(1, 2).float(), kv[1].transpose(1, 2).float()  # [B, Hkv, S, D]
    if layer_cache.dtype in FP8_DTYPES:
        k, v = k * scales.k, v * scales.v
    positions = first_block[:, None] * block_size + torch.arange(k.shape[2], device=q.device)
    seq_lens = meta.seq_lens.long()[:, None]
    visible = positions < seq_lens  # [B, S]
    if window is not None:
        visible &= positions >= seq_lens - window
    o = _sdpa(
        q.float().unsqueeze(2), k, v, visible[:, None, None, :], False, scale, softcap
    )  # [B, Hq, 1, D]
    return o.squeeze(2).to(q.dtype)


def paged_attention(
    q: torch.Tensor,  # [N, Hq, D]
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    scales: KVScales = KVScales(),
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. Returns ``[N, Hq, D]``.

    With a ``window``, context positions before :func:`first_visible` are never read: a
    block manager may have given their blocks away.
    """
    if q.is_cuda:
        from engine import triton_attention, triton_kv_write

        triton_kv_write.write_kv(k, v, layer_cache, meta.slot_mapping, scales)
        return triton_attention.attention(
            q, layer_cache, meta, scale, scales, window=window, softcap=softcap
        )
    write_kv(k, v, layer_cache, meta.slot_mapping, scales)
    return attention_torch(q, layer_cache, meta, scale, scales, window=window, softcap=softcap)
