"""Gemma 2 and Gemma 3 (text): the decoder layer with norms on both sides of each block.

::

    h = x + post_attention_norm(attention(input_norm(x)))
    out = h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))

The rest is configuration (see :class:`~engine.models.config.ModelConfig`): (1 + weight)
RMSNorm, embeddings times sqrt(hidden_size), ``query_pre_attn_scalar``, tanh soft caps on
scores and logits, gelu-tanh MLP, interleaved sliding-window and global layers, and Gemma
3's q/k norms and local RoPE base.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.models.config import ModelConfig
from engine.models.layers import MLP, Attention, make_norm


class GemmaDecoderLayer(nn.Module):
    NORMS = (
        "input_layernorm", "post_attention_layernorm",
        "pre_feedforward_layernorm", "post_feedforward_layernorm",
    )

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = make_norm(config, h, dtype)
        self.self_attn = Attention(config, layer, dtype)
        self.post_attention_layernorm = make_norm(config, h, dtype)
        self.pre_feedforward_layernorm = make_norm(config, h, dtype)
        self.mlp = MLP(config, dtype)
        self.post_feedforward_layernorm = make_norm(config, h, dtype)

    def forward(
        self, x, residual, cos, sin, layer_cache, meta, scales
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As :class:`~engine.models.llama.DecoderLayer`: the stream is ``x + residual``; the
        layer's output is returned apart from it, to be added by the next norm."""
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, layer_cache, meta, scales)
        h = self.post_attention_layernorm(h)[0]
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h))[0], residual
