"""Load a Hugging Face checkpoint folder into a :class:`CausalLM`.

Only safetensors weights are read (never pickle). Every tensor's name and shape is checked
against the model from the files' headers before any weight is read, so a wrong checkpoint
fails fast with the tensor and file named.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.json_config import read_object
from engine.models.config import ModelConfig
from engine.models.llama import CausalLM
from engine.models.tiny import tiny_model_path
from engine.tokenizer import Tokenizer

FINGERPRINT_VERSION = 1
SAMPLE_BYTES = 1 << 20
NUM_SAMPLES = 8
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # derived buffers some old checkpoints carry


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    model: CausalLM  # eval mode, on the requested device
    config: ModelConfig
    tokenizer: Tokenizer
    fingerprint: bytes  # 32 bytes: SHA-256 identity of config.json and the weights
    path: Path
    dtype: torch.dtype  # the dtype parameters and activations are in


@dataclasses.dataclass(frozen=True)
class SafetensorsFile:
    path: Path
    header: dict[str, Any]  # name -> {"dtype", "shape", "data_offsets"}, plus "__metadata__"
    data_start: int  # byte offset of the data section
    size: int

    @property
    def tensors(self) -> dict[str, dict[str, Any]]:
        return {k: v for k, v in self.header.items() if k != "__metadata__"}


def load_model(
    model: str, *, dtype: torch.dtype | str = "auto", device: torch.device | str = "cpu",
    tokenizer: str | None = None,
) -> LoadedModel:
    """Load a checkpoint folder, or the built-in tiny model when ``model == "tiny"``; the
    tokenizer from the folder ``tokenizer`` when given (vLLM's ``--tokenizer``).

    ``dtype="auto"``: float32 on the CPU; on other devices the config's ``torch_dtype``
    (the weights' own dtype if the config does not say).
    """
    path = tiny_model_path() if model == "tiny" else Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such model folder")
    hf_config = _read_json(path / "config.json", required=True)
    generation_config = _read_json(path / "generation_config.json", required=False)
    config = ModelConfig.from_hf(hf_config, generation_config)
    files = [read_safetensors_header(p) for p in weight_files(path)]
    tokenizer_path = path if tokenizer is None else tiny_model_path() if tokenizer == "tiny" else Path(tokenizer).expanduser()
    if not tokenizer_path.is_dir():
        raise FileNotFoundError(f"{tokenizer_path}: no such tokenizer folder")
    tok = Tokenizer.from_folder(tokenizer_path, eos_token_ids=config.eos_token_ids)
    if tok.vocab_size > config.vocab_size:
        raise ValueError(
            f"the tokenizer in {tokenizer_path} has {tok.vocab_size} tokens, more than the "
            f"model's vocabulary ({config.vocab_size})"
        )
    config = dataclasses.replace(config, eos_token_ids=tok.eos_token_ids)

    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, config, device, files)
    with torch.device("meta"):
        net = CausalLM(config, torch_dtype)
    net.to_empty(device=device)
    load_weights(net, files)
    net.eval().requires_grad_(False)
    return LoadedModel(
        model=net,
        config=config,
        tokenizer=tok,
        fingerprint=fingerprint(hf_config, files),
        path=path,
        dtype=torch_dtype,
    )


def resolve_dtype(
    dtype: torch.dtype | str, config: ModelConfig, device: torch.device, files: list[SafetensorsFile]
) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported (float32, float16, bfloat16)")
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported (auto, {', '.join(_DTYPES)})")
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    if config.torch_dtype is not None:
        return _DTYPES[config.torch_dtype]
    for f in files:
        for info in f.tensors.values():
            if info["dtype"] in _SAFETENSORS_DTYPES:
                return _DTYPES[_SAFETENSORS_DTYPES[info["dtype"]]]
    return torch.float32


def weight_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files, sorted by name."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, required=True).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no 'weight_map'")
        paths = sorted({folder / name for name in weight_map.values()})
        for p in paths:
            if not p.is_file():
                raise FileNotFoundError(f"{p}: listed in {index.name} but missing")
        return paths
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    hint = f" (found {', '.join(pickled)}: pickle checkpoints are not loaded)" if pickled else ""
    raise FileNotFoundError(
        f"{folder}: no model.safetensors or model.safetensors.index.json{hint}"
    )


def read_safetensors_header(path: Path) -> SafetensorsFile:
    """The JSON header of a safetensors file: 8 bytes little-endian length, then JSON."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path}: too short to be a safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        if length > size - 8:
            raise ValueError(f"{path}: header length {length} runs past the end of the file")
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            raise ValueError(f"{path}: safetensors header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is not a JSON object")
    return SafetensorsFile(path=path, header=header, data_start=8 + length, size=size)


def load_weights(model: CausalLM, files: list[SafetensorsFile]) -> None:
    """Copy every checkpoint tensor into its (possibly fused) parameter, converting dtype.

    Raises ``ValueError`` for missing, unexpected, duplicated or wrongly shaped tensors.
    """
    layout = model.checkpoint_layout()
    owner: dict[str, SafetensorsFile] = {}
    for f in files:
        for name, info in f.tensors.items():
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue  # a tied checkpoint may still store the (identical) head
            slot = layout.get(name)
            if slot is None:
                raise ValueError(f"{f.path}: unexpected tensor {name!r} for {model.config.architecture}")
            if name in owner:
                raise ValueError(f"tensor {name!r} is in both {owner[name].path} and {f.path}")
            if tuple(info["shape"]) != slot.shape:
                raise ValueError(
                    f"{f.path}: tensor {name!r} has shape {tuple(info['shape'])}, "
                    f"expected {slot.shape}"
                )
            if info["dtype"] not in _SAFETENSORS_DTYPES:
                raise ValueError(f"{f.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
            owner[name] = f
    missing = sorted(set(layout) - set(owner))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"{files[0].path.parent}: checkpoint is missing tensors: {shown}")

    params = dict(model.named_parameters())
    for f in files:
        names = [name for name, o in owner.items() if o is f]
        with safe_open(str(f.path), framework="pt", device="cpu") as reader:
            for name in names:
                slot = layout[name]
                dest = params[slot.param].data
                dest[slot.offset : slot.offset + slot.shape[0]].copy_(reader.get_tensor(name))


def fingerprint(hf_config: dict[str, Any], files: list[SafetensorsFile]) -> bytes:
    """SHA-256 of a canonical JSON document describing config.json and the weights.

    Per file: its name, size, parsed header, and the SHA-256 of up to ``NUM_SAMPLES``
    evenly spaced ``SAMPLE_BYTES`` samples of its data section (all of it when small).
    """
    doc = {
        "version": FINGERPRINT_VERSION,
        "config": hf_config,
        "files": [
            {
                "name": f.path.name,
                "size": f.size,
                "header": f.header,
                "samples_sha256": _sample_digest(f),
            }
            for f in sorted(files, key=lambda f: f.path.name)
        ],
    }
    return hashlib.sha256(_canonical_json(doc)).digest()


def _sample_digest(f: SafetensorsFile) -> str:
    """
    data section:  |<------------------------- data_len ------------------------->|
    samples:       [s0]        [s1]        [s2]    ...                       [s7]
                   ^data_start                                 ^data_start + data_len - S
    """
    data_len = f.size - f.data_start
    digest = hashlib.sha256()
    with open(f.path, "rb") as fh:
        if data_len <= NUM_SAMPLES * SAMPLE_BYTES:
            fh.seek(f.data_start)
            digest.update(fh.read(data_len))
        else:
            span = data_len - SAMPLE_BYTES
            for i in range(NUM_SAMPLES):
                fh.seek(f.data_start + i * span // (NUM_SAMPLES - 1))
                digest.update(fh.read(SAMPLE_BYTES))
    return digest.hexdigest()


def _canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"{path}: missing from the model folder")
        return {}
    return read_object(path)
