"""The request defaults a model's ``generation_config.json`` gives, as vLLM reads them.

``--generation-config``: ``auto`` (the default) reads the model folder's file, ``vllm``
ignores it (vLLM's neutral defaults), any other value is a folder to read it from;
``--override-generation-config`` (a JSON object) sets keys on top of what that gives. Only
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and
``max_new_tokens`` (as the default ``max_tokens``) are taken; a request's own value wins.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from engine.sampling_params import SamplingParams
from tiered_kv.units import finite

FILE_NAME = "generation_config.json"
_FLOAT_KEYS = ("temperature", "top_p", "min_p", "repetition_penalty")


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    """Defaults for fields a request leaves out; ``None``: vLLM's neutral default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # generation_config's max_new_tokens

    @classmethod
    def load(
        cls, setting: str, model_folder: str | os.PathLike[str], override: str | None = None
    ) -> GenerationDefaults:
        """The defaults for ``--generation-config setting`` and the model in ``model_folder``,
        with ``--override-generation-config``'s JSON object (``override``) on top, as vLLM
        merges them. Raises ``ValueError`` naming the flag for a folder without the file, or
        a file or override that is not a JSON object of sensible values."""
        extra = parse_override(override)
        if setting == "vllm":
            return cls.from_dict(extra, "--override-generation-config") if extra else cls()
        if setting == "auto":
            path = Path(model_folder) / FILE_NAME
            if not path.is_file():
                return cls.from_dict(extra, "--override-generation-config") if extra else cls()
        else:
            path = Path(setting).expanduser() / FILE_NAME
            if not path.is_file():
                raise ValueError(f"--generation-config {setting}: no {FILE_NAME} in that folder")
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"--generation-config: cannot read {path}: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"--generation-config: {path} is not a JSON object")
        source = f"{path} with --override-generation-config" if extra else str(path)
        return cls.from_dict({**data, **extra}, source)

    @classmethod
    def from_dict(cls, data: dict, source: str) -> GenerationDefaults:
        values = {}
        for key in _FLOAT_KEYS:
            value = data.get(key)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not finite(value):
                    raise ValueError(f"--generation-config: {source}: {key} must be a number, got {value!r}")
                values[key] = float(value)
        for key, field in (("top_k", "top_k"), ("max_new_tokens", "max_tokens")):
            value = data.get(key)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"--generation-config: {source}: {key} must be an integer, got {value!r}")
                values[field] = value
        if values.get("max_tokens") is not None and values["max_tokens"] < 1:
            raise ValueError(f"--generation-config: {source}: max_new_tokens must be at least 1")
        checked = {k: v for k, v in values.items() if k in _FLOAT_KEYS}
        try:  # the engine's own rules, so that a bad default is found now, not per request
            SamplingParams(**checked)
        except ValueError as e:
            raise ValueError(f"--generation-config: {source}: {e}") from None
        return cls(**values)


def parse_override(text: str | None) -> dict:
    """``--override-generation-config``: a JSON object of generation_config.json's keys."""
    if text is None:
        return {}
    try:
        data = json.loads(text)
    except ValueError as e:  # a JSONDecodeError, or an integer of too many digits
        raise ValueError(f"--override-generation-config is not JSON: {e}") from None
    except RecursionError:  # json nests by recursion
        raise ValueError("--override-generation-config is nested too deeply to read as JSON") from None
    if not isinstance(data, dict):
        raise ValueError("--override-generation-config must be a JSON object, e.g. '{\"temperature\": 0.5}'")
    return data
