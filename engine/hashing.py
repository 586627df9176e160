"""Content hashes of KV blocks: deterministic across processes and machines.

A block's key is a chain of SHA-256 digests (a collision would serve someone else's KV)::

    namespace = SHA-256(canonical encoding of everything that makes KV bytes incompatible)
    h_{-1}    = SHA-256(namespace ‖ u32le(len(salt)) ‖ salt)       salt: UTF-8, "" when none
    h_i       = SHA-256(h_{i-1} ‖ token_ids of block i as u32le)

The salt is length-prefixed so that no salt, however chosen, gives the unsalted root.
Only full blocks have hashes. Python's ``hash()`` is never used (it is salted per process).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import struct
from collections.abc import Sequence

DIGEST_SIZE = 32
# Versions the layout of one block's bytes, [L, 2, block_size, kv_heads, head_dim]; bump on
# any change to it. How the engine's pool arranges its blocks does not enter it.
KV_LAYOUT_VERSION = 1
_NAMESPACE_MAGIC = b"tiered-kv/kv-namespace"
_MAX_TOKEN_ID = 2**32 - 1


@dataclasses.dataclass(frozen=True)
class KVNamespace:
    """Everything that makes one engine's KV bytes incompatible with another's."""

    model_fingerprint: bytes  # digest of the model's config and weights
    kv_dtype: str  # torch dtype name of the cache, e.g. "bfloat16", "float8_e4m3fn"
    kv_scales: tuple[tuple[float, float], ...]  # per layer (k, v); () unless the cache is fp8
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout_version: int = KV_LAYOUT_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.model_fingerprint, bytes) or not self.model_fingerprint:
            raise ValueError("model_fingerprint must be non-empty bytes")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim", "layout_version"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.kv_scales and len(self.kv_scales) != self.num_layers:
            raise ValueError(
                f"kv_scales has {len(self.kv_scales)} entries for {self.num_layers} layers"
            )
        for k, v in self.kv_scales:
            if not (math.isfinite(k) and math.isfinite(v) and k > 0 and v > 0):
                raise ValueError(f"kv scales must be positive and finite, got {(k, v)}")

    def encode(self) -> bytes:
        """The canonical byte encoding: tagged, length-prefixed fields in a fixed order."""
        scales = b"".join(struct.pack("<dd", k, v) for k, v in self.kv_scales)
        fields = (
            (b"model", self.model_fingerprint),
            (b"kv_dtype", self.kv_dtype.encode()),
            (b"kv_scales", scales),
            (b"block_size", struct.pack("<Q", self.block_size)),
            (b"num_layers", struct.pack("<Q", self.num_layers)),
            (b"num_kv_heads", struct.pack("<Q", self.num_kv_heads)),
            (b"head_dim", struct.pack("<Q", self.head_dim)),
            (b"layout_version", struct.pack("<Q", self.layout_version)),
        )
        parts = [_NAMESPACE_MAGIC]
        for tag, value in fields:
            parts += [_length_prefixed(tag), _length_prefixed(value)]
        return b"".join(parts)

    def digest(self) -> bytes:
        return hashlib.sha256(self.encode()).digest()


def root_hash(namespace: bytes, cache_salt: str | None = None) -> bytes:
    """``h_{-1}``: the parent of a sequence's first block."""
    if len(namespace) != DIGEST_SIZE:
        raise ValueError(f"namespace must be a {DIGEST_SIZE}-byte digest, got {len(namespace)}")
    salt = (cache_salt or "").encode()
    return hashlib.sha256(namespace + _length_prefixed(salt)).digest()


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """``h_i`` of a block from its parent's hash and its token ids."""
    return hashlib.sha256(parent + _pack(token_ids)).digest()


def hash_blocks(
    root: bytes, token_ids: Sequence[int], block_size: int, known: Sequence[bytes] = ()
) -> list[bytes]:
    """Hashes of every full block of ``token_ids``, reusing the leading ``known`` ones."""
    hashes = list(known)
    extend_block_hashes(hashes, root, token_ids, block_size, len(token_ids) // block_size)
    return hashes


def extend_block_hashes(
    hashes: list[bytes], root: bytes, token_ids: Sequence[int], block_size: int, num_blocks: int
) -> None:
    """Append to ``hashes`` (the chain of ``token_ids``' first blocks) the hashes of its
    blocks up to ``num_blocks``, in place: only the new blocks' ids are read, so a sequence
    that grows by a block costs one block's hashing, not a copy of its whole history. The
    new blocks' ids are packed in one call, not one per block (a long prompt's prefix
    lookup hashes thousands of blocks on the request's critical path)."""
    start = len(hashes) * block_size
    count = min(num_blocks, len(token_ids) // block_size) - len(hashes)
    if count <= 0:
        return
    data = _pack(token_ids[start : start + count * block_size])
    parent = hashes[-1] if hashes else root
    step = 4 * block_size
    sha256 = hashlib.sha256
    for offset in range(0, count * step, step):
        parent = sha256(parent + data[offset : offset + step]).digest()
        hashes.append(parent)


def _pack(token_ids: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error as e:
        raise ValueError(f"token ids must be integers in [0, {_MAX_TOKEN_ID}]: {e}") from None


def _length_prefixed(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data
