"""The pieces the decoders are built from: norms, RoPE, attention, the gated MLP.

What differs between the families is chosen by :class:`ModelConfig`: the norm's flavour
(Llama's ``weight * normed`` rounded before the scale, Gemma's ``(1 + weight) * normed``
rounded after it), the activation, the attention scale, a soft cap on the scores and a
sliding window per layer.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, KVScales, paged_attention
from engine.fused_ops import add_rms_norm, rope_
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


class GemmaRMSNorm(RMSNorm):
    """Gemma's norm: ``(1 + weight)`` scales the fp32 normalized value, then it is rounded."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype), x


def make_norm(config: ModelConfig, size: int, dtype: torch.dtype) -> RMSNorm:
    return (GemmaRMSNorm if config.gemma else RMSNorm)(size, config.rms_norm_eps, dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables over positions, grown on demand (never past max_position_embeddings).

    The tables are plain attributes, not buffers: they are derived, never loaded, and the
    model is built on the meta device.
    """

    def __init__(
        self, head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self.max_positions = max_positions
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
    """Layer ``layer``'s attention: its window and soft cap come from the config."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.window = config.layer_window(layer)
        self.softcap = config.attn_softcap
        self.sizes = [config.q_size, config.kv_size, config.kv_size]
        self.qkv_proj = nn.Linear(
            config.hidden_size, sum(self.sizes), bias=config.attention_bias, dtype=dtype
        )
        self.o_proj = nn.Linear(
            config.q_size, config.hidden_size, bias=config.o_proj_bias, dtype=dtype
        )
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = make_norm(config, config.head_dim, dtype)
            self.k_norm = make_norm(config, config.head_dim, dtype)

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
        out = paged_attention(
            q, k, v, layer_cache, meta, self.scale, scales, window=self.window, softcap=self.softcap
        )  # [N, Hq, D]
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
        self.tanh_gelu = config.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.tanh_gelu else F.silu(gate)
        return self.down_proj(act * up)
