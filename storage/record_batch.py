"""A writer's batch of records: blocks of one codec, dtype and shape, held as columns.

A pool writer hands a store ``put_many(batch)``. Iterated, a batch gives ``(key, Record)``
pairs, as every store's ``put_many`` takes them; the disk tier instead seals each record
straight from the columns with the batch's one :class:`~storage.record.RecordLayout`
(:meth:`RecordBatch.sealed`), without building a :class:`~storage.record.Record` a block:
a frozen dataclass whose eight fields are set one call each and then checked, an eighth of
a small block's Python on the write path, all of it holding the GIL.
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch

from storage.base import BlockKey
from storage.record import Record, RecordLayout, check_parent_hash
from storage.seal import SealKey


class RecordBatch:
    """Records of blocks ``keys`` (with their ``parent_hashes``, ``token_ids`` and codec
    ``payloads``, one each) that share ``codec``, ``dtype`` and ``shape``, created now.

    The fields are checked as :class:`Record` checks them (the shared ones once):
    ``ValueError`` for any that is not valid.
    """

    def __init__(
        self,
        codec: str,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        keys: Sequence[BlockKey],
        parent_hashes: Sequence[bytes | None],
        token_ids: Sequence[tuple[int, ...]],
        payloads: Sequence[bytes | memoryview],
    ) -> None:
        if not len(keys) == len(parent_hashes) == len(token_ids) == len(payloads):
            raise ValueError("a record batch needs one parent hash, token ids and payload a key")
        self.layout = RecordLayout.of(codec, dtype, tuple(shape))  # checks the shared fields
        for key, parent_hash in zip(keys, parent_hashes):
            key.validate()
            check_parent_hash(parent_hash)
        self.codec, self.dtype, self.shape = codec, dtype, tuple(shape)
        self.keys, self.parent_hashes = keys, parent_hashes
        self.token_ids, self.payloads = token_ids, payloads
        self.created_ns = [time.time_ns() for _ in keys]

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self) -> Iterator[tuple[BlockKey, Record]]:
        for key, parent_hash, token_ids, payload, created_ns in zip(
            self.keys, self.parent_hashes, self.token_ids, self.payloads, self.created_ns
        ):
            record = Record(key, parent_hash, token_ids, self.codec, self.dtype, self.shape,
                            payload, created_ns)
            yield key, record

    def sealed(self, seal_key: SealKey) -> Iterator[tuple[BlockKey, bytes | memoryview, int]]:
        """Each block's key, record sealed under ``seal_key`` (what
        :func:`~storage.record.encode_record_buffer` gives for it) and creation time."""
        encode = self.layout.encode_buffer
        for key, parent_hash, token_ids, payload, created_ns in zip(
            self.keys, self.parent_hashes, self.token_ids, self.payloads, self.created_ns
        ):
            sealed = encode(key, parent_hash, token_ids, payload, created_ns, seal_key)
            yield key, sealed, created_ns

    def nbytes(self, i: int) -> int:
        """Size of block ``i``'s encoded record."""
        return self.layout.nbytes(len(self.token_ids[i]), memoryview(self.payloads[i]).nbytes)
