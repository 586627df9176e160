from __future__ import annotations

import hashlib
import struct

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.base import BlockKey
from storage.record import (
    DTYPE_CODES,
    FORMAT_VERSION,
    MAGIC,
    Record,
    RecordError,
    decode_record,
    encode_record,
)

digests = st.binary(min_size=32, max_size=32)
keys = st.builds(BlockKey, digests, digests)


@st.composite
def records(draw) -> Record:
    return Record(
        key=draw(keys),
        parent_hash=draw(st.none() | digests),
        token_ids=tuple(draw(st.lists(st.integers(0, 2**32 - 1), max_size=16))),
        codec=draw(st.sampled_from(["raw", "zstd", "kivi2+zstd", "kivi4"])),
        dtype=draw(st.sampled_from(list(DTYPE_CODES))),
        shape=tuple(draw(st.lists(st.integers(0, 64), min_size=1, max_size=6))),
        payload=draw(st.binary(max_size=48)),
        created_ns=draw(st.integers(0, 2**64 - 1)),
    )


def _fields(r: Record) -> tuple:
    return (r.key, r.parent_hash, tuple(r.token_ids), r.codec, r.dtype, tuple(r.shape),
            bytes(r.payload), r.created_ns)


@given(records())
def test_round_trip(record):
    buf = encode_record(record)
    assert len(buf) == record.nbytes
    assert _fields(decode_record(buf, expected_key=record.key)) == _fields(record)
    assert _fields(decode_record(bytearray(buf))) == _fields(record)


@settings(max_examples=25, deadline=None)
@given(records())
def test_every_single_bit_flip_is_detected(record):
    buf = encode_record(record)
    for bit in range(len(buf) * 8):
        flipped = bytearray(buf)
        flipped[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(RecordError):
            decode_record(flipped, expected_key=record.key)


@settings(max_examples=25, deadline=None)
@given(records())
def test_every_truncation_is_detected(record):
    buf = encode_record(record)
    for n in range(len(buf)):
        with pytest.raises(RecordError):
            decode_record(buf[:n], expected_key=record.key)


@given(records(), st.binary(min_size=1, max_size=64))
def test_extension_is_detected(record, tail):
    with pytest.raises(RecordError) as err:
        decode_record(encode_record(record) + tail, expected_key=record.key)
    assert err.value.reason in {"checksum", "length"}


@given(records(), keys)
def test_key_swap_is_detected(record, other):
    if other == record.key:
        return
    with pytest.raises(RecordError) as err:
        decode_record(encode_record(record), expected_key=other)
    assert err.value.reason == "key"


@given(st.sampled_from([b"", MAGIC, MAGIC + struct.pack("<H", FORMAT_VERSION)]),
       st.binary(max_size=512))
def test_arbitrary_bytes_raise_only_record_error(prefix, rest):
    with pytest.raises(RecordError):
        decode_record(prefix + rest)


@given(records(), st.integers(0, 2**16), st.integers(0, 255))
def test_resealed_header_damage_raises_only_record_error(record, pos, value):
    """Damage that a checksum cannot see (re-sealed) still never escapes as another error."""
    buf = bytearray(encode_record(record))
    body = len(buf) - 8
    buf[pos % body] = value
    buf[body:] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(buf[:body])))
    try:
        decode_record(buf)
    except RecordError:
        pass


def test_newer_version_is_named_in_the_error():
    r = Record(BlockKey(bytes(32), bytes(32)), None, (1,), "raw", torch.float16, (1,), b"ab")
    buf = bytearray(encode_record(r))
    buf[4:6] = struct.pack("<H", FORMAT_VERSION + 1)
    with pytest.raises(RecordError, match="version") as err:
        decode_record(buf)
    assert err.value.reason == "version"


def test_payload_is_a_view_not_a_copy():
    k = BlockKey(hashlib.sha256(b"n").digest(), hashlib.sha256(b"b").digest())
    buf = encode_record(Record(k, None, (), "raw", torch.uint8, (4,), b"\x01\x02\x03\x04"))
    assert isinstance(decode_record(buf, k).payload, memoryview)


@pytest.mark.parametrize(
    "bad",
    [
        dict(parent_hash=b"short"),
        dict(codec=""),
        dict(codec="ü"),
        dict(dtype=torch.int64),
        dict(shape=(1,) * 9),
        dict(key=BlockKey(b"x", bytes(32))),
    ],
)
def test_invalid_records_cannot_be_built(bad):
    fields = dict(key=BlockKey(bytes(32), bytes(32)), parent_hash=None, token_ids=(),
                  codec="raw", dtype=torch.float16, shape=(1,), payload=b"")
    with pytest.raises(ValueError):
        Record(**(fields | bad))


def test_out_of_range_token_is_a_value_error():
    r = Record(BlockKey(bytes(32), bytes(32)), None, (2**32,), "raw", torch.float16, (1,), b"")
    with pytest.raises(ValueError):
        encode_record(r)
