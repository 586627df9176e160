"""Checkpoint folders: what loads, what is refused and why, fingerprints, the tiny model."""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import engine.models.tiny as tiny
from engine.models import ModelConfig, load_model
from engine.models.loader import (
    SafetensorsFile,
    _sample_digest,
    read_safetensors_header,
    resolve_dtype,
)

# Changing this means every stored KV block of the tiny model is orphaned: bump TINY_NAME.
TINY_FINGERPRINT = "cb93e50c9f8e81c8fc53fbd6324430f6158b0ef9e19adaf7406f8f191d861b1e"


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return tiny.write_tiny_checkpoint(tmp_path / "tiny")


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def edit_weights(path: Path, edit) -> None:
    weights = load_file(str(path / "model.safetensors"))
    edit(weights)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


# --- folders and files -------------------------------------------------------------------


def test_tiny_checkpoint_loads(ckpt):
    loaded = load_model(str(ckpt))
    assert loaded.config.architecture == "LlamaForCausalLM"
    assert loaded.config.eos_token_ids == (tiny.EOS_ID, tiny.END_ID)
    assert loaded.tokenizer.eos_token_ids == loaded.config.eos_token_ids
    assert loaded.tokenizer.bos_token_id == tiny.BOS_ID
    assert loaded.path == ckpt and len(loaded.fingerprint) == 32


def test_the_tokenizer_may_come_from_another_folder(ckpt, tmp_path):
    """vLLM's --tokenizer: the tokenizer (and its chat template) from another folder; a
    missing one, or one with more tokens than the model, is refused."""
    other = tmp_path / "tok"
    other.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (other / name).write_bytes((ckpt / name).read_bytes())
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}<{{ m.content }}>{% endfor %}"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = load_model(str(ckpt), tokenizer=str(other))
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "<x>"
    assert load_model(str(ckpt), tokenizer="tiny").tokenizer.vocab_size == loaded.tokenizer.vocab_size
    with pytest.raises(FileNotFoundError, match="no such tokenizer folder"):
        load_model(str(ckpt), tokenizer=str(tmp_path / "absent"))
    edit_config(ckpt, vocab_size=loaded.tokenizer.vocab_size - 1)
    edit_weights(ckpt, lambda w: w.update({k: v[:-1] for k, v in w.items() if v.shape[0] == loaded.tokenizer.vocab_size}))
    with pytest.raises(ValueError, match="more than the model's vocabulary"):
        load_model(str(ckpt), tokenizer=str(other))


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such model folder"):
        load_model(str(tmp_path / "nope"))


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_missing_file(ckpt, name):
    (ckpt / name).unlink()
    with pytest.raises(FileNotFoundError, match=name.replace(".", r"\.")):
        load_model(str(ckpt))


def test_pickle_checkpoint_is_not_loaded(ckpt):
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin.*pickle"):
        load_model(str(ckpt))


def test_missing_shard(ckpt):
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        load_model(str(ckpt))


def test_invalid_config_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        load_model(str(ckpt))


