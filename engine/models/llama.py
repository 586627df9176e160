"""Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and Gemma 3 as one paged decoder.

They differ only in details the config carries: biases (Qwen2 on q/k/v, Llama and Qwen3
optionally everywhere), an RMSNorm on each q and k head (Qwen3, Gemma 3), tied embeddings,
RoPE scaling, sliding windows, and Gemma's layer (:mod:`engine.models.gemma`). q/k/v are
one matmul and gate/up another; the loader writes the checkpoint's separate tensors into
row slices of the fused weights, or Phi-3's fused tensors as they are (see
:meth:`CausalLM.checkpoint_layout`).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, KVScales
from engine.kv_cache import layer_view
from engine.models.config import SLIDING_ATTENTION, ModelConfig
from engine.models.gemma import GemmaDecoderLayer
from engine.models.layers import MLP, Attention, RMSNorm, RotaryEmbedding, WeightSlot, make_norm


class DecoderLayer(nn.Module):
    NORMS = ("input_layernorm", "post_attention_layernorm")

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, layer, dtype)
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
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype)
        # Gemma: sqrt(hidden), rounded to the model dtype as the reference does
        self.embed_scale = None
        if c.gemma:
            self.embed_scale = torch.tensor(math.sqrt(c.hidden_size), device="cpu").to(dtype).item()
        self.rotary = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
        self.local_rotary = None  # Gemma 3's sliding layers have their own RoPE base
        if c.local_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(
                c.head_dim, c.local_rope_theta, c.local_rope_scaling, c.max_position_embeddings
            )
        layer_cls = GemmaDecoderLayer if c.gemma else DecoderLayer
        self.layers = nn.ModuleList(layer_cls(c, i, dtype) for i in range(c.num_layers))
        self.norm = make_norm(c, c.hidden_size, dtype)
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
        if self.embed_scale is not None:
            x = x * self.embed_scale
        rope = self.rotary(positions, meta.max_seq_len, x.dtype)  # (cos, sin), [N, D] each
        local_rope = rope
        if self.local_rotary is not None:
            local_rope = self.local_rotary(positions, meta.max_seq_len, x.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            scales = kv_scales[i] if kv_scales is not None else KVScales()
            cos, sin = local_rope if self.config.layer_types[i] == SLIDING_ATTENTION else rope
            x, residual = layer(x, residual, cos, sin, layer_view(kv_cache, i), meta, scales)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [M, hidden] -> [M, vocab]
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight)
        cap = self.config.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

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
            for norm in type(self.layers[i]).NORMS:
                layout[f"{src}.{norm}.weight"] = WeightSlot(f"{dst}.{norm}.weight", (h,))
        return layout
