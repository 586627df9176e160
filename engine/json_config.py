"""JSON objects read for configuration: a model folder's files, and frozen config dataclasses
read from vLLM-style JSON flags (``--kv-events-config``, ``--speculative-config``): an object
whose keys are the dataclass's fields."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def from_mapping(cls: type[T], data: object, what: str) -> T:
    """``cls(**data)``; ``ValueError`` naming ``what`` for a non-object or an unknown key."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{what} must be a JSON object, got {data!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown {what} keys {unknown}; known: {', '.join(sorted(known))}")
    return cls(**data)


def from_json(cls: type[T], text: str, what: str) -> T:
    """:func:`from_mapping` of the JSON ``text``."""
    try:
        data: Any = json.loads(text)
    except ValueError as e:  # a JSONDecodeError, or an integer of too many digits
        raise ValueError(f"{what} is not valid JSON: {e}") from None
    except RecursionError:  # json nests by recursion
        raise ValueError(f"{what} is nested too deeply to read as JSON") from None
    return from_mapping(cls, data, what)


def read_object(path: Path) -> dict[str, Any]:
    """The JSON object in the file ``path``; ``ValueError`` naming it if it is not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data
