"""Codec specs: ``TENSOR[+zstd[:LEVEL]]`` or ``zstd[:LEVEL]`` (short for ``raw+zstd``).

Tensor codecs: ``raw``, ``kivi2``, ``kivi4``. The only byte codec is ``zstd``; it comes
last and at most once (compressing zstd output again gains nothing). ``LEVEL`` is omitted
from canonical names when it is the default.
"""
from __future__ import annotations

import functools
import re

from storage.codecs.base import Codec, TensorCodec
from storage.codecs.kivi import KiviCodec
from storage.codecs.raw import RawCodec
from storage.codecs.zstd import DEFAULT_LEVEL, MAX_LEVEL, MIN_LEVEL, ZstdCodec

_TENSOR_CODECS = {
    "raw": RawCodec,
    "kivi2": lambda: KiviCodec(2),
    "kivi4": lambda: KiviCodec(4),
}
_ZSTD = re.compile(r"zstd(?::(-?[0-9]{1,3}))?")

VALID_SPECS = (
    "raw, zstd[:LEVEL], kivi2, kivi4, kivi2+zstd[:LEVEL], kivi4+zstd[:LEVEL] "
    f"(LEVEL {MIN_LEVEL}..{MAX_LEVEL}, default {DEFAULT_LEVEL})"
)


def get_codec(spec: str) -> Codec:
    """The codec for ``spec``; raises ``ValueError`` naming the valid specs if it is not one.

    Codecs are immutable and thread-safe, so one instance per spec is shared.
    """
    if not isinstance(spec, str):
        raise ValueError(f"a codec spec is a string, got {type(spec).__name__}; valid: {VALID_SPECS}")
    return _parse(spec)


@functools.lru_cache(maxsize=64)
def _parse(spec: str) -> Codec:
    parts = spec.split("+")
    if len(parts) == 1 and _ZSTD.fullmatch(parts[0]):
        parts = ["raw", parts[0]]
    if len(parts) > 2 or parts[0] not in _TENSOR_CODECS:
        raise ValueError(f"unknown codec spec {spec!r}; valid: {VALID_SPECS}")
    tensor: TensorCodec = _TENSOR_CODECS[parts[0]]()
    if len(parts) == 1:
        return tensor
    match = _ZSTD.fullmatch(parts[1])
    if match is None:
        raise ValueError(f"unknown codec spec {spec!r}; valid: {VALID_SPECS}")
    level = int(match.group(1)) if match.group(1) is not None else DEFAULT_LEVEL
    if not MIN_LEVEL <= level <= MAX_LEVEL:
        raise ValueError(f"zstd level {level} in {spec!r} is out of range; valid: {VALID_SPECS}")
    return ZstdCodec(tensor, level)
