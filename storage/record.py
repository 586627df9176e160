"""The versioned, self-describing record: what a KV block looks like outside GPU memory.

Layout (little-endian)::

    0     4   magic  b"TKVR"
    4     2   format version
    6     2   flags (bit 0: the block has a parent)
    8     4   header length H (from offset 0 to the payload)
    12    8   payload length P
    20    8   created, ns since the epoch
    28   32   namespace digest        ┐ the block's key
    60   32   block hash              ┘
    92   32   parent hash (zeros for a root block)
    124   1   dtype code
    125   1   ndim
    126   2   codec spec length C
    128   4   number of token ids N
    132  4*ndim  shape
         C       codec spec, ASCII (e.g. "kivi2+zstd")
         4*N     token ids (u32)
    H    P    payload
    H+P  8    seal: the sealing key's id         ┐ the seal
    H+P+8 32  seal: BLAKE3 keyed MAC of [0, H+P+8) ┘

The record is exactly ``H + P + 40`` bytes; the seal is always the last forty. The MAC is
keyed (:class:`storage.seal.SealKey`), so only a holder of the secret can build a record
that verifies. Every check is done before any field is trusted, and a failure of any of
them raises :class:`RecordError` (never another exception type).
"""
from __future__ import annotations

import dataclasses
import functools
import struct
import time
from typing import NamedTuple

import numpy as np
import torch

from storage.base import DIGEST_SIZE, BlockKey
from storage.seal import KEY_ID_SIZE, SEAL_SIZE, SealKey

MAGIC = b"TKVR"
FORMAT_VERSION = 2  # 1: an unkeyed xxh3-64 checksum instead of the seal (never read)
MAX_NDIM = 8
MAX_CODEC_LEN = 64
_FLAG_HAS_PARENT = 1
# From this payload size on, :func:`encode_record_buffer` assembles a record with the GIL
# released: ``bytes.join`` holds it for any result under 1 MiB, ~0.1 ms for a 1B model's
# 512 KiB block, all of which a host-bound engine thread waits. Below it a GIL hand-off
# costs more than the copy.
RELEASED_ASSEMBLY_BYTES = 64 << 10

_FIXED = struct.Struct("<4sHHIQQ32s32s32sBBHI")
# Where the fields that differ from record to record start (see the layout above): what
# :class:`storage.record_batch.RecordBatch` writes a column at a time into its headers.
FLAGS_AT, PAYLOAD_LEN_AT, CREATED_AT, KEY_AT, PARENT_AT = 6, 12, 20, 28, 92
_ZERO_DIGEST = bytes(DIGEST_SIZE)

# Stable on-disk codes; never renumber.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float32: 3,
    torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 5,
    torch.uint8: 6,
}
DTYPES_BY_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}


