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
    SEAL_SIZE,
    Record,
    RecordError,
    RELEASED_ASSEMBLY_BYTES,
    decode_record,
    encode_record,
    encode_record_buffer,
    sealing_key_id,
)
from storage.seal import KEY_ID_SIZE, SealKey

KEY = SealKey(b"test secret: thirty-two bytes or more")
OTHER_KEY = SealKey(b"another deployment's secret, also long enough")

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
    buf = encode_record(record, KEY)
    assert len(buf) == record.nbytes
    assert _fields(decode_record(buf, KEY, record.key)) == _fields(record)
    assert _fields(decode_record(bytearray(buf), KEY)) == _fields(record)


@settings(max_examples=25, deadline=None)
@given(records())
def test_every_single_bit_flip_is_detected(record):
    buf = encode_record(record, KEY)
    for bit in range(len(buf) * 8):
        flipped = bytearray(buf)
        flipped[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(RecordError):
            decode_record(flipped, KEY, record.key)


@settings(max_examples=25, deadline=None)
@given(records())
def test_every_truncation_is_detected(record):
    buf = encode_record(record, KEY)
    for n in range(len(buf)):
        with pytest.raises(RecordError):
            decode_record(buf[:n], KEY, record.key)


@given(records(), st.binary(min_size=1, max_size=64))
def test_extension_is_detected(record, tail):
    with pytest.raises(RecordError) as err:
        decode_record(encode_record(record, KEY) + tail, KEY, record.key)
    assert err.value.reason in {"mac", "keyid", "length"}


@given(records(), keys)
def test_key_swap_is_detected(record, other):
    if other == record.key:
        return
    with pytest.raises(RecordError) as err:
        decode_record(encode_record(record, KEY), KEY, other)
    assert err.value.reason == "key"


@given(st.sampled_from([b"", MAGIC, MAGIC + struct.pack("<H", FORMAT_VERSION)]),
       st.binary(max_size=512))
def test_arbitrary_bytes_raise_only_record_error(prefix, rest):
    with pytest.raises(RecordError):
        decode_record(prefix + rest, KEY)



@pytest.mark.parametrize("reply", [42, [b"a", b"b"], "text", 1.5])
def test_a_reply_that_is_not_bytes_raises_only_record_error(reply):
    """What a misbehaving remote server may send instead of a string value."""
    with pytest.raises(RecordError):
        decode_record(reply, KEY)

def _reseal(buf: bytearray, key: SealKey, key_id: bytes | None = None) -> bytearray:
    """Seal ``buf`` again under ``key``, claiming ``key_id`` (default: the key's own)."""
    sealed = len(buf) - SEAL_SIZE
    buf[sealed : sealed + KEY_ID_SIZE] = key_id or key.key_id
    buf[sealed + KEY_ID_SIZE :] = key.mac(bytes(buf[: sealed + KEY_ID_SIZE]))
    return buf


@given(records(), st.integers(0, 2**16), st.integers(0, 255))
def test_resealed_header_damage_raises_only_record_error(record, pos, value):
    """Damage that the seal cannot see (sealed again by a key holder) never escapes as
    another error."""
    buf = bytearray(encode_record(record, KEY))
    buf[pos % (len(buf) - SEAL_SIZE)] = value
    try:
        decode_record(_reseal(buf, KEY), KEY)
    except RecordError:
        pass


def _altered(record: Record) -> bytearray:
    """``record`` sealed under KEY with one byte of its KV changed (the attacker's edit)."""
    buf = bytearray(encode_record(record, KEY))
    buf[len(buf) - SEAL_SIZE - 1] ^= 0x55  # the payload's last byte
    return buf


@given(records().filter(lambda r: len(r.payload) > 0))
def test_altered_kv_with_a_recomputed_checksum_is_refused(record):
    """The attack on an unkeyed checksum: change the KV, recompute the xxh3-64 trailer."""
    buf = _altered(record)
    buf[-8:] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(buf[:-8])))
    with pytest.raises(RecordError) as err:
        decode_record(buf, KEY, record.key)
    assert err.value.reason == "mac"


@given(records().filter(lambda r: len(r.payload) > 0))
def test_altered_kv_sealed_without_the_key_is_refused(record):
    """The forger seals with a key of their own and copies our key id."""
    with pytest.raises(RecordError) as err:
        decode_record(_reseal(_altered(record), OTHER_KEY, KEY.key_id), KEY, record.key)
    assert err.value.reason == "mac"


def test_a_record_of_another_key_is_refused_naming_both_keys():
    r = Record(BlockKey(bytes(32), bytes(32)), None, (1,), "raw", torch.float16, (1,), b"ab")
    buf = encode_record(r, OTHER_KEY)
    assert sealing_key_id(buf) == OTHER_KEY.key_id
    with pytest.raises(RecordError) as err:
        decode_record(buf, KEY)
    assert err.value.reason == "keyid"
    assert OTHER_KEY.name in str(err.value) and KEY.name in str(err.value)
    assert decode_record(buf, OTHER_KEY).payload == b"ab"


def test_a_record_of_the_unkeyed_format_is_refused_as_a_version():
    r = Record(BlockKey(bytes(32), bytes(32)), None, (1,), "raw", torch.float16, (1,), b"ab")
    buf = bytearray(encode_record(r, KEY))
    buf[4:6] = struct.pack("<H", 1)
    assert sealing_key_id(buf) is None
    with pytest.raises(RecordError) as err:
        decode_record(buf, KEY)
    assert err.value.reason == "version"


def test_newer_version_is_named_in_the_error():
    r = Record(BlockKey(bytes(32), bytes(32)), None, (1,), "raw", torch.float16, (1,), b"ab")
    buf = bytearray(encode_record(r, KEY))
    buf[4:6] = struct.pack("<H", FORMAT_VERSION + 1)
    with pytest.raises(RecordError, match="version") as err:
        decode_record(buf, KEY)
    assert err.value.reason == "version"


def test_payload_is_a_view_not_a_copy():
    k = BlockKey(hashlib.sha256(b"n").digest(), hashlib.sha256(b"b").digest())
    buf = encode_record(Record(k, None, (), "raw", torch.uint8, (4,), b"\x01\x02\x03\x04"), KEY)
    assert isinstance(decode_record(buf, KEY, k).payload, memoryview)


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
        encode_record(r, KEY)


@pytest.mark.parametrize("size", [48, RELEASED_ASSEMBLY_BYTES - 1, RELEASED_ASSEMBLY_BYTES, 3 << 18])
def test_a_record_assembled_with_the_gil_released_is_the_same_bytes(size):
    payload = memoryview(bytes(range(256)) * (size // 256) + bytes(size % 256))
    record = Record(BlockKey(b"n" * 32, b"h" * 32), b"p" * 32, (1, 2, 3), "raw", torch.uint8, (size,), payload)
    buf = encode_record_buffer(record, KEY)
    assert bytes(buf) == encode_record(record, KEY) and len(buf) == record.nbytes
    assert bytes(decode_record(buf, KEY, record.key).payload) == bytes(payload)
