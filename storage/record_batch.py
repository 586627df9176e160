"""A writer's batch of records: blocks of one codec, dtype and shape, held as columns.

A pool writer hands a store ``put_many(batch)``. Iterated, a batch gives ``(key, Record)``
pairs, as every store's ``put_many`` takes them; the disk tier instead seals the whole
batch from its columns (:meth:`RecordBatch.sealed`), without a
:class:`~storage.record.Record` or a ``struct`` pack a block: the headers are filled in a
column at a time by numpy (:meth:`~storage.record.RecordLayout.columns`), the payloads
copied with the GIL released (rows of a pool's slab in runs, :class:`PayloadRows`), and
what is left a record is its MAC. These writers share the GIL with the engine's thread:
the Python they run a block is time the engine may wait for.
"""
from __future__ import annotations

import itertools
import struct
import time
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch

from storage.base import DIGEST_SIZE, BlockKey
from storage.record import (
    RELEASED_ASSEMBLY_BYTES, Record, RecordLayout, check_parent_hash,
)
from storage.seal import SEAL_SIZE, SealKey

_ZERO_DIGEST = bytes(DIGEST_SIZE)


class PayloadRows(Sequence[memoryview]):
    """Payloads that are rows ``rows`` of ``array`` (``[num_rows, payload bytes]`` uint8, a
    pool's slab): a batch copies runs of consecutive rows with one numpy call each."""

    def __init__(self, array: np.ndarray, rows: Sequence[int]) -> None:
        self.array, self.rows = array, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> memoryview:  # type: ignore[override]
        return memoryview(self.array[self.rows[i]])

    def copy_to(self, out: np.ndarray) -> None:
        """``out[i] = array[rows[i]]`` for every ``i``, with the GIL released."""
        rows, array = self.rows, self.array
        first = 0
        for i in range(1, len(rows) + 1):
            if i == len(rows) or rows[i] != rows[i - 1] + 1:
                out[first:i] = array[rows[first] : rows[first] + i - first]
                first = i


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
        payloads: Sequence[bytes | memoryview] | PayloadRows,
    ) -> None:
        if not len(keys) == len(parent_hashes) == len(token_ids) == len(payloads):
            raise ValueError("a record batch needs one parent hash, token ids and payload a key")
        self.layout = RecordLayout.of(codec, dtype, tuple(shape))  # checks the shared fields
        # the digests' lengths at once; the checks one by one name what is wrong
        if set(map(len, itertools.chain.from_iterable(keys))) - {DIGEST_SIZE}:
            for key in keys:
                key.validate()
        if {len(p) for p in parent_hashes if p is not None} - {DIGEST_SIZE}:
            for parent_hash in parent_hashes:
                check_parent_hash(parent_hash)
        self.codec, self.dtype, self.shape = codec, dtype, tuple(shape)
        self.keys, self.parent_hashes = keys, parent_hashes
        self.token_ids, self.payloads = token_ids, payloads
        self.created_ns = [time.time_ns()] * len(keys)
        if isinstance(payloads, PayloadRows):
            self._sizes = [payloads.array.shape[1]] * len(keys)
        else:
            self._sizes = list(map(len, payloads))
        counts = set(map(len, token_ids))
        self._num_tokens = counts.pop() if len(counts) == 1 else None  # None: they differ

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self) -> Iterator[tuple[BlockKey, Record]]:
        for key, parent_hash, token_ids, payload, created_ns in zip(
            self.keys, self.parent_hashes, self.token_ids, self.payloads, self.created_ns
        ):
            record = Record(key, parent_hash, token_ids, self.codec, self.dtype, self.shape,
                            payload, created_ns)
            yield key, record

    def nbytes(self, i: int) -> int:
        """Size of block ``i``'s encoded record."""
        return self.layout.nbytes(len(self.token_ids[i]), self._sizes[i])

    def nbytes_of(self, indices: Iterable[int]) -> int:
        """Total size of the encoded records of blocks ``indices``."""
        if self._num_tokens is None:
            return sum(self.nbytes(i) for i in indices)
        sizes = self._sizes
        payloads = [sizes[i] for i in indices]
        return len(payloads) * self.layout.nbytes(self._num_tokens, 0) + sum(payloads)

    def sealed(self, seal_key: SealKey) -> list[bytes | memoryview]:
        """Each block's record sealed under ``seal_key``, in order: the bytes
        :func:`~storage.record.encode_record` gives for it, as views of one buffer."""
        if not self.keys:
            return []
        if self._num_tokens is None:  # headers of different sizes: one record at a time
            encode = self.layout.encode_buffer
            return [encode(*fields, seal_key) for fields in zip(
                self.keys, self.parent_hashes, self.token_ids, self.payloads, self.created_ns
            )]
        heads = self._headers()  # [n, header bytes]
        n, head = heads.shape
        sizes = self._sizes
        if len(set(sizes)) == 1:  # records of one size: [n, record bytes], a row each
            size = sizes[0]
            grid = np.empty((n, head + size + SEAL_SIZE), dtype=np.uint8)
            grid[:, :head] = heads
            if isinstance(self.payloads, PayloadRows):
                self.payloads.copy_to(grid[:, head : head + size])
            buf = grid.reshape(-1)
            starts: Sequence[int] = range(0, buf.size, grid.shape[1])
        else:
            ends = list(itertools.accumulate(head + size + SEAL_SIZE for size in sizes))
            buf = np.empty(ends[-1], dtype=np.uint8)
            starts = [0, *ends[:-1]]
        flat = memoryview(buf)
        if len(set(sizes)) > 1:
            rows = memoryview(heads).cast("B")
            for i, start in enumerate(starts):
                flat[start : start + head] = rows[i * head : (i + 1) * head]
        if not isinstance(self.payloads, PayloadRows):
            for start, size, payload in zip(starts, sizes, self.payloads):
                _copy_payload(buf, flat, start + head, size, payload)
        seal_key.seal_many(flat, [(start, start + head + size) for start, size in zip(starts, sizes)])
        return [flat[start : start + head + size + SEAL_SIZE] for start, size in zip(starts, sizes)]

    def _headers(self) -> np.ndarray:
        """``[n, header bytes]`` uint8: each record's header, the layout's template with the
        record's own fields written a column at a time."""
        template, columns = self.layout.columns(self._num_tokens)
        n = len(self.keys)
        heads = np.empty(n, dtype=columns)
        rows = heads.view(np.uint8).reshape(n, template.size)
        rows[:] = template
        parents = self.parent_hashes
        heads["flags"] = [p is not None for p in parents]
        heads["payload_len"] = self._sizes
        heads["created_ns"] = self.created_ns
        keys = b"".join(itertools.chain.from_iterable(self.keys))
        heads["key"] = np.frombuffer(keys, dtype=np.uint8).reshape(n, -1)
        parent_hashes = b"".join([p or _ZERO_DIGEST for p in parents])
        heads["parent_hash"] = np.frombuffer(parent_hashes, dtype=np.uint8).reshape(n, -1)
        if self._num_tokens:
            try:
                token_ids = struct.pack(
                    f"<{n * self._num_tokens}I", *itertools.chain.from_iterable(self.token_ids)
                )
            except struct.error as e:
                raise ValueError(f"record field out of range: {e}") from None
            heads["token_ids"] = np.frombuffer(token_ids, dtype="<u4").reshape(n, -1)
        return rows


def _copy_payload(
    buf: np.ndarray, flat: memoryview, at: int, size: int, payload: bytes | memoryview
) -> None:
    """``payload`` into ``buf[at : at + size]``: by numpy, with the GIL released, from
    :data:`~storage.record.RELEASED_ASSEMBLY_BYTES` on; below, a hand-off of the GIL costs
    more than the copy."""
    if size >= RELEASED_ASSEMBLY_BYTES:
        buf[at : at + size] = np.frombuffer(payload, dtype=np.uint8)
    else:
        flat[at : at + size] = memoryview(payload).cast("B")
