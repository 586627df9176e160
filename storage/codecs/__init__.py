"""Codecs: how a KV block becomes a record payload (``raw``, ``zstd``, ``kivi2``, ``kivi4``
and compositions such as ``kivi2+zstd``). See :mod:`storage.codecs.base` for the contract
and ``docs/codecs.md`` for the formats.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from storage.base import BlockKey
from storage.codecs.base import Codec, CodecError
from storage.codecs.registry import VALID_SPECS, get_codec
from storage.record import Record

__all__ = ["Codec", "CodecError", "VALID_SPECS", "decode_block", "encode_block", "get_codec"]


def encode_block(
    key: BlockKey,
    parent_hash: bytes | None,
    token_ids: Iterable[int],
    kv: torch.Tensor,
    codec: Codec | str,
) -> Record:
    """A :class:`Record` holding ``kv`` (``[L, 2, T, H, D]``, any device) encoded with ``codec``."""
    if isinstance(codec, str):
        codec = get_codec(codec)
    return Record(
        key=key,
        parent_hash=parent_hash,
        token_ids=tuple(int(t) for t in token_ids),
        codec=codec.name,
        dtype=kv.dtype,
        shape=tuple(kv.shape),
        payload=codec.encode(kv),
    )


def decode_block(record: Record, device: torch.device | str = "cpu") -> torch.Tensor:
    """The KV tensor in ``record``; :class:`CodecError` for an unknown codec or a bad payload."""
    try:
        codec = get_codec(record.codec)
    except ValueError as e:
        raise CodecError(f"record for {record.key.short()}: {e}") from None
    return codec.decode(record.payload, record.dtype, record.shape, device)
