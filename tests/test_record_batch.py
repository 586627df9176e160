"""A record batch is the records it holds: iterated, the same ``Record`` s; sealed from its
columns, the same bytes as each record encoded alone; put into the disk tier, the same
records read back, at their priorities."""
from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
import torch

from storage.base import BlockKey
from storage.lmdb_store import LmdbStore
from storage.record import RELEASED_ASSEMBLY_BYTES, Record, encode_record, encode_record_buffer
from storage.record_batch import PayloadRows, RecordBatch
from storage.seal import SealKey

SEAL = SealKey(b"the record batch tests' secret, 32 bytes")
NS = hashlib.sha256(b"record batch").digest()
SHAPE = (2, 2, 4, 1, 8)  # [L, 2, T, H, D]


def key(i: int) -> BlockKey:
    return BlockKey(NS, hashlib.sha256(i.to_bytes(8, "little")).digest())


def batch(sizes: list[int], codec: str = "raw") -> RecordBatch:
    """Blocks 0.. of a chain, block ``i`` with a payload of ``sizes[i]`` seeded bytes."""
    n = len(sizes)
    return RecordBatch(
        codec, torch.bfloat16, SHAPE, [key(i) for i in range(n)],
        [None if i == 0 else key(i - 1).block_hash for i in range(n)],
        [tuple(range(4 * i, 4 * i + 4)) for i in range(n)],
        [memoryview(random.Random(i).randbytes(size)) for i, size in enumerate(sizes)],
    )


SIZES = [48, RELEASED_ASSEMBLY_BYTES - 1, RELEASED_ASSEMBLY_BYTES, 3 << 17]


def test_iterated_a_batch_is_its_records():
    records = batch(SIZES, "zstd")
    pairs = list(records)
    assert [k for k, _ in pairs] == [key(i) for i in range(len(SIZES))]
    for i, (k, record) in enumerate(pairs):
        assert record == Record(k, records.parent_hashes[i], records.token_ids[i], "zstd",
                                torch.bfloat16, SHAPE, records.payloads[i], records.created_ns[i])
        assert records.nbytes(i) == record.nbytes


def test_sealed_from_its_columns_a_batch_is_each_record_encoded():
    records = batch(SIZES)
    for (k, record), data in zip(records, records.sealed(SEAL), strict=True):
        assert bytes(data) == bytes(encode_record_buffer(record, SEAL)) == encode_record(record, SEAL)
        assert len(data) == record.nbytes


def test_payloads_that_are_rows_of_a_slab_seal_as_the_rows_would():
    slab = np.frombuffer(random.Random(0).randbytes(8 * 1000), dtype=np.uint8).reshape(8, 1000)
    rows = [5, 6, 2, 3, 4, 0]  # runs of consecutive rows, and rows alone
    n = len(rows)
    records = RecordBatch("raw", torch.uint8, (1000,), [key(i) for i in range(n)], [None] * n,
                          [(i,) for i in range(n)], PayloadRows(slab, rows))
    for row, (k, record), data in zip(rows, records, records.sealed(SEAL), strict=True):
        assert bytes(record.payload) == slab[row].tobytes()
        assert bytes(data) == encode_record(record, SEAL)
    assert records.nbytes_of(range(n)) == sum(record.nbytes for _, record in records)


@pytest.mark.parametrize(
    "bad",
    [
        dict(dtype=torch.int64),
        dict(shape=(1,) * 9),
        dict(codec=""),
        dict(keys=[BlockKey(b"x", bytes(32))]),
        dict(parent_hashes=[b"short"]),
        dict(payloads=[]),
    ],
)
def test_a_batch_of_invalid_fields_cannot_be_built(bad):
    fields = dict(codec="raw", dtype=torch.float16, shape=(1,), keys=[key(0)],
                  parent_hashes=[None], token_ids=[()], payloads=[b""])
    with pytest.raises(ValueError):
        RecordBatch(**(fields | bad))


def test_the_disk_tier_stores_a_batch_as_its_records(tmp_path):
    records = batch([1000, RELEASED_ASSEMBLY_BYTES, 2000])
    with LmdbStore(tmp_path / "store", 1 << 20) as store:
        assert store.put_many(records, priorities=[3, -1, 0]) == [True, True, True]
        store.flush()
        for (k, record), priority in zip(records, [3, -1, 0]):
            assert encode_record(store.get(k), SEAL) == encode_record(record, SEAL)
            assert store._index.priority(k.to_bytes()) == priority
        assert store.stats().bytes_used == sum(records.nbytes(i) for i in range(len(records)))
