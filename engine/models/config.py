"""What the engine needs to know about a model, read from a Hugging Face ``config.json``."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
)
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
WEIGHT_DTYPES = ("float32", "float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only Llama-family model. Build it with :meth:`from_hf`."""

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
    sliding_window: int | None = None
    o_proj_bias: bool = False  # Llama's attention_bias also covers o_proj; Qwen2's q/k/v bias does not
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head before RoPE
    fused_checkpoint: bool = False  # Phi-3: the checkpoint holds qkv_proj and gate_up_proj

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

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
        act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
        if act != "silu":
            raise ValueError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")

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
        rope_theta, rope_scaling = _rope(hf)

        is_qwen2 = architecture == "Qwen2ForCausalLM"
        if architecture == "Phi3ForCausalLM" and float(hf.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(
                f"config.json: partial_rotary_factor={hf['partial_rotary_factor']} is not "
                "supported (RoPE over the whole head only)"
            )
        if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        else:
            window = hf.get("sliding_window")
        if window is not None:
            window = _int(hf, "sliding_window")
            if window < max_pos:
                raise ValueError(
                    f"config.json: sliding_window={window} is smaller than "
                    f"max_position_embeddings={max_pos}; this engine only implements full "
                    f"attention, which would differ from the model past {window} tokens"
                )

        torch_dtype = hf.get("torch_dtype", hf.get("dtype"))
        if torch_dtype is not None and torch_dtype not in WEIGHT_DTYPES:
            raise ValueError(
                f"config.json: torch_dtype {torch_dtype!r} is not supported "
                f"(supported: {', '.join(WEIGHT_DTYPES)})"
            )

        attention_bias = True if is_qwen2 else bool(hf.get("attention_bias", False))
        if architecture == "Phi3ForCausalLM":
            attention_bias = False
        o_proj_bias = architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM") and attention_bias
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
            num_layers=_int(hf, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            torch_dtype=torch_dtype,
            bos_token_id=int(bos) if isinstance(bos, int) else None,
            eos_token_ids=tuple(eos),
            sliding_window=window,
            o_proj_bias=o_proj_bias,
            mlp_bias=mlp_bias,
            qk_norm=architecture == "Qwen3ForCausalLM",
            fused_checkpoint=architecture == "Phi3ForCausalLM",
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


def _rope(hf: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, Mapping) or any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(f"config.json: unsupported rope configuration {params!r}")
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
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
