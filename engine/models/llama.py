"""Llama, Mistral, Qwen2, Qwen3 and Phi-3 as one paged decoder.

They differ only in details the config carries: biases (Qwen2 on q/k/v, Llama and Qwen3
optionally everywhere), an RMSNorm on each q and k head (Qwen3), tied embeddings, RoPE
scaling. q/k/v are one matmul and gate/up another; the loader writes the checkpoint's
separate tensors into row slices of the fused weights, or Phi-3's fused tensors as they
are (see :meth:`CausalLM.checkpoint_layout`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, KVScales, paged_attention
from engine.fused_ops import add_rms_norm, rope_
from engine.kv_cache import layer_view
from engine.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class WeightSlot:
    """Where one checkpoint tensor goes: rows ``offset : offset + shape[0]`` of ``param``."""

    param: str
    shape: tuple[int, ...]
    offset: int = 0


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; normalized in fp32 and scaled in the model
        dtype, as the reference implementation does. One kernel on CUDA."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables over positions, grown on demand (never past max_position_embeddings).

    The tables are plain attributes, not buffers: they are derived, never loaded, and the
    model is built on the meta device.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.theta = config.rope_theta
        self.scaling = config.rope_scaling
        self.max_positions = config.max_position_embeddings
        self._cos: torch.Tensor | None = None  # [P, D]
        self._sin: torch.Tensor | None = None

    def inv_freq(self) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        inv_freq = 1.0 / (self.theta ** exponents)  # [D/2] float32
        if self.scaling is None:
            return inv_freq
        factor = float(self.scaling["factor"])
        if self.scaling["rope_type"] == "linear":
            return inv_freq / factor
        return _llama3_inv_freq(inv_freq, self.scaling)

    def forward(
        self, positions: torch.Tensor, num_positions: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for ``positions``, each ``[N, D]`` in ``dtype``. All positions must be
        below ``num_positions`` (known on the host, so no device sync is needed)."""
        if num_positions > self.max_positions:
            raise ValueError(
                f"context of {num_positions} tokens exceeds max_position_embeddings "
                f"({self.max_positions})"
            )
        cos = self._cos
        stale = cos is None or cos.device != positions.device or cos.dtype != dtype
        if stale or cos.shape[0] < num_positions:
            self._build(max(num_positions, 1), positions.device, dtype)
        return self._cos[positions], self._sin[positions]

    def _build(self, needed: int, device: torch.device, dtype: torch.dtype) -> None:
        size = min(1 << (needed - 1).bit_length(), self.max_positions)
        size = max(size, min(256, self.max_positions))
        inv_freq = self.inv_freq().to(device)
        t = torch.arange(size, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self._cos, self._sin = emb.cos().to(dtype), emb.sin().to(dtype)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by ``factor``, short ones kept, a smooth
    blend in between."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, slowed)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.sizes = [config.q_size, config.kv_size, config.kv_size]
        self.qkv_proj = nn.Linear(
            config.hidden_size, sum(self.sizes), bias=config.attention_bias, dtype=dtype
        )
        self.o_proj = nn.Linear(
            config.q_size, config.hidden_size, bias=config.o_proj_bias, dtype=dtype
        )
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)

    def forward(
        self,
        x: torch.Tensor,  # [N, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D], a strided view
        meta: AttentionMetadata,
        scales: KVScales,
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)  # [N, Hq, D]
        k = k.view(n, self.num_kv_heads, self.head_dim)  # [N, Hkv, D]
        if self.q_norm is not None:  # per head: rows of D
            q = self.q_norm(q.reshape(-1, self.head_dim))[0].view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim))[0].view(k.shape)
        q, k = rope_(q, k, cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, layer_cache, meta, self.scale, scales)  # [N, Hq, D]
        return self.o_proj(out.reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias, dtype=dtype
        )
        self.down_proj = nn.Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias, dtype=dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)

    def forward(
        self, x, residual, cos, sin, layer_cache, meta, scales
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output, not yet added to the residual stream, and that stream: the
        add happens in the next norm, fused with it."""
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, layer_cache, meta, scales)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """The paged decoder. Parameters are left uninitialized; the loader fills them.

    ``forward`` runs one flattened step and returns the final-normed hidden states;
    ``compute_logits`` turns the rows the caller wants to sample from into logits.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [N] int64
        positions: torch.Tensor,  # [N] int64
        kv_cache: torch.Tensor,  # [num_blocks, L, 2, block_size, Hkv, D]
        meta: AttentionMetadata,
        kv_scales: Sequence[KVScales] | None = None,
    ) -> torch.Tensor:  # [N, hidden]
        if kv_cache.dim() != 6 or kv_cache.shape[1] != len(self.layers):
            raise ValueError(
                f"kv_cache {list(kv_cache.shape)} is not [num_blocks, L, 2, T, H, D] with the "
                f"model's {len(self.layers)} layers"
            )
        x = self.embed_tokens(input_ids)  # [N, hidden]
        cos, sin = self.rotary(positions, meta.max_seq_len, x.dtype)  # [N, D] each
        residual = None
        for i, layer in enumerate(self.layers):
            scales = kv_scales[i] if kv_scales is not None else KVScales()
            x, residual = layer(x, residual, cos, sin, layer_view(kv_cache, i), meta, scales)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [M, hidden] -> [M, vocab]
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def checkpoint_layout(self) -> dict[str, WeightSlot]:
        """Every tensor a Hugging Face checkpoint of this model holds, by its name there."""
        c = self.config
        h, q, kv, inter = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
        layout = {
            "model.embed_tokens.weight": WeightSlot("embed_tokens.weight", (c.vocab_size, h)),
            "model.norm.weight": WeightSlot("norm.weight", (h,)),
        }
        if self.lm_head is not None:
            layout["lm_head.weight"] = WeightSlot("lm_head.weight", (c.vocab_size, h))
        for i in range(c.num_layers):
            src, dst = f"model.layers.{i}", f"layers.{i}"
            kinds = ["weight"] + (["bias"] if c.attention_bias else [])
            for kind in kinds:
                if c.fused_checkpoint:
                    qkv = f"self_attn.qkv_proj.{kind}"
                    shape = (q + 2 * kv, h) if kind == "weight" else (q + 2 * kv,)
                    layout[f"{src}.{qkv}"] = WeightSlot(f"{dst}.{qkv}", shape)
                    continue
                for name, offset, rows in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
                    shape = (rows, h) if kind == "weight" else (rows,)
                    layout[f"{src}.self_attn.{name}_proj.{kind}"] = WeightSlot(
                        f"{dst}.self_attn.qkv_proj.{kind}", shape, offset
                    )
            if c.qk_norm:
                for norm in ("q_norm", "k_norm"):
                    name = f"self_attn.{norm}.weight"
                    layout[f"{src}.{name}"] = WeightSlot(f"{dst}.{name}", (c.head_dim,))
            o_proj = "self_attn.o_proj"
            layout[f"{src}.{o_proj}.weight"] = WeightSlot(f"{dst}.{o_proj}.weight", (h, q))
            if c.o_proj_bias:
                layout[f"{src}.{o_proj}.bias"] = WeightSlot(f"{dst}.{o_proj}.bias", (h,))
            kinds = ["weight"] + (["bias"] if c.mlp_bias else [])
            for kind in kinds:
                if c.fused_checkpoint:
                    gate_up = f"mlp.gate_up_proj.{kind}"
                    shape = (2 * inter, h) if kind == "weight" else (2 * inter,)
                    layout[f"{src}.{gate_up}"] = WeightSlot(f"{dst}.{gate_up}", shape)
                else:
                    for name, offset in (("gate", 0), ("up", inter)):
                        shape = (inter, h) if kind == "weight" else (inter,)
                        layout[f"{src}.mlp.{name}_proj.{kind}"] = WeightSlot(
                            f"{dst}.mlp.gate_up_proj.{kind}", shape, offset
                        )
                shape = (h, inter) if kind == "weight" else (h,)
                down = f"mlp.down_proj.{kind}"
                layout[f"{src}.{down}"] = WeightSlot(f"{dst}.{down}", shape)
            for norm in ("input_layernorm", "post_attention_layernorm"):
                layout[f"{src}.{norm}.weight"] = WeightSlot(f"{dst}.{norm}.weight", (h,))
        return layout