def test_truncated_weights(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\xff" * 12)
    with pytest.raises(ValueError, match="model.safetensors: header length"):
        load_model(str(ckpt))


# --- tensors -----------------------------------------------------------------------------


def test_missing_tensor(ckpt):
    edit_weights(ckpt, lambda w: w.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.2\.mlp\.up_proj\.weight"):
        load_model(str(ckpt))


def test_unexpected_tensor(ckpt):
    edit_weights(ckpt, lambda w: w.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"):
        load_model(str(ckpt))


def test_wrong_shape(ckpt):
    edit_weights(ckpt, lambda w: w.update({"model.norm.weight": torch.ones(65)}))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \(65,\), expected \(64,\)"):
        load_model(str(ckpt))


def test_tensor_in_two_shards(ckpt):
    save_file({"model.norm.weight": torch.ones(64)}, str(ckpt / "extra.safetensors"))
    index = {"weight_map": {"model.norm.weight": "extra.safetensors", "x": "model.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' is in both"):
        load_model(str(ckpt))


def test_tied_checkpoint_may_keep_lm_head(ckpt):
    edit_config(ckpt, tie_word_embeddings=True)
    loaded = load_model(str(ckpt))
    assert loaded.model.lm_head is None
    hidden = torch.randn(3, 64)
    expected = hidden @ loaded.model.embed_tokens.weight.T
    torch.testing.assert_close(loaded.model.compute_logits(hidden), expected)


def test_weights_converted_to_requested_dtype(ckpt):
    edit_weights(ckpt, lambda w: w.update({k: v.to(torch.bfloat16) for k, v in w.items()}))
    loaded = load_model(str(ckpt), dtype="float32")
    reference = load_file(str(ckpt / "model.safetensors"))
    q = reference["model.layers.1.self_attn.q_proj.weight"].float()
    k = reference["model.layers.1.self_attn.k_proj.weight"].float()
    qkv = loaded.model.layers[1].self_attn.qkv_proj.weight
    assert qkv.dtype == torch.float32
    assert torch.equal(qkv[:64], q) and torch.equal(qkv[64:96], k)


# --- config validation -------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            dict(architectures=["GPT2LMHeadModel"]),
            "GPT2LMHeadModel.*LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM",
        ),
        (dict(architectures=None, model_type="gpt2"), "supported architectures"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn'.*default, linear, llama3"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "llama3 rope scaling needs low_freq_factor"),
        (dict(hidden_size=None), "missing 'hidden_size'"),
        (
            dict(num_key_value_heads=3),
            r"num_attention_heads \(4\) is not a multiple of num_key_value_heads \(3\)",
        ),
        (dict(num_attention_heads=3, head_dim=None, num_key_value_heads=1), "not divisible"),
        (dict(num_hidden_layers=0), "num_hidden_layers must be a positive integer"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(torch_dtype="float8_e4m3fn"), "torch_dtype 'float8_e4m3fn'"),
        (dict(quantization_config={"quant_method": "awq"}), "quantized"),
    ],
)
def test_config_rejected(ckpt, changes, message):
    edit_config(ckpt, **changes)
    with pytest.raises(ValueError, match=message):
        load_model(str(ckpt))


def test_sliding_window_that_never_matters_is_accepted():
    base = json.loads(json.dumps(tiny.TINY_CONFIG))
    mistral = ModelConfig.from_hf({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert mistral.sliding_window == 4096
    qwen = ModelConfig.from_hf(
        {**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 128, "use_sliding_window": False}
    )
    assert qwen.sliding_window is None and qwen.attention_bias and not qwen.o_proj_bias


def test_config_reads_both_rope_spellings():
    base = {k: v for k, v in tiny.TINY_CONFIG.items() if k != "rope_theta"}
    scaling = {"rope_type": "linear", "factor": 2.0}
    classic = ModelConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": {**scaling}})
    newer = ModelConfig.from_hf({**base, "rope_parameters": {**scaling, "rope_theta": 5e5}})
    legacy_key = ModelConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert classic == newer == legacy_key
    assert classic.rope_theta == 5e5 and classic.rope_scaling == scaling
    default = ModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert default.rope_scaling is None


def test_eos_ids_merged_from_every_source(ckpt):
    edit_config(ckpt, eos_token_id=[263, 257])
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": 262}))
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|pad|>"
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_model(str(ckpt)).config.eos_token_ids == (262, 263, 257, 258)


def test_dtype_resolution():
    config = ModelConfig.from_hf({**tiny.TINY_CONFIG, "torch_dtype": "bfloat16"})
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", config, cpu, []) == torch.float32
    assert resolve_dtype("auto", config, cuda, []) == torch.bfloat16
    assert resolve_dtype("fp16", config, cpu, []) == torch.float16
    assert resolve_dtype(torch.bfloat16, config, cpu, []) == torch.bfloat16
    unstated = ModelConfig.from_hf({**tiny.TINY_CONFIG, "torch_dtype": None})
    f16 = SafetensorsFile(Path("x"), {"a": {"dtype": "F16", "shape": [1], "data_offsets": [0, 2]}}, 0, 0)
    assert resolve_dtype("auto", unstated, cuda, [f16]) == torch.float16
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        resolve_dtype("int8", config, cpu, [])


# --- fingerprint -------------------------------------------------------------------------


def test_fingerprint_stable_across_loads(ckpt):
    assert load_model(str(ckpt)).fingerprint == load_model(str(ckpt)).fingerprint


def test_fingerprint_changes_with_one_weight(ckpt):
    before = load_model(str(ckpt)).fingerprint

    def nudge(w):
        w["model.layers.3.mlp.down_proj.weight"][5, 7] += 2.0**-10

    edit_weights(ckpt, nudge)
    assert load_model(str(ckpt)).fingerprint != before


def test_fingerprint_changes_with_config(ckpt):
    before = load_model(str(ckpt)).fingerprint
    edit_config(ckpt, rms_norm_eps=1e-6)
    assert load_model(str(ckpt)).fingerprint != before


def test_fingerprint_ignores_the_tokenizer(ckpt):
    before = load_model(str(ckpt)).fingerprint
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>"}))
    assert load_model(str(ckpt)).fingerprint == before


def test_large_files_are_sampled(tmp_path):
    """Past 8 MiB of data only eight 1 MiB samples are hashed, the first and last included."""
    header = b'{"__metadata__":{}}'
    data_len = 20 << 20
    path = tmp_path / "big.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(data_len))
    f = read_safetensors_header(path)
    base = _sample_digest(f)

    def digest_with_byte_at(offset: int) -> str:
        with open(path, "r+b") as fh:
            fh.seek(f.data_start + offset)
            fh.write(b"\x01")
        try:
            return _sample_digest(f)
        finally:
            with open(path, "r+b") as fh:
                fh.seek(f.data_start + offset)
                fh.write(b"\x00")

    assert digest_with_byte_at(0) != base
    assert digest_with_byte_at(data_len - 1) != base
    assert digest_with_byte_at((1 << 20) + 10) == base  # between samples 0 and 1


# --- the tiny model ----------------------------------------------------------------------


def test_tiny_checkpoint_is_byte_identical(tmp_path):
    a = tiny.write_tiny_checkpoint(tmp_path / "a")
    b = tiny.write_tiny_checkpoint(tmp_path / "b")
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_tiny_fingerprint_is_pinned(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERED_KV_HOME", str(tmp_path))
    assert load_model("tiny").fingerprint.hex() == TINY_FINGERPRINT


def test_tiny_model_path_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERED_KV_HOME", str(tmp_path))
    path = tiny.tiny_model_path()
    assert path == tmp_path / "models" / tiny.TINY_NAME
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert tiny.tiny_model_path() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_tiny_model_path_race(tmp_path, monkeypatch):
    """Both writers finish before either publishes: one rename wins, the loser cleans up."""
    monkeypatch.setenv("TIERED_KV_HOME", str(tmp_path))
    barrier = threading.Barrier(2, timeout=30)
    write = tiny.write_tiny_checkpoint

    def write_then_wait(path):
        write(path)
        barrier.wait()

    monkeypatch.setattr(tiny, "write_tiny_checkpoint", write_then_wait)
    results, errors = [], []

    def worker():
        try:
            results.append(tiny.tiny_model_path())
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 2 and results[0] == results[1]
    assert os.listdir(tmp_path / "models") == [tiny.TINY_NAME]
    assert load_model(str(results[0])).fingerprint.hex() == TINY_FINGERPRINT