class RecordError(ValueError):
    """A buffer is not a valid record for the key it was read under.

    ``reason`` is one short word for counting: ``length``, ``magic``, ``version``,
    ``keyid`` (sealed under another key), ``mac`` (altered, or sealed by someone without
    the key), ``header``, ``key``.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Record:
    """One KV block with everything needed to verify it and to rebuild its prefix tree.

    ``payload`` is the codec's output; ``dtype`` and ``shape`` describe the decoded tensor.
    """

    key: BlockKey
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    codec: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    payload: bytes | memoryview
    created_ns: int = dataclasses.field(default_factory=time.time_ns)

    def __post_init__(self) -> None:
        self.key.validate()
        check_parent_hash(self.parent_hash)
        check_layout(self.codec, self.dtype, self.shape)

    @property
    def nbytes(self) -> int:
        """Size of the encoded record."""
        return _header_len(len(self.shape), len(self.codec), len(self.token_ids)) + len(
            self.payload
        ) + SEAL_SIZE


def check_parent_hash(parent_hash: bytes | None) -> None:
    if parent_hash is not None and len(parent_hash) != DIGEST_SIZE:
        raise ValueError(f"parent hash must be {DIGEST_SIZE} bytes")


def check_layout(codec: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """``ValueError`` unless a record can hold blocks of ``codec``, ``dtype`` and ``shape``."""
    if dtype not in DTYPE_CODES:
        raise ValueError(f"unsupported dtype for a record: {dtype}")
    if len(shape) > MAX_NDIM:
        raise ValueError(f"at most {MAX_NDIM} dimensions, got {len(shape)}")
    if not codec.isascii() or not 0 < len(codec) <= MAX_CODEC_LEN:
        raise ValueError(f"codec spec must be 1..{MAX_CODEC_LEN} ASCII chars: {codec!r}")


class HeaderColumns(NamedTuple):
    """The headers of records of one layout and number of token ids, for a batch to fill in
    a column at a time: ``template`` ([header bytes] uint8) is the header with the fields
    that differ from record to record zero, and ``dtype`` a numpy record type of the
    header's size that names those fields at their offsets (``flags``, ``payload_len``,
    ``created_ns``, ``key``, ``parent_hash``, ``token_ids``)."""

    template: np.ndarray
    dtype: np.dtype


def _header_len(ndim: int, codec_len: int, num_tokens: int) -> int:
    return _FIXED.size + 4 * ndim + codec_len + 4 * num_tokens


class RecordLayout:
    """What the headers of records of one codec, dtype and shape share, worked out once: a
    record's header is then one ``pack`` of the fields that differ from block to block (a
    writer encodes a batch's records with one layout; :func:`encode_record` looks its
    record's up)."""

    def __init__(self, codec: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        check_layout(codec, dtype, shape)
        self._codec = codec.encode("ascii")
        self._dtype_code = DTYPE_CODES[dtype]
        self._shape = tuple(shape)
        self._headers: dict[int, struct.Struct] = {}  # by the number of token ids
        self._columns: dict[int, HeaderColumns] = {}  # the same

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def of(codec: str, dtype: torch.dtype, shape: tuple[int, ...]) -> RecordLayout:
        """The layout of ``codec``, ``dtype`` and ``shape``, made once (a few are in use)."""
        return RecordLayout(codec, dtype, shape)

    def _header(self, num_tokens: int) -> struct.Struct:
        header = self._headers.get(num_tokens)
        if header is None:
            header = self._headers[num_tokens] = struct.Struct(
                f"{_FIXED.format}{len(self._shape)}I{len(self._codec)}s{num_tokens}I"
            )
        return header

    def columns(self, num_tokens: int) -> HeaderColumns:
        """The headers of records with ``num_tokens`` token ids as columns (see
        :class:`HeaderColumns`)."""
        columns = self._columns.get(num_tokens)
        if columns is None:
            header = self._header(num_tokens)
            zero = BlockKey(_ZERO_DIGEST, _ZERO_DIGEST)
            template = header.pack(*self._fields(header, zero, None, (0,) * num_tokens, 0, 0))
            names = ["flags", "payload_len", "created_ns", "key", "parent_hash"]
            formats: list = ["<u2", "<u8", "<u8", ("u1", 2 * DIGEST_SIZE), ("u1", DIGEST_SIZE)]
            offsets = [FLAGS_AT, PAYLOAD_LEN_AT, CREATED_AT, KEY_AT, PARENT_AT]
            if num_tokens:
                names.append("token_ids")
                formats.append(("<u4", (num_tokens,)))
                offsets.append(header.size - 4 * num_tokens)
            dtype = np.dtype(
                {"names": names, "formats": formats, "offsets": offsets, "itemsize": header.size}
            )
            columns = self._columns[num_tokens] = HeaderColumns(
                np.frombuffer(template, dtype=np.uint8), dtype
            )
        return columns

    def nbytes(self, num_tokens: int, payload_len: int) -> int:
        """Size of an encoded record."""
        return self._header(num_tokens).size + payload_len + SEAL_SIZE

    def _fields(
        self, header: struct.Struct, key: BlockKey, parent_hash: bytes | None,
        token_ids: tuple[int, ...], payload_len: int, created_ns: int,
    ) -> tuple:
        return (
            MAGIC, FORMAT_VERSION, _FLAG_HAS_PARENT if parent_hash is not None else 0,
            header.size, payload_len, created_ns, key.namespace, key.block_hash,
            parent_hash or _ZERO_DIGEST, self._dtype_code, len(self._shape), len(self._codec),
            len(token_ids), *self._shape, self._codec, *token_ids,
        )

    def encode(
        self, key: BlockKey, parent_hash: bytes | None, token_ids: tuple[int, ...],
        payload: bytes | memoryview, created_ns: int, seal_key: SealKey,
    ) -> bytes:
        """The record of these fields sealed under ``seal_key``, as one ``bytes``."""
        header = self._header(len(token_ids))
        try:
            head = header.pack(*self._fields(
                header, key, parent_hash, token_ids, len(payload), created_ns
            ))
        except struct.error as e:
            raise ValueError(f"record field out of range: {e}") from None
        key_id = seal_key.key_id
        return b"".join((head, payload, key_id, seal_key.mac(head, payload, key_id)))

    def encode_buffer(
        self, key: BlockKey, parent_hash: bytes | None, token_ids: tuple[int, ...],
        payload: bytes | memoryview, created_ns: int, seal_key: SealKey,
    ) -> bytes | memoryview:
        """:meth:`encode`'s bytes, for a caller that takes any buffer (the disk tier): a
        payload of :data:`RELEASED_ASSEMBLY_BYTES` or more is copied into a numpy buffer
        with the GIL released, behind a header packed in place, and sealed there with one
        MAC over the buffer (the same MAC: BLAKE3 hashes a stream), so the calling thread
        holds the GIL for a few calls a record, whatever its size."""
        payload = memoryview(payload).cast("B")
        size = payload.nbytes
        if size < RELEASED_ASSEMBLY_BYTES:
            return self.encode(key, parent_hash, token_ids, payload, created_ns, seal_key)
        header = self._header(len(token_ids))
        start, end = header.size, header.size + size
        buf = np.empty(end + SEAL_SIZE, dtype=np.uint8)
        sealed = memoryview(buf)
        try:
            header.pack_into(sealed, 0, *self._fields(
                header, key, parent_hash, token_ids, size, created_ns
            ))
        except struct.error as e:
            raise ValueError(f"record field out of range: {e}") from None
        buf[start:end] = np.frombuffer(payload, dtype=np.uint8)  # lets go of the GIL
        seal_key.seal_into(sealed, end)
        return sealed


def encode_record(record: Record, seal_key: SealKey) -> bytes:
    """Serialize ``record`` sealed under ``seal_key``."""
    layout = RecordLayout.of(record.codec, record.dtype, tuple(record.shape))
    return layout.encode(
        record.key, record.parent_hash, record.token_ids, record.payload, record.created_ns,
        seal_key,
    )


def encode_record_buffer(record: Record, seal_key: SealKey) -> bytes | memoryview:
    """:func:`encode_record`'s bytes as :meth:`RecordLayout.encode_buffer` gives them."""
    layout = RecordLayout.of(record.codec, record.dtype, tuple(record.shape))
    return layout.encode_buffer(
        record.key, record.parent_hash, record.token_ids, record.payload, record.created_ns,
        seal_key,
    )


def sealing_key_id(buf: bytes | memoryview) -> bytes | None:
    """The id of the key ``buf`` says it was sealed under (unverified), or ``None`` if it is
    not a record of this format: to name the key that a record needs."""
    view = memoryview(buf).cast("B")
    if len(view) < _FIXED.size + SEAL_SIZE or bytes(view[:4]) != MAGIC:
        return None
    if struct.unpack_from("<H", view, 4)[0] != FORMAT_VERSION:
        return None
    start = len(view) - SEAL_SIZE
    return bytes(view[start : start + KEY_ID_SIZE])


def stated_parent_hash(buf: bytes | memoryview) -> bytes | None:
    """The parent hash ``buf``'s header names (unverified), or ``None`` for a root or a
    buffer that is not a record of this format: for a hint that is worth no verification
    (the disk tier's eviction order, when its metadata is rebuilt from the records)."""
    view = memoryview(buf).cast("B")
    if len(view) < _FIXED.size + SEAL_SIZE or bytes(view[:4]) != MAGIC:
        return None
    (flags,) = struct.unpack_from("<H", view, FLAGS_AT)
    if not flags & _FLAG_HAS_PARENT:
        return None
    return bytes(view[PARENT_AT : PARENT_AT + DIGEST_SIZE])


def decode_record(
    buf: bytes | memoryview,
    seal_key: SealKey,
    expected_key: BlockKey | None = None,
    *,
    parallel_mac: bool = False,
) -> Record:
    """Parse and verify ``buf`` against ``seal_key``. The returned payload is a view of
    ``buf`` (no copy). ``parallel_mac``: verify a large record on BLAKE3's worker threads
    (for a caller checking one record at a time; see :data:`storage.seal.PARALLEL_MAC_BYTES`).

    Raises :class:`RecordError` if anything is wrong: size, magic, version, the seal (key
    id and MAC), header fields, or (when ``expected_key`` is given) a key that is not the
    one asked for.
    """
    try:
        view = memoryview(buf).cast("B")
    except TypeError:  # a remote server's reply that is not a string (an integer, a list)
        raise RecordError("magic", f"not a record: a {type(buf).__name__}, not bytes") from None
    size = len(view)
    if size < _FIXED.size + SEAL_SIZE:
        raise RecordError("length", f"record of {size} bytes is shorter than any record")
    if bytes(view[:4]) != MAGIC:
        raise RecordError("magic", "not a tiered-kv record (bad magic)")
    (version,) = struct.unpack_from("<H", view, 4)
    if version != FORMAT_VERSION:
        raise RecordError(
            "version", f"record format version {version}, this build reads {FORMAT_VERSION}"
        )
    sealed = size - SEAL_SIZE
    key_id = bytes(view[sealed : sealed + KEY_ID_SIZE])
    if key_id != seal_key.key_id:
        raise RecordError(
            "keyid", f"record sealed under key {key_id.hex()}, not this key ({seal_key.name})"
        )
    if not seal_key.check(
        view[sealed + KEY_ID_SIZE :], view[: sealed + KEY_ID_SIZE], parallel=parallel_mac
    ):
        raise RecordError("mac", "record MAC mismatch (altered, or sealed without the key)")

    (_, _, flags, header_len, payload_len, created_ns, namespace, block_hash, parent, dtype_code,
     ndim, codec_len, num_tokens) = _FIXED.unpack_from(view, 0)
    if ndim > MAX_NDIM or codec_len == 0 or codec_len > MAX_CODEC_LEN or flags & ~_FLAG_HAS_PARENT:
        raise RecordError("header", "record header fields out of range")
    if header_len != _header_len(ndim, codec_len, num_tokens):
        raise RecordError("header", "record header length disagrees with its fields")
    if header_len + payload_len + SEAL_SIZE != size:
        raise RecordError(
            "length",
            f"record declares {header_len + payload_len + SEAL_SIZE} bytes, buffer has {size}",
        )
    if dtype_code not in DTYPES_BY_CODE:
        raise RecordError("header", f"unknown dtype code {dtype_code}")
    pos = _FIXED.size
    shape = struct.unpack_from(f"<{ndim}I", view, pos)
    pos += 4 * ndim
    try:
        codec = bytes(view[pos : pos + codec_len]).decode("ascii")
    except UnicodeDecodeError:
        raise RecordError("header", "codec spec is not ASCII") from None
    pos += codec_len
    token_ids = struct.unpack_from(f"<{num_tokens}I", view, pos)
    key = BlockKey(bytes(namespace), bytes(block_hash))
    if expected_key is not None and key != expected_key:
        raise RecordError("key", f"record is for {key.short()}, expected {expected_key.short()}")
    has_parent = bool(flags & _FLAG_HAS_PARENT)
    if not has_parent and parent != _ZERO_DIGEST:
        raise RecordError("header", "root record carries a parent hash")
    try:
        return Record(
            key=key,
            parent_hash=bytes(parent) if has_parent else None,
            token_ids=token_ids,
            codec=codec,
            dtype=DTYPES_BY_CODE[dtype_code],
            shape=shape,
            payload=view[header_len : header_len + payload_len],
            created_ns=created_ns,
        )
    except ValueError as e:
        raise RecordError("header", f"record header invalid: {e}") from None
