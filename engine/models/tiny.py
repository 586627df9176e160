"""The built-in tiny model: a random 4-layer Llama with a byte-level tokenizer.

It exists so that the engine, the server and the tests run anywhere without a download.
Its text is gibberish; its bytes are the same on every machine, so its fingerprint (and
with it every KV-cache key) is too.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

TINY_NAME = "tiny-v1"  # bump when anything written below changes
SPECIAL_TOKENS = (
    "<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>",
)  # ids 256.. in this order; ids 0..255 are the bytes themselves
BOS_ID, EOS_ID, END_ID = 256, 257, 262

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' ~ message['role']) }}"
    "{% endif %}"
    "{{ '<|' ~ message['role'] ~ '|>\n' ~ message['content'] ~ '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 256 + len(SPECIAL_TOKENS),
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "float32",
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
}
_SEED = 20240617
# Weights are integers in [-512, 512] times a power of two, per kind of tensor. Large enough
# that greedy decoding wanders instead of repeating one token.
_SCALE_PROJ = 2.0**-11  # |w| <= 0.25
_SCALE_EMBED = 2.0**-9  # |w| <= 1, embeddings of order one as after training
_SCALE_NORM = 2.0**-12  # norms within 0.125 of one


def byte_to_unicode() -> dict[int, str]:
    """The printable stand-in for each byte that byte-level tokenizers use (printable
    Latin-1 bytes stand for themselves, the rest are shifted past U+0100)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, shifted = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def build_tiny_tokenizer() -> tokenizers.Tokenizer:
    """One token per byte (id = byte value), then the special tokens; adds ``<|bos|>``."""
    vocab = {char: b for b, char in byte_to_unicode().items()}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A $B", special_tokens=[("<|bos|>", BOS_ID)]
    )
    return tok


def write_tiny_tokenizer(path: str | Path) -> None:
    """Write tokenizer.json and tokenizer_config.json (with the chat template) into ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer().save(str(path / "tokenizer.json"), pretty=True)
    _write_json(
        path / "tokenizer_config.json",
        {
            "bos_token": "<|bos|>",
            "eos_token": "<|eos|>",
            "pad_token": "<|pad|>",
            "chat_template": CHAT_TEMPLATE,
        },
    )


def tiny_weights() -> dict[str, torch.Tensor]:
    """The tiny model's weights under their Hugging Face names, the same on every machine.

    Integers from a seeded generator times a power of two: exact, unlike normal sampling,
    whose vectorized transcendental functions may round differently on different CPUs.
    """
    c = TINY_CONFIG
    h, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q = c["num_attention_heads"] * c["head_dim"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    shapes = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.self_attn.q_proj.weight": (q, h),
            f"{p}.self_attn.k_proj.weight": (kv, h),
            f"{p}.self_attn.v_proj.weight": (kv, h),
            f"{p}.self_attn.o_proj.weight": (h, q),
            f"{p}.mlp.gate_proj.weight": (inter, h),
            f"{p}.mlp.up_proj.weight": (inter, h),
            f"{p}.mlp.down_proj.weight": (h, inter),
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
        })
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (vocab, h)

    gen = torch.Generator().manual_seed(_SEED)
    weights = {}
    for name, shape in shapes.items():
        ints = torch.randint(-512, 513, shape, generator=gen, dtype=torch.int32)
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + ints.to(torch.float32) * _SCALE_NORM
        elif name == "model.embed_tokens.weight":
            weights[name] = ints.to(torch.float32) * _SCALE_EMBED
        else:
            weights[name] = ints.to(torch.float32) * _SCALE_PROJ
    return weights


def write_tiny_checkpoint(path: str | Path) -> Path:
    """Write the tiny model as a Hugging Face checkpoint folder (created if missing)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _write_json(path / "config.json", TINY_CONFIG)
    _write_json(path / "generation_config.json", {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, END_ID]})
    save_file(tiny_weights(), str(path / "model.safetensors"), metadata={"format": "pt"})
    write_tiny_tokenizer(path)
    return path


def tiered_kv_home() -> Path:
    """``$TIERED_KV_HOME``, else ``$XDG_CACHE_HOME/tiered-kv``, else ``~/.cache/tiered-kv``."""
    home = os.environ.get("TIERED_KV_HOME")
    if home:
        return Path(home).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME")
    return (Path(cache).expanduser() if cache else Path.home() / ".cache") / "tiered-kv"


def tiny_model_path() -> Path:
    """The tiny checkpoint's folder, written on first use.

    The folder is written under a temporary name and renamed into place, so it is either
    absent or complete; when two processes race, one rename wins and the other's copy is
    discarded (both wrote the same bytes).
    """
    dest = tiered_kv_home() / "models" / TINY_NAME
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{TINY_NAME}-", dir=dest.parent))
    try:
        write_tiny_checkpoint(tmp)
        os.rename(tmp, dest)
    except OSError:
        if not dest.is_dir():
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
