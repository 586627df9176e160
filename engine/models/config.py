"""What the engine needs to know about a model, read from a Hugging Face ``config.json``."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
)
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
WEIGHT_DTYPES = ("float32", "float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only Llama- or Gemma-family model. Build it with :meth:`from_hf`."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None = dataclasses.field(hash=False)  # None: plain RoPE
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # biases on q/k/v
    torch_dtype: str | None  # dtype the weights were trained/saved in; None when unstated
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None  # the window of the layers whose type is sliding
    layer_types: tuple[str, ...] = ()  # per layer: FULL_ATTENTION or SLIDING_ATTENTION
    o_proj_bias: bool = False  # Llama's attention_bias also covers o_proj; Qwen2's q/k/v bias does not
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each q and k head before RoPE
    fused_checkpoint: bool = False  # Phi-3: the checkpoint holds qkv_proj and gate_up_proj
    hidden_act: str = "silu"  # the MLP's gate activation
    # Gemma 2/3: RMSNorm scales by (1 + weight) and rounds after it, norms before *and* after
    # attention and MLP, embeddings times sqrt(hidden_size)
    gemma: bool = False
    attn_softcap: float | None = None  # attention scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # the same on the final logits
    query_pre_attn_scalar: float | None = None  # scale q.k by this ** -0.5, not head_dim ** -0.5
    local_rope_theta: float | None = None  # Gemma 3: RoPE of the sliding layers (None: the global one)
    local_rope_scaling: dict[str, Any] | None = dataclasses.field(default=None, hash=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        scalar = self.query_pre_attn_scalar
        return (self.head_dim if scalar is None else scalar) ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """How many tokens (itself included) a query of ``layer`` sees; None: all before it."""
        if self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @property
    def kv_window(self) -> int | None:
        """The window of a model whose *every* layer has one (so older KV is never read
        again); None when any layer attends to the whole context."""
        windows = {self.layer_window(i) for i in range(self.num_layers)}
        return None if None in windows else max(windows)

    @classmethod
    def from_hf(
        cls, hf: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None
    ) -> ModelConfig:
        """Read a ``config.json`` dict (both the classic ``rope_theta``/``rope_scaling`` keys and
        the newer ``rope_parameters`` are understood). ``generation_config`` adds its eos ids.

        Raises ``ValueError`` naming the problem for anything this engine cannot run exactly.
        """
        architecture = _architecture(hf)
        if hf.get("quantization_config"):
            raise ValueError("config.json: quantized checkpoints are not supported")
        gemma = architecture in GEMMA_ARCHITECTURES
        # Gemma's hidden_act is a leftover of Gemma 1; hidden_activation is what runs
        keys = ("hidden_activation", "hidden_act") if gemma else ("hidden_act", "hidden_activation")
        act = next((hf[k] for k in keys if hf.get(k) is not None), "silu")
        if act not in ACTIVATIONS:
            raise ValueError(
                f"config.json: hidden_act {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
            )
        if hf.get("use_bidirectional_attention"):
            raise ValueError("config.json: use_bidirectional_attention is not supported (causal only)")

        hidden = _int(hf, "hidden_size")
        num_heads = _int(hf, "num_attention_heads")
        num_kv_heads = _int(hf, "num_key_value_heads", num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"config.json: num_attention_heads ({num_heads}) is not a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        if hf.get("head_dim") is None and hidden % num_heads:
            raise ValueError(
                f"config.json: hidden_size ({hidden}) is not divisible by "
                f"num_attention_heads ({num_heads}) and no head_dim is given"
            )
        head_dim = _int(hf, "head_dim", hidden // num_heads)
        max_pos = _int(hf, "max_position_embeddings")
        num_layers = _int(hf, "num_hidden_layers")
        rope_theta, rope_scaling, local_rope = _ropes(hf, architecture)

        is_qwen2 = architecture == "Qwen2ForCausalLM"
        if architecture == "Phi3ForCausalLM" and float(hf.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(
                f"config.json: partial_rotary_factor={hf['partial_rotary_factor']} is not "
                "supported (RoPE over the whole head only)"
            )
        if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        elif architecture == "LlamaForCausalLM":
            window = None
        else:
            window = hf.get("sliding_window")
        if window is not None:
            window = _int(hf, "sliding_window")
        layer_types = _layer_types(hf, architecture, num_layers, window)
        # Gemma 3 keeps attn_logit_softcapping in its config but, like vLLM, never applies it
        attn_softcap = _softcap(hf, "attn_logit_softcapping") if architecture == "Gemma2ForCausalLM" else None
        final_softcap = _softcap(hf, "final_logit_softcapping") if gemma else None
        scalar = hf.get("query_pre_attn_scalar", 256) if gemma else None  # transformers' default
        if scalar is not None and (isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar <= 0):
            raise ValueError(f"config.json: query_pre_attn_scalar must be positive, got {scalar!r}")

        torch_dtype = hf.get("torch_dtype", hf.get("dtype"))
        if torch_dtype is not None and torch_dtype not in WEIGHT_DTYPES:
            raise ValueError(
                f"config.json: torch_dtype {torch_dtype!r} is not supported "
                f"(supported: {', '.join(WEIGHT_DTYPES)})"
            )

        attention_bias = True if is_qwen2 else bool(hf.get("attention_bias", False))
        if architecture == "Phi3ForCausalLM":
            attention_bias = False
        o_proj_bias = attention_bias and (
            architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM") or gemma
        )
        mlp_bias = architecture == "LlamaForCausalLM" and bool(hf.get("mlp_bias", False))

        eos: list[int] = []
        for source in (generation_config or {}, hf):
            for token_id in _ids(source.get("eos_token_id")):
                if token_id not in eos:
                    eos.append(token_id)
        bos = hf.get("bos_token_id")
        return cls(
            architecture=architecture,
            model_type=str(hf.get("model_type", "")),
            vocab_size=_int(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(hf, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            attention_bias=attention_bias,
            torch_dtype=torch_dtype,
            bos_token_id=int(bos) if isinstance(bos, int) else None,
            eos_token_ids=tuple(eos),
            sliding_window=window,
            layer_types=layer_types,
            o_proj_bias=o_proj_bias,
            mlp_bias=mlp_bias,
            qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            fused_checkpoint=architecture == "Phi3ForCausalLM",
            hidden_act=act,
            gemma=gemma,
            attn_softcap=attn_softcap,
            final_softcap=final_softcap,
            query_pre_attn_scalar=float(scalar) if scalar is not None else None,
            local_rope_theta=local_rope[0] if local_rope else None,
            local_rope_scaling=local_rope[1] if local_rope else None,
        )


def _architecture(hf: Mapping[str, Any]) -> str:
    archs = hf.get("architectures")
    if archs:
        if not isinstance(archs, list) or len(archs) != 1:
            raise ValueError(f"config.json: expected one entry in 'architectures', got {archs!r}")
        arch = archs[0]
    else:
        arch = _ARCH_BY_MODEL_TYPE.get(hf.get("model_type", ""))
        if arch is None:
            raise ValueError(
                "config.json has neither 'architectures' nor a known 'model_type'; "
                f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"config.json: architecture {arch!r} is not supported; "
            f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _layer_types(
    hf: Mapping[str, Any], architecture: str, num_layers: int, window: int | None
) -> tuple[str, ...]:
    if window is None and architecture not in GEMMA_ARCHITECTURES:
        return (FULL_ATTENTION,) * num_layers
    """Which layers slide, as transformers decides: ``layer_types`` when config.json has
    them, else the architecture's rule (Gemma 2 every other layer from the first, Gemma 3
    all but every ``sliding_window_pattern``-th, Qwen from ``max_window_layers`` on,
    Mistral and Phi-3 all)."""
    types = hf.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise ValueError(f"config.json: layer_types must list one type for each of {num_layers} layers")
        unknown = sorted({t for t in types if t not in (FULL_ATTENTION, SLIDING_ATTENTION)}, key=str)
        if unknown:
            raise ValueError(
                f"config.json: layer type {unknown[0]!r} is not supported "
                f"(supported: {FULL_ATTENTION}, {SLIDING_ATTENTION})"
            )
        return tuple(types)
    if architecture == "Gemma2ForCausalLM":
        slides = [(i + 1) % 2 != 0 for i in range(num_layers)]
    elif architecture == "Gemma3ForCausalLM":
        pattern = _int(hf, "sliding_window_pattern", 6)
        slides = [(i + 1) % pattern != 0 for i in range(num_layers)]
    elif architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        first = hf.get("max_window_layers", 28)
        slides = [i >= first for i in range(num_layers)]
    else:
        slides = [True] * num_layers
    return tuple(SLIDING_ATTENTION if s else FULL_ATTENTION for s in slides)


def _softcap(hf: Mapping[str, Any], key: str) -> float | None:
    value = hf.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"config.json: {key} must be a positive number, got {value!r}")
    return float(value)


_Rope = tuple[float, "dict[str, Any] | None"]


def _ropes(hf: Mapping[str, Any], architecture: str) -> tuple[float, dict[str, Any] | None, _Rope | None]:
    """The global RoPE (theta, scaling) and, for Gemma 3, that of the sliding layers."""
    if architecture != "Gemma3ForCausalLM":
        return (*_rope(hf), None)
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping) and FULL_ATTENTION in params:  # per layer type
        full = _rope_of(params.get(FULL_ATTENTION) or {}, None, 1_000_000.0)
        local = _rope_of(params.get(SLIDING_ATTENTION) or {}, None, 10_000.0)
    else:  # older configs: rope_theta and rope_scaling for the global layers
        full = _rope(hf, default_theta=1_000_000.0)
        local = (float(hf.get("rope_local_base_freq", 10_000.0)), None)
    return (*full, local)


def _rope(hf: Mapping[str, Any], default_theta: float = 10000.0) -> _Rope:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return _rope_of(params, hf.get("rope_theta"), default_theta)


def _rope_of(params: Any, theta: Any, default_theta: float) -> _Rope:
    if not isinstance(params, Mapping) or any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(f"config.json: unsupported rope configuration {params!r}")
    if theta is None:
        theta = params.get("rope_theta", default_theta)
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ValueError(f"config.json: rope_theta must be a positive number, got {theta!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json: rope type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return float(theta), None
    missing = [k for k in _ROPE_KEYS[rope_type] if not isinstance(params.get(k), (int, float))]
    if missing:
        raise ValueError(f"config.json: {rope_type} rope scaling needs {', '.join(missing)}")
    scaling = {"rope_type": rope_type, **{k: params[k] for k in _ROPE_KEYS[rope_type]}}
    if scaling["factor"] <= 0:
        raise ValueError(f"config.json: rope scaling factor must be positive, got {scaling['factor']}")
    return float(theta), scaling


def _int(hf: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = hf.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"config.json is missing {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"eos_token_id must be a token id or a list of them, got {value!r}")
    return list(values)
